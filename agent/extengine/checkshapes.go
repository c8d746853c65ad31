package extengine

// The checks of the model shapes (shapes.go) for `engine check`, for an
// engine whose session granted them and whose models declare them: named
// tensors at their shortest and longest, a temporal latent decoded in
// chunks as whole, a reference image that reaches the output, and every
// parameter at a value other than its default. A malformed declaration
// never gets this far: the registration is refused, and the register
// check says why (Config.OnRefused).

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// shapeRequest completes a check's request of stage st of m with what the
// model's shapes need: a reference image where the model takes one, and a
// denoise's conditioning lengths (the longest). The image is fill's
// pattern of the spec's size.
func (c *checker) shapeRequest(r *Request, m Model, st string, fill byte) error {
	if m.Image != nil && slices.Contains(m.Image.Stages, st) {
		img, err := c.alloc(int64(4*r.Spec.Width*r.Spec.Height), 0)
		if err != nil {
			return err
		}
		for i := range img {
			img[i] = byte(i*31+int(fill)) | 0x80*byte(i%4/3) // opaque: alpha >= 128
		}
		r.Image = &Tensor{DType: "uint8", Shape: []int64{int64(r.Spec.Height), int64(r.Spec.Width), 4}, Data: img}
	}
	if l, ok := m.CondLayout(); ok && st == StageDenoise {
		setLens(l, r.Inputs[0].Data, nil)
	}
	return nil
}

// setLens writes a payload's lengths: those of lens (in order of the
// variable tensors), the longest for the rest.
func setLens(l CondLayout, payload []byte, lens []int64) {
	at, v := l.trailer, 0
	for _, s := range l.slots {
		if !s.VarLen {
			continue
		}
		n := s.Shape[0]
		if v < len(lens) {
			n = lens[v]
		}
		binary.LittleEndian.PutUint32(payload[at:], uint32(n))
		at, v = at+4, v+1
	}
}

// whereNamed places byte off of a named encode's output: which tensor, and
// where in it.
func whereNamed(m Model, st string, off int) string {
	l, ok := m.CondLayout()
	if !ok || st != StageEncode {
		return ""
	}
	name, at := l.Locate(int64(off))
	if name == "" {
		return ", in the padding between the named tensors"
	}
	return fmt.Sprintf(", byte %d of named tensor %q", at, name)
}

// shapeChecks runs the shape checks the session's features and models
// call for (none for an engine that declares no shape).
func (c *checker) shapeChecks(ctx context.Context, reg *Registration) []CheckResult {
	var out []CheckResult
	for _, m := range reg.Models {
		if len(m.Conds) > 0 {
			out = append(out, c.namedCond(ctx, m))
		}
		if m.Latent.Temporal > 1 && slices.Contains(m.Stages, StageDecode) {
			out = append(out, c.temporalDecode(ctx, m))
		}
		if m.Image != nil {
			out = append(out, c.imageInput(ctx, m))
		}
		if len(m.Params) > 0 {
			out = append(out, c.params(ctx, m))
		}
	}
	return out
}

// runTask runs r twice over complementary canaries of its output: the
// output, or why the engine failed the check.
func (c *checker) runTask(ctx context.Context, mk func() (Request, error)) ([]byte, string) {
	var outs [2][]byte
	for run, flip := range []bool{false, true} {
		r, err := mk()
		if err != nil {
			return nil, err.Error()
		}
		canary(r.Output.Data, flip)
		tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
		err = c.srv.Run(tctx, r)
		cancel()
		if err != nil {
			return nil, fmt.Sprintf("failed: %v", err)
		}
		outs[run] = r.Output.Data
	}
	switch unwritten, differ, first := compareRuns(outs[0], outs[1]); {
	case unwritten > 0:
		return nil, fmt.Sprintf("%d of the output's %d bytes were never written (first at byte %d)", unwritten, len(outs[0]), first)
	case differ > 0:
		return nil, fmt.Sprintf("two runs of the same task wrote outputs differing in %d of %d bytes (first at byte %d)", differ, len(outs[0]), first)
	}
	return outs[0], ""
}

// namedCond: an encode of a one-letter prompt and of a long one reports
// lengths within each named tensor's bounds (the Server refuses others),
// and a denoise takes its named tensors at their shortest and at their
// longest.
func (c *checker) namedCond(ctx context.Context, m Model) CheckResult {
	const name = "named conditioning"
	l, _ := m.CondLayout()
	var said []string
	if slices.Contains(m.Stages, StageEncode) {
		for _, prompt := range []string{"a", strings.Repeat("a long prompt of many words ", 40)} {
			out, why := c.runTask(ctx, func() (Request, error) {
				r, err := c.request(m, StageEncode, taskSteps, 0)
				r.Spec.Prompt, r.Spec.NegativePrompt = prompt, prompt
				return r, err
			})
			if why != "" {
				return CheckResult{Name: name, Detail: fmt.Sprintf("an encode of a %d-byte prompt: %s", len(prompt), why)}
			}
			lens, err := l.Lens(out) // the Server wrote them from the engine's done
			if err != nil {
				return CheckResult{Name: name, Detail: fmt.Sprintf("an encode of a %d-byte prompt: %v", len(prompt), err)}
			}
			said = append(said, fmt.Sprintf("a %d-byte prompt: lengths %v", len(prompt), lens))
		}
	}
	if slices.Contains(m.Stages, StageDenoise) {
		for _, shortest := range []bool{true, false} {
			_, why := c.runTask(ctx, func() (Request, error) {
				r, err := c.request(m, StageDenoise, taskSteps, 0)
				if err == nil && shortest {
					ones := slices.Repeat([]int64{1}, MaxConds)
					setLens(l, r.Inputs[0].Data, ones)
				}
				return r, err
			})
			if why != "" {
				at := "longest"
				if shortest {
					at = "shortest (length 1)"
				}
				return CheckResult{Name: name, Detail: fmt.Sprintf("a denoise of named tensors at their %s: %s", at, why)}
			}
		}
		said = append(said, "denoise at the shortest and longest lengths")
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("%v: %s", l.Names(), strings.Join(said, "; "))}
}

// temporalDecode: a decode of latent frames [0,2) writes the 1+Temporal
// video frames whole, the same bytes as decoding [0,1) and [1,2) apart:
// the agent decodes a video chunk by chunk, so a decode must not depend on
// how the latent was cut.
func (c *checker) temporalDecode(ctx context.Context, m Model) CheckResult {
	const name = "temporal latent"
	t := int(m.Latent.Temporal)
	frames := 1 + t // two latent frames
	decode := func(first, k int, latent []byte) func() (Request, error) {
		return func() (Request, error) {
			r, err := c.request(m, StageDecode, taskSteps, 0)
			if err != nil {
				return r, err
			}
			r.Spec.Frames = frames
			fb := int64(len(r.Inputs[0].Data))
			in, err := c.alloc(int64(k)*fb, 0)
			if err != nil {
				return r, err
			}
			copy(in, latent[int64(first)*fb:])
			shape := slices.Clone(r.Inputs[0].Shape)
			shape[0] = int64(k)
			r.Inputs[0] = Tensor{DType: r.Inputs[0].DType, Shape: shape, Data: in}
			_, n := m.VideoFrames(first, k)
			o := r.Output
			pix := int64(len(o.Data))
			out, err := c.alloc(int64(n)*pix, 0)
			if err != nil {
				return r, err
			}
			r.Output = Tensor{DType: "uint8", Shape: []int64{int64(n), o.Shape[1], o.Shape[2], 4}, Data: out}
			r.FirstFrame, r.Frames = first, k
			return r, nil
		}
	}
	one, err := c.request(m, StageDecode, taskSteps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	latent := make([]byte, 2*len(one.Inputs[0].Data))
	for i := range latent { // two different, finite latent frames
		latent[i] = byte(i % 7)
	}
	if one.Inputs[0].DType == "float32" {
		for i := 0; i+4 <= len(latent); i += 4 {
			binary.LittleEndian.PutUint32(latent[i:], math.Float32bits(float32(i%97)/97-0.5))
		}
	}
	whole, why := c.runTask(ctx, decode(0, 2, latent))
	if why != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a decode of latent frames [0,2) into video frames [0,%d): %s", frames, why)}
	}
	if c.srv.Engine().Supports(FeatureDecodeState) {
		// The chunks of a decode go as one stream: checked, with the
		// state's other rules, by the decode stream check.
		return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("temporal %d: 2 latent frames decode whole to %d video frames (decoded apart: the decode stream check)", t, frames)}
	}
	first, why := c.runTask(ctx, decode(0, 1, latent))
	if why != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a decode of latent frame 0 into video frame 0: %s", why)}
	}
	second, why := c.runTask(ctx, decode(1, 1, latent))
	if why != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a decode of latent frame 1 into video frames [1,%d): %s", frames, why)}
	}
	if d := differ(append(first, second...), whole); d != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("latent frames [0,2) decoded whole and decoded one at a time differ: %s; the agent decodes chunk by chunk, so a latent frame must decode alone (or the engine asks for %s)", d, FeatureDecodeState)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("temporal %d: 2 latent frames decode to %d video frames, whole or one at a time the same bytes", t, frames)}
}

// imageInput: the stage the image reaches, run with two different images,
// writes two different outputs (each written whole, deterministically).
func (c *checker) imageInput(ctx context.Context, m Model) CheckResult {
	const name = "image input"
	st := ""
	for _, s := range m.Image.Stages {
		if st == "" && slices.Contains(m.Stages, s) {
			st = s
		}
	}
	if st == "" {
		return CheckResult{Name: name, Skip: true, Detail: fmt.Sprintf("model %s takes its image at %v, which this engine does not serve", m.Name, m.Image.Stages)}
	}
	var outs [2][]byte
	for i, fill := range []byte{0, 0x55} {
		out, why := c.runTask(ctx, func() (Request, error) {
			r, err := c.request(m, st, taskSteps, 0)
			if err == nil {
				err = c.shapeRequest(&r, m, st, fill)
			}
			return r, err
		})
		if why != "" {
			return CheckResult{Name: name, Detail: fmt.Sprintf("%s with a reference image: %s", st, why)}
		}
		outs[i] = out
	}
	if bytes.Equal(outs[0], outs[1]) {
		return CheckResult{Name: name, Detail: fmt.Sprintf("%s wrote the same output for two different reference images: the engine does not use the image it declares", st)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("%s: two different images, two different outputs", st)}
}

// params: the first stage of m, run with each parameter at a value other
// than its default, succeeds deterministically; the line says which
// parameters changed its output.
func (c *checker) params(ctx context.Context, m Model) CheckResult {
	const name = "params"
	st := StageDenoise
	if !slices.Contains(m.Stages, st) {
		st = m.Stages[0]
	}
	base, why := c.runTask(ctx, func() (Request, error) { return c.request(m, st, taskSteps, 0) })
	if why != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("%s with the defaults: %s", st, why)}
	}
	var changed, same []string
	for _, p := range m.Params {
		v := otherValue(p)
		out, why := c.runTask(ctx, func() (Request, error) {
			r, err := c.request(m, st, taskSteps, 0)
			r.Spec.Params = engine.Params{p.Name: v}
			return r, err
		})
		if why != "" {
			return CheckResult{Name: name, Detail: fmt.Sprintf("%s with %s = %v: %s", st, p.Name, v, why)}
		}
		if bytes.Equal(out, base) {
			same = append(same, p.Name)
		} else {
			changed = append(changed, p.Name)
		}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("%s with each parameter off its default: changed the output %v, not %v", st, changed, same)}
}

// otherValue is a valid value of p other than its default.
func otherValue(p engine.ParamSpec) engine.ParamValue {
	switch p.Type {
	case engine.ParamTypeNumber:
		if p.Default.Num != p.Max {
			return engine.NumberParam(p.Max)
		}
		return engine.NumberParam(p.Min)
	case engine.ParamTypeInteger:
		if float64(p.Default.Int) != p.Max {
			return engine.IntegerParam(int64(p.Max))
		}
		return engine.IntegerParam(int64(p.Min))
	case engine.ParamTypeBool:
		return engine.BoolParam(!p.Default.Bool)
	}
	for _, v := range p.Values {
		if v != p.Default.Str {
			return engine.StringParam(v)
		}
	}
	return p.Default
}
