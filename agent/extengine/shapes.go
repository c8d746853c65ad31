package extengine

// This file holds protocol v2's model shapes (issue 20), four features an
// engine asks for and the agent grants like the others:
//
//   - named_cond: a model's conditioning is several named tensors (FLUX and
//     SD3: T5 token embeddings and a pooled CLIP vector), one of them with a
//     sequence length that varies per request. The agent still moves them
//     as one payload (Model.Cond, uint8, laid out by condLayout) and the
//     engine gets one region per tensor.
//   - temporal_latent: the latent compresses time (Wan: 81 frames -> 21
//     latent frames); LatentFrames and VideoFrames map between the two.
//   - image_input: a request's reference image, RGBA in the arena, for the
//     stages the model names.
//   - model_params: a parameter schema (engine.ParamSpec) and a task's
//     complete parameters.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// Features of the model shapes (Version2).
const (
	FeatureNamedCond = "named_cond"      // Model.Conds; task conds; done lens
	FeatureTemporal  = "temporal_latent" // LatentLayout.Temporal; task video_first, video_frames
	FeatureImage     = "image_input"     // Model.Image; task ref_image
	FeatureParams    = "model_params"    // Model.Params; task params
)

// Bounds of the model shapes.
const (
	// MaxConds bounds a model's named conditioning tensors, and a done's lens.
	MaxConds = 8
	// maxCondName bounds a named tensor's name ([a-z0-9_]).
	maxCondName = 32
	// CondAlign aligns each named tensor within the conditioning payload
	// (and the lengths after them), so that every view of it is aligned
	// for any dtype and for a device copy.
	CondAlign = 64
	// MaxCondBytes bounds a model's whole conditioning payload.
	MaxCondBytes = 256 << 20
	// maxCondDim bounds one dimension of a named tensor.
	maxCondDim = 1 << 20
	// MaxTemporal bounds a latent's temporal compression.
	MaxTemporal = 16
)

// CondTensor is one named conditioning tensor of a model: encode's output,
// denoise's input.
type CondTensor struct {
	Name  string  `msgpack:"name"`
	DType string  `msgpack:"dtype"`
	Shape []int64 `msgpack:"shape"`
	// VarLen: dimension 0 is a sequence length that varies per request,
	// up to Shape[0]. The encode reports the length it wrote (done's
	// lens); the denoise gets the tensor at that length.
	VarLen bool `msgpack:"var_len,omitempty"`
}

// ImageDecl is how a model takes a request's reference image.
type ImageDecl struct {
	// Stages the image is delivered to: encode and/or denoise.
	Stages []string `msgpack:"stages"`
	// Required: a request without one is refused at submission.
	Required bool `msgpack:"required,omitempty"`
}

// NamedRegion is one named tensor of a task: a region of the arena.
type NamedRegion struct {
	Name  string  `msgpack:"name"`
	Off   int64   `msgpack:"off"`
	Len   int64   `msgpack:"len"`
	DType string  `msgpack:"dtype"`
	Shape []int64 `msgpack:"shape"`
}

// Region is nr's region.
func (nr NamedRegion) Region() Region {
	return Region{Off: nr.Off, Len: nr.Len, DType: nr.DType, Shape: nr.Shape}
}

// shapeFeatures need no memory lent by the Server (checkpoint and
// tensor_cache do): they are granted to any v2 engine asking.
var shapeFeatures = []string{FeatureNamedCond, FeatureTemporal, FeatureImage, FeatureParams}

// needsAlloc reports whether granting feature needs the Server's allocator.
func needsAlloc(feature string) bool {
	return !slices.Contains(shapeFeatures, feature) && !slices.Contains(lifecycleFeatures, feature) && feature != FeatureBatch
}

// dropUngranted clears what mo declares of the shape features reg did not
// grant: the agent neither sends their fields nor reads them.
func dropUngranted(mo *Model, reg *Registration) {
	if !reg.Supports(FeatureNamedCond) {
		mo.Conds = nil
	}
	if !reg.Supports(FeatureTemporal) {
		mo.Latent.Temporal = 0
	}
	if !reg.Supports(FeatureImage) {
		mo.Image = nil
	}
	if !reg.Supports(FeatureParams) {
		mo.Params = nil
	}
	if !reg.Supports(FeatureBatch) {
		mo.Batch = nil
	}
}

// condSlot is where a named tensor lies in the conditioning payload.
type condSlot struct {
	CondTensor
	off, bytes int64 // at its maximum length
	row        int64 // bytes of one step of dimension 0
}

// CondLayout is how a model's named tensors lie in its one conditioning
// payload: each at an offset that is a multiple of CondAlign, in declared
// order, at its maximum size; then, after the last aligned up, one
// little-endian uint32 per VarLen tensor, in declared order: the length
// its encode wrote. Total is the payload's size.
type CondLayout struct {
	slots   []condSlot
	trailer int64
	Total   int64
}

func alignUp(n int64) int64 { return (n + CondAlign - 1) / CondAlign * CondAlign }

// condLayout lays out conds, bounding each and the whole.
func condLayout(conds []CondTensor) (CondLayout, error) {
	var l CondLayout
	at, nvar := int64(0), int64(0)
	for _, c := range conds {
		n := DTypeSize(c.DType)
		for _, d := range c.Shape {
			if d < 1 || d > maxCondDim || n > MaxCondBytes/d {
				return l, fmt.Errorf("named tensor %q: shape %v out of range", c.Name, c.Shape)
			}
			n *= d
		}
		at = alignUp(at)
		l.slots = append(l.slots, condSlot{CondTensor: c, off: at, bytes: n, row: n / c.Shape[0]})
		at += n
		if at > MaxCondBytes {
			return l, fmt.Errorf("named tensors of more than %d bytes", MaxCondBytes)
		}
		if c.VarLen {
			nvar++
		}
	}
	l.trailer, l.Total = at, at
	if nvar > 0 {
		l.trailer = alignUp(at)
		l.Total = l.trailer + 4*nvar
	}
	return l, nil
}

// CondLayout is the layout of mo's named conditioning (ok false: the model
// has one conditioning tensor, Cond).
func (mo Model) CondLayout() (CondLayout, bool) {
	if len(mo.Conds) == 0 {
		return CondLayout{}, false
	}
	l, err := condLayout(mo.Conds)
	return l, err == nil
}

// Names lists the named tensors in order.
func (l CondLayout) Names() []string {
	out := make([]string, len(l.slots))
	for i, s := range l.slots {
		out[i] = s.Name
	}
	return out
}

// Locate names the tensor byte off of the payload falls in, and where in
// it; "" when it is padding or the lengths.
func (l CondLayout) Locate(off int64) (name string, at int64) {
	for _, s := range l.slots {
		if off >= s.off && off < s.off+s.bytes {
			return s.Name, off - s.off
		}
	}
	return "", 0
}

// regions are the named tensors of payload (at arena offset base): at
// their maximum size (an encode's outputs, lens nil) or at the lengths in
// lens.
func (l CondLayout) regions(base int64, lens []int64) []NamedRegion {
	out := make([]NamedRegion, len(l.slots))
	v := 0
	for i, s := range l.slots {
		shape, n := slices.Clone(s.Shape), s.bytes
		if s.VarLen && lens != nil {
			shape[0], n = lens[v], lens[v]*s.row
		}
		if s.VarLen {
			v++
		}
		out[i] = NamedRegion{Name: s.Name, Off: base + s.off, Len: n, DType: s.DType, Shape: shape}
	}
	return out
}

// Lens reads the lengths an encode wrote from payload's trailer, checking
// each against its tensor's maximum.
func (l CondLayout) Lens(payload []byte) ([]int64, error) {
	if int64(len(payload)) != l.Total {
		return nil, fmt.Errorf("%w: a conditioning payload of %d bytes, the model's is %d", engine.ErrBadTensor, len(payload), l.Total)
	}
	var lens []int64
	at := l.trailer
	for _, s := range l.slots {
		if !s.VarLen {
			continue
		}
		n := int64(binary.LittleEndian.Uint32(payload[at:]))
		at += 4
		if n < 1 || n > s.Shape[0] {
			return nil, fmt.Errorf("%w: named tensor %q of length %d, want 1-%d", engine.ErrBadTensor, s.Name, n, s.Shape[0])
		}
		lens = append(lens, n)
	}
	return lens, nil
}

// finish completes an encode's payload from the lengths the engine
// reported (done's lens; a VarLen tensor not named is at its maximum):
// the bytes past each length and the alignment padding are zeroed, so that
// the payload is a function of what the engine wrote, and the lengths go
// into the trailer.
func (l CondLayout) finish(payload []byte, lens map[string]int32) error {
	if int64(len(payload)) != l.Total {
		return fmt.Errorf("a conditioning payload of %d bytes, the model's is %d", len(payload), l.Total)
	}
	for name := range lens {
		i := slices.IndexFunc(l.slots, func(s condSlot) bool { return s.Name == name })
		if i < 0 || !l.slots[i].VarLen {
			return fmt.Errorf("the engine reported a length for %q, which is not a named tensor of variable length (%v)", name, l.Names())
		}
	}
	at, trailer := int64(0), l.trailer
	for _, s := range l.slots {
		clear(payload[at:s.off])
		n := s.Shape[0]
		if s.VarLen {
			if got, ok := lens[s.Name]; ok {
				n = int64(got)
			}
			if n < 1 || n > s.Shape[0] {
				return fmt.Errorf("the engine reported length %d for named tensor %q, want 1-%d", n, s.Name, s.Shape[0])
			}
			binary.LittleEndian.PutUint32(payload[trailer:], uint32(n))
			trailer += 4
		}
		end := s.off + n*s.row
		clear(payload[end : s.off+s.bytes])
		at = s.off + s.bytes
	}
	clear(payload[at:l.trailer])
	return nil
}

// LatentFrames is how many latent frames a video of frames frames has: a
// temporal VAE keeps the first frame alone and compresses each following
// group of Temporal frames into one (Wan: 81 -> 21).
func (mo Model) LatentFrames(frames int) int {
	t := int(mo.Latent.Temporal)
	if t <= 1 || frames <= 1 {
		return frames
	}
	return (frames-1)/t + 1
}

// VideoFrames is the range of video frames latent frames [first,
// first+k) decode to: latent frame 0 to video frame 0, latent frame j >= 1
// to video frames Temporal*(j-1)+1 ... Temporal*j.
func (mo Model) VideoFrames(first, k int) (vfirst, n int) {
	t := int(mo.Latent.Temporal)
	if t <= 1 {
		return first, k
	}
	if first > 0 {
		vfirst = t*(first-1) + 1
	}
	return vfirst, t*(first+k-1) + 1 - vfirst
}

// validName reports whether s can name a tensor: 1 to maxCondName bytes of
// [a-z0-9_], starting with a letter (a parameter's rule).
func validName(s string) bool { return len(s) <= maxCondName && engine.ValidParamName(s) }

// validateShapes checks what mo declares of the shape features.
func (mo *Model) validateShapes() error {
	if len(mo.Conds) > MaxConds {
		return fmt.Errorf("%d named conditioning tensors, at most %d", len(mo.Conds), MaxConds)
	}
	for i, c := range mo.Conds {
		if !validName(c.Name) {
			return fmt.Errorf("named tensor %d: name %q: want 1-%d bytes of [a-z0-9_], starting with a letter", i, c.Name, maxCondName)
		}
		if slices.ContainsFunc(mo.Conds[:i], func(o CondTensor) bool { return o.Name == c.Name }) {
			return fmt.Errorf("named tensor %q declared twice", c.Name)
		}
		if !validDType(c.DType) || len(c.Shape) == 0 || len(c.Shape) > MaxDims {
			return fmt.Errorf("named tensor %q: layout %s %v", c.Name, c.DType, c.Shape)
		}
	}
	if len(mo.Conds) > 0 {
		l, err := condLayout(mo.Conds)
		if err != nil {
			return err
		}
		if mo.Cond.DType != "uint8" || len(mo.Cond.Shape) != 1 || mo.Cond.Shape[0] != l.Total {
			return fmt.Errorf("cond %s %v: with named tensors it must be uint8 [%d], the payload they make (each at a multiple of %d bytes, then a uint32 length per var_len tensor)",
				mo.Cond.DType, mo.Cond.Shape, l.Total, CondAlign)
		}
	}
	if t := mo.Latent.Temporal; t < 0 || t > MaxTemporal {
		return fmt.Errorf("latent temporal %d, want 0-%d", t, MaxTemporal)
	} else if t > 1 && (mo.FrameStep != t || mo.FrameOffset != 1) {
		return fmt.Errorf("latent temporal %d needs frame_step %d and frame_offset 1 (videos of %dk+1 frames), not %d and %d", t, t, t, mo.FrameStep, mo.FrameOffset)
	}
	if im := mo.Image; im != nil {
		if len(im.Stages) == 0 || len(im.Stages) > 2 {
			return fmt.Errorf("image for %d stages, want encode and/or denoise", len(im.Stages))
		}
		for i, st := range im.Stages {
			if st != StageEncode && st != StageDenoise || slices.Contains(im.Stages[:i], st) {
				return fmt.Errorf("image for stages %v, want encode and/or denoise", im.Stages)
			}
		}
	}
	if err := engine.ValidateSchema(mo.Params); err != nil {
		return fmt.Errorf("params: %v", err)
	}
	return nil
}

// Inputs is what mo takes beyond a spec's fields, for submissions.
func (mo Model) Inputs() engine.ModelInputs {
	in := engine.ModelInputs{Params: mo.Params}
	if mo.Image != nil {
		in.Image = &engine.ImageInput{Required: mo.Image.Required}
	}
	return in
}

// validateShapeFields checks m's fields of the shape features: only in a
// version 2 frame of the type that carries them, and bounded.
func (m *Msg) validateShapeFields() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	task := len(m.Conds) > 0 || len(m.Params) > 0 || m.RefImage != nil || m.VideoFirst != 0 || m.VideoFrames != 0
	if (task || len(m.Lens) > 0) && m.V < Version2 {
		return bad("version %d fields in a version %d frame", Version2, m.V)
	}
	if task && m.T != TypeTask || len(m.Lens) > 0 && m.T != TypeDone {
		return bad("fields of another frame type")
	}
	if len(m.Conds) > MaxConds || len(m.Lens) > MaxConds {
		return bad("%d named tensors, %d lengths; at most %d", len(m.Conds), len(m.Lens), MaxConds)
	}
	for _, c := range m.Conds {
		if !validName(c.Name) {
			return bad("named tensor %q", c.Name)
		}
		if err := c.Region().validate(); err != nil {
			return bad("named tensor %q: %v", c.Name, err)
		}
	}
	for name, n := range m.Lens {
		if !validName(name) || n < 1 || n > maxCondDim {
			return bad("length %d of %q", n, name)
		}
	}
	if len(m.Params) > engine.MaxParams {
		return bad("%d params, at most %d", len(m.Params), engine.MaxParams)
	}
	for name, v := range m.Params {
		if !engine.ValidParamName(name) || v.Kind == 0 || len(v.Str) > engine.MaxParamString ||
			v.Kind == engine.ParamNumber && (math.IsNaN(v.Num) || math.IsInf(v.Num, 0)) {
			return bad("param %q = %v", name, v)
		}
	}
	if r := m.RefImage; r != nil {
		if err := r.validate(); err != nil {
			return bad("ref_image: %v", err)
		}
		if r.DType != "uint8" || len(r.Shape) != 3 || r.Shape[2] != 4 || r.Shape[0] > engine.MaxImageSide || r.Shape[1] > engine.MaxImageSide {
			return bad("ref_image %s %v: want uint8 [height, width, 4], sides at most %d", r.DType, r.Shape, engine.MaxImageSide)
		}
	}
	if m.VideoFirst < 0 || m.VideoFrames < 0 {
		return bad("video frames %d from %d", m.VideoFrames, m.VideoFirst)
	}
	return nil
}

// ErrNoImage: a task of a model that takes a reference image at its stage
// came without one, or the session cannot deliver one.
var ErrNoImage = errors.New("extengine: no reference image for the task")

// shapeTask adds task m's fields of the shape features the session granted
// and mo declares: its complete parameters, its reference image (retained
// with the task's regions), its named tensors, and a decode's video frames.
// A named encode's output is completed after the engine's done (p.cond).
func (s *Server) shapeTask(m *Msg, p *pending, mo Model, r Request, region func(Tensor) (Region, error)) error {
	params, err := engine.ApplyParams(mo.Params, r.Spec.Params)
	if err != nil {
		return fmt.Errorf("%w: model %q: %w", engine.ErrBadSpec, mo.Name, err)
	}
	m.Params = params
	if mo.Image != nil && slices.Contains(mo.Image.Stages, r.Stage) {
		switch {
		case r.Image != nil:
			reg, err := region(*r.Image)
			if err != nil {
				return err
			}
			m.RefImage = &reg
		case mo.Image.Required:
			return fmt.Errorf("%w: model %q takes one at %s", ErrNoImage, mo.Name, r.Stage)
		}
	}
	if l, ok := mo.CondLayout(); ok {
		switch r.Stage {
		case StageEncode:
			m.Conds = l.regions(m.Output.Off, nil)
			p.cond, p.condOut = &l, r.Output.Data
		case StageDenoise:
			if len(r.Inputs) != 1 {
				return fmt.Errorf("%w: a denoise of %d inputs, want the conditioning", engine.ErrBadTensor, len(r.Inputs))
			}
			lens, err := l.Lens(r.Inputs[0].Data)
			if err != nil {
				return err
			}
			m.Conds = l.regions(m.Inputs[0].Off, lens)
		}
	}
	if r.Stage == StageDecode && mo.Latent.Temporal > 1 {
		first, n := mo.VideoFrames(r.FirstFrame, r.Frames)
		m.VideoFirst, m.VideoFrames = int32(first), int32(n)
	}
	return nil
}

// finishShapes completes a task the engine answered done: a named
// encode's payload, from the lengths the engine reported.
func (p *pending) finishShapes() error {
	if p.cond == nil {
		return nil
	}
	if err := p.cond.finish(p.condOut, p.lens); err != nil {
		return fmt.Errorf("%w: done: %v", ErrBadOutput, err)
	}
	return nil
}

// ErrBadOutput: the engine answered done, but what it reported of its
// output does not fit the model (a length beyond a named tensor's maximum).
var ErrBadOutput = errors.New("extengine: engine output does not fit the model")
