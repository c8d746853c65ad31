package extengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/gossip/msgpackcheck"
)

// ProtocolVersion is the version of the worker protocol this package speaks.
// Every frame carries it; a frame of another version is refused.
const ProtocolVersion = 1

// Bounds on what an engine may send, checked before anything is decoded:
// msgpack/v5 sizes allocations from the headers it reads (and is reported
// to ignore its own allocation limit), so the frame length and every
// declared length and element count are checked against the bytes present
// first (gossip/msgpackcheck).
const (
	// MaxFrame bounds one frame's body; a preview image is the largest.
	MaxFrame = 1 << 20
	// MaxPreview bounds a preview image.
	MaxPreview = 512 << 10
	// MaxModels bounds the models one engine registers (gossip carries them).
	MaxModels = 6
	// MaxDims bounds a tensor's rank.
	MaxDims = 8
	// MaxText bounds free-text fields (engine name, reasons).
	MaxText = 1024
	// maxDepth bounds msgpack nesting: frame > models > model > layout > shape.
	maxDepth = 6
)

// Message types.
const (
	TypeRegister  = "register"  // engine -> agent: models it serves
	TypeWelcome   = "welcome"   // agent -> engine: arena fd attached, heartbeat period
	TypeRefused   = "refused"   // agent -> engine: registration refused, with a reason; then close
	TypeHeartbeat = "heartbeat" // both ways
	TypeTask      = "task"      // agent -> engine
	TypeCancel    = "cancel"    // agent -> engine: stop Task at the next step boundary
	TypeProgress  = "progress"  // engine -> agent: Step of Total done
	TypePreview   = "preview"   // engine -> agent: a small PNG of the work so far
	TypeDone      = "done"      // engine -> agent: Task's output is written
	TypeFailed    = "failed"    // engine -> agent: Task failed (Code, Reason)
)

// Failure codes an engine reports in Msg.Code.
const (
	CodeCancelled = "cancelled" // stopped after a Cancel
	CodeBadInput  = "bad_input" // the task's inputs or spec were unusable
	CodeInternal  = "engine_error"
)

// Stage names, as in jobs.Stage (this package does not import jobs).
const (
	StageEncode  = "encode"
	StageDenoise = "denoise"
	StageDecode  = "decode"
)

// Msg is every frame of the protocol: one fixed struct, whose fields in use
// depend on T. Decoding into a fixed struct (never interface{}) is what lets
// msgpackcheck bound it.
type Msg struct {
	V uint8  `msgpack:"v"`
	T string `msgpack:"t"`
	// Task names the task of task, cancel, progress, preview, done, failed.
	Task uint64 `msgpack:"task,omitempty"`

	// register
	Engine string           `msgpack:"engine,omitempty"` // name and version, for logs
	Models []Model          `msgpack:"models,omitempty"`
	Slots  map[string]int32 `msgpack:"slots,omitempty"` // stage -> tasks run at once

	// welcome
	ArenaSize   int64  `msgpack:"arena_size,omitempty"`
	HeartbeatMS int64  `msgpack:"heartbeat_ms,omitempty"`
	Node        string `msgpack:"node,omitempty"`

	// task
	Stage      string       `msgpack:"stage,omitempty"`
	Model      string       `msgpack:"model,omitempty"`
	Spec       *engine.Spec `msgpack:"spec,omitempty"`
	Inputs     []Region     `msgpack:"inputs,omitempty"`
	Output     *Region      `msgpack:"output,omitempty"`
	FirstFrame int32        `msgpack:"first_frame,omitempty"` // decode: latent frame of the input's first
	Frames     int32        `msgpack:"frames,omitempty"`      // decode: frames in the input

	// progress, preview
	Step  int32  `msgpack:"step,omitempty"`
	Total int32  `msgpack:"total,omitempty"`
	Image []byte `msgpack:"image,omitempty"` // preview: PNG

	// failed, refused
	Code   string `msgpack:"code,omitempty"`
	Reason string `msgpack:"reason,omitempty"`
}

// Region is a tensor in the agent's arena: Len bytes at Off, of DType and
// Shape (row-major, little-endian).
type Region struct {
	Off   int64   `msgpack:"off"`
	Len   int64   `msgpack:"len"`
	DType string  `msgpack:"dtype"`
	Shape []int64 `msgpack:"shape"`
}

// Model is what an engine declares about one model it serves.
type Model struct {
	Name   string   `msgpack:"name"`
	Stages []string `msgpack:"stages"`
	// DefaultSteps is the model's usual denoise step count: gossiped with
	// the models served, it is what a request naming the model and no
	// steps gets.
	DefaultSteps int32 `msgpack:"default_steps,omitempty"`
	// Limits the model accepts (Limits): what each one given says
	// replaces the agent's default for this model, so a video model can
	// take more than the built-in engine does; 0 keeps the default. The
	// agent answering a request checks them at submission (they travel in
	// the node's etcd record), and the worker again before sending a task.
	MaxSide        int32 `msgpack:"max_side,omitempty"`         // pixels, either side
	MaxFrames      int32 `msgpack:"max_frames,omitempty"`       // video frames
	MaxSteps       int32 `msgpack:"max_steps,omitempty"`        // denoise steps
	MinSide        int32 `msgpack:"min_side,omitempty"`         // pixels, either side
	MaxFramePixels int64 `msgpack:"max_frame_pixels,omitempty"` // width*height
	MaxPixels      int64 `msgpack:"max_pixels,omitempty"`       // width*height*frames (0: max_frame_pixels (or max_side squared) times max_frames)
	SideMultiple   int32 `msgpack:"side_multiple,omitempty"`    // sides must be multiples of it (0: the latent scale)
	FrameStep      int32 `msgpack:"frame_step,omitempty"`       // frames = frame_step*k + frame_offset (Wan: 4, 1); 0: any
	FrameOffset    int32 `msgpack:"frame_offset,omitempty"`
	// Cond is the layout of encode's output (denoise's input), fixed per model.
	Cond Layout `msgpack:"cond"`
	// Latent is denoise's output (decode's input): [frames, channels,
	// height/scale, width/scale], frame-major so each frame is a chunk.
	Latent LatentLayout `msgpack:"latent"`
}

// Bounds on the limits a model may register: far beyond any model today,
// they keep a registration from declaring sizes whose products overflow.
const (
	MaxLimitSide   = 16384
	MaxLimitFrames = 10000
	MaxLimitSteps  = 10000
)

// Limits returns the limits of this model: base (the agent's defaults) with
// every limit the model registered in its place. A model that names its
// sides or frames and no pixel budget gets the one they multiply out to;
// its sides are multiples of its latent scale unless it says more.
func (mo Model) Limits(base engine.Limits) engine.Limits {
	l := base
	set := func(dst *int, v int64) {
		if v > 0 {
			*dst = int(v)
		}
	}
	set(&l.MaxSide, int64(mo.MaxSide))
	set(&l.MaxFrames, int64(mo.MaxFrames))
	set(&l.MaxSteps, int64(mo.MaxSteps))
	set(&l.MinSide, int64(mo.MinSide))
	set(&l.MaxFramePixels, mo.MaxFramePixels)
	l.SideMultiple = max(int(mo.SideMultiple), int(mo.Latent.Scale), base.SideMultiple)
	if mo.FrameStep > 1 {
		l.FrameStep, l.FrameOffset = int(mo.FrameStep), int(mo.FrameOffset)
	}
	switch {
	case mo.MaxPixels > 0:
		l.MaxPixels = int(mo.MaxPixels)
	case mo.MaxSide > 0 || mo.MaxFrames > 0 || mo.MaxFramePixels > 0:
		frame := l.MaxFramePixels
		if frame == 0 {
			frame = l.MaxSide * l.MaxSide
		}
		l.MaxPixels = frame * l.MaxFrames
	}
	return l
}

// Layout is a fixed tensor layout.
type Layout struct {
	DType string  `msgpack:"dtype"`
	Shape []int64 `msgpack:"shape"`
}

// LatentLayout is a latent's layout, whose spatial size follows the request.
type LatentLayout struct {
	DType    string `msgpack:"dtype"`
	Channels int32  `msgpack:"channels"`
	Scale    int32  `msgpack:"scale"` // pixels per latent position along a side
}

// Errors of the wire format.
var (
	ErrBadFrame = errors.New("extengine: bad frame")
	ErrTooLarge = errors.New("extengine: frame too large")
)

// WriteMsg encodes m (stamping the version) as one length-prefixed frame.
func WriteMsg(w io.Writer, m *Msg) error {
	b, err := EncodeMsg(m)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// EncodeMsg returns m as one length-prefixed frame.
func EncodeMsg(m *Msg) ([]byte, error) {
	m.V = ProtocolVersion
	var buf bytes.Buffer
	buf.Write([]byte{0, 0, 0, 0})
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(m); err != nil {
		return nil, fmt.Errorf("extengine: encode %s: %w", m.T, err)
	}
	b := buf.Bytes()
	if len(b)-4 > MaxFrame {
		return nil, fmt.Errorf("%w: %s of %d bytes, at most %d", ErrTooLarge, m.T, len(b)-4, MaxFrame)
	}
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b, nil
}

// ReadMsg reads one frame from r and decodes it. The length is checked
// against MaxFrame before the body is read.
func ReadMsg(r io.Reader) (*Msg, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > MaxFrame {
		return nil, fmt.Errorf("%w: %d bytes declared, at most %d", ErrTooLarge, n, MaxFrame)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, fmt.Errorf("%w: truncated body: %v", ErrBadFrame, err)
	}
	return DecodeMsg(body)
}

// DecodeMsg decodes one frame body (without its length prefix): bounds
// first, then the fixed struct, then the fields' meaning (Validate).
func DecodeMsg(b []byte) (*Msg, error) {
	if len(b) > MaxFrame {
		return nil, fmt.Errorf("%w: %d bytes", ErrTooLarge, len(b))
	}
	if len(b) == 0 || (b[0]&0xf0 != 0x80 && b[0] != 0xde && b[0] != 0xdf) {
		return nil, fmt.Errorf("%w: not a msgpack map", ErrBadFrame)
	}
	if err := (msgpackcheck.Limits{MaxLen: MaxFrame, MaxDepth: maxDepth}).Check(b); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadFrame, err)
	}
	var m Msg
	if err := msgpack.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadFrame, err)
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return &m, nil
}

// Validate checks the fields a frame of its type uses.
func (m *Msg) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	if m.V != ProtocolVersion {
		return fmt.Errorf("%w: protocol version %d, this agent speaks %d", ErrBadFrame, m.V, ProtocolVersion)
	}
	if len(m.Engine) > MaxText || len(m.Reason) > MaxText || len(m.Code) > 64 || len(m.Node) > MaxText {
		return bad("text field longer than %d bytes", MaxText)
	}
	switch m.T {
	case TypeHeartbeat:
	case TypeRegister:
		if len(m.Models) == 0 || len(m.Models) > MaxModels {
			return bad("%d models, want 1-%d", len(m.Models), MaxModels)
		}
		seen := map[string]bool{}
		for i := range m.Models {
			if err := m.Models[i].validate(); err != nil {
				return bad("model %d: %v", i, err)
			}
			if seen[m.Models[i].Name] {
				return bad("model %q registered twice", m.Models[i].Name)
			}
			seen[m.Models[i].Name] = true
		}
		if len(m.Slots) > 3 {
			return bad("slots for %d stages", len(m.Slots))
		}
		for st, n := range m.Slots {
			if !validStage(st) || n < 1 || n > 1024 {
				return bad("slots %q: %d (want a stage and 1-1024)", st, n)
			}
		}
	case TypeWelcome:
		if m.ArenaSize <= 0 || m.HeartbeatMS <= 0 {
			return bad("arena size %d, heartbeat %d ms", m.ArenaSize, m.HeartbeatMS)
		}
	case TypeRefused:
	case TypeTask:
		if m.Task == 0 || !validStage(m.Stage) || m.Spec == nil || m.Output == nil || len(m.Inputs) > 4 {
			return bad("incomplete task")
		}
		for _, r := range append(append([]Region(nil), m.Inputs...), *m.Output) {
			if err := r.validate(); err != nil {
				return bad("%v", err)
			}
		}
	case TypeCancel, TypeDone:
		if m.Task == 0 {
			return bad("no task id")
		}
	case TypeProgress:
		if m.Task == 0 || m.Step < 0 || m.Total < 1 || m.Step > m.Total {
			return bad("step %d of %d (task %d)", m.Step, m.Total, m.Task)
		}
	case TypePreview:
		if m.Task == 0 || len(m.Image) == 0 || len(m.Image) > MaxPreview {
			return bad("%d-byte image, want 1-%d", len(m.Image), MaxPreview)
		}
	case TypeFailed:
		if m.Task == 0 || m.Code == "" {
			return bad("no task id or code")
		}
	default:
		return fmt.Errorf("%w: unknown type %q", ErrBadFrame, m.T)
	}
	return nil
}

func validStage(s string) bool { return s == StageEncode || s == StageDenoise || s == StageDecode }

func validDType(s string) bool {
	switch s {
	case "float32", "float16", "bfloat16", "uint8":
		return true
	}
	return false
}

func (mo *Model) validate() error {
	if err := engine.ValidModel(mo.Name); err != nil {
		return fmt.Errorf("name: %v", err)
	}
	if len(mo.Stages) == 0 || len(mo.Stages) > 3 {
		return fmt.Errorf("%d stages, want 1-3", len(mo.Stages))
	}
	for _, s := range mo.Stages {
		if !validStage(s) {
			return fmt.Errorf("unknown stage %q", s)
		}
	}
	if mo.DefaultSteps < 0 || mo.MaxSide < 0 || mo.MaxFrames < 0 || mo.MaxSteps < 0 || mo.MinSide < 0 ||
		mo.MaxFramePixels < 0 || mo.MaxPixels < 0 || mo.SideMultiple < 0 || mo.FrameStep < 0 || mo.FrameOffset < 0 {
		return errors.New("negative limit")
	}
	if mo.MaxSide > MaxLimitSide || mo.MinSide > MaxLimitSide || mo.MaxFrames > MaxLimitFrames || mo.MaxSteps > MaxLimitSteps ||
		mo.MaxFramePixels > MaxLimitSide*MaxLimitSide || mo.MaxPixels > MaxLimitSide*MaxLimitSide*MaxLimitFrames ||
		mo.SideMultiple > 256 || mo.FrameStep > 64 {
		return errors.New("limit out of range")
	}
	if mo.MaxSide > 0 && mo.MinSide > mo.MaxSide {
		return fmt.Errorf("min_side %d above max_side %d", mo.MinSide, mo.MaxSide)
	}
	if mo.FrameStep > 0 && mo.FrameOffset >= mo.FrameStep {
		return fmt.Errorf("frame_offset %d not below frame_step %d", mo.FrameOffset, mo.FrameStep)
	}
	if !validDType(mo.Cond.DType) || len(mo.Cond.Shape) == 0 || len(mo.Cond.Shape) > MaxDims {
		return fmt.Errorf("cond layout %s %v", mo.Cond.DType, mo.Cond.Shape)
	}
	n := int64(1)
	for _, d := range mo.Cond.Shape {
		if d < 1 || d > 1<<20 || n > math.MaxInt64/d {
			return fmt.Errorf("cond dimension %d", d)
		}
		n *= d
	}
	if n > 1<<30 {
		return fmt.Errorf("cond of %d elements", n)
	}
	l := mo.Latent
	if !validDType(l.DType) || l.Channels < 1 || l.Channels > 1024 || l.Scale < 1 || l.Scale > 64 {
		return fmt.Errorf("latent layout %s, %d channels, scale %d", l.DType, l.Channels, l.Scale)
	}
	return nil
}

// DTypeSize is the bytes per element of a dtype the protocol knows.
func DTypeSize(s string) int64 {
	switch s {
	case "float32":
		return 4
	case "float16", "bfloat16":
		return 2
	case "uint8":
		return 1
	}
	return 0
}

func (r Region) validate() error {
	if r.Off < 0 || r.Len < 1 || r.Len > math.MaxInt64-r.Off {
		return fmt.Errorf("region off %d len %d", r.Off, r.Len)
	}
	if !validDType(r.DType) || len(r.Shape) == 0 || len(r.Shape) > MaxDims {
		return fmt.Errorf("region %s %v", r.DType, r.Shape)
	}
	n := DTypeSize(r.DType)
	for _, d := range r.Shape {
		if d < 1 || n > r.Len/d {
			return fmt.Errorf("region shape %v does not fit %d bytes", r.Shape, r.Len)
		}
		n *= d
	}
	if n != r.Len {
		return fmt.Errorf("region shape %v is %d bytes, len %d", r.Shape, n, r.Len)
	}
	return nil
}
