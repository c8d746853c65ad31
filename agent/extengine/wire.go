package extengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/gossip/msgpackcheck"
)

// Versions of the worker protocol. Every frame carries one in `v`: register
// and welcome (and refused) always Version1, so that either side of any
// version reads them; every later frame of a connection the version its
// welcome chose. A frame of another version ends the connection.
const (
	Version1 = 1
	// Version2 adds step checkpoints (FeatureCheckpoint) and the tensor
	// cache (FeatureTensorCache), each granted in the welcome.
	Version2 = 2
	// ProtocolVersion is the newest version this package speaks.
	ProtocolVersion = Version2
)

// Features of Version2 an engine asks for in register (Msg.Features) and
// the agent grants, a subset, in welcome. A later version adds features to
// this list; names the agent does not know are not granted, never an error.
const (
	FeatureCheckpoint  = "checkpoint"   // checkpoint_every, resume, stop, checkpoint
	FeatureTensorCache = "tensor_cache" // tensor_get, tensor, tensor_put
)

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
	// maxDepth bounds msgpack nesting: frame > models > model > layout >
	// shape, and frame > models > model > conds > tensor > shape.
	maxDepth = 6

	// MaxVersions and MaxFeatures bound register's lists; a feature's
	// name is at most maxFeatureLen bytes.
	MaxVersions   = 8
	MaxFeatures   = 16
	maxFeatureLen = 32
	// MaxSampler bounds a checkpoint format's name.
	MaxSampler = 128
	// MaxState bounds a checkpoint's sampler state, which travels inline
	// (checkpoint, and a task's resume): it must fit a frame with room to
	// spare; what is as large as the latent goes through the arena.
	MaxState = 768 << 10
	// MaxCheckpointLatent bounds a checkpoint's latent: with the state and
	// Checkpoint.MarshalBinary's header it stays within what the agent's
	// checkpoint store takes (256 MiB).
	MaxCheckpointLatent = 255 << 20
	// MaxKey bounds a tensor cache key.
	MaxKey = 128
	// MaxTensor bounds a cached tensor (and a tensor_get's len), and
	// MaxInlineTensor one put inline in a tensor_put.
	MaxTensor       = 64 << 20
	MaxInlineTensor = 768 << 10
	// MaxTaskTensors bounds the arena regions one task is lent for
	// cached tensors (found or to be put); past it, a tensor_get is
	// answered not found with nothing lent.
	MaxTaskTensors = 16
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

	// Version2, FeatureCheckpoint.
	TypeStop         = "stop"         // agent -> engine: checkpoint at the next step boundary and end Task (CodeStopped)
	TypeCheckpoint   = "checkpoint"   // engine -> agent: sampler state after Step, latent in the task's checkpoint_buf
	TypeCheckpointed = "checkpointed" // agent -> engine: checkpoint Step is copied; checkpoint_buf is the engine's again
	// Version2, FeatureTensorCache.
	TypeTensorGet = "tensor_get" // engine -> agent: the cached tensor Key, if any (Len: its size, to be lent a region on a miss)
	TypeTensor    = "tensor"     // agent -> engine: tensor_get's answer (Found, Region)
	TypeTensorPut = "tensor_put" // engine -> agent: cache Key's value (Data, or the Region lent for it)
)

// v2Only are the types a Version1 frame may not have.
var v2Only = map[string]bool{
	TypeStop: true, TypeCheckpoint: true, TypeCheckpointed: true,
	TypeTensorGet: true, TypeTensor: true, TypeTensorPut: true,
	// lifecycle.go
	TypeChunkReady: true, TypeStreamEnd: true, TypeAddModel: true, TypeRemoveModel: true,
	TypeAdapterLoaded: true, TypeAdapterUnloaded: true, TypeAck: true,
}

// Failure codes an engine reports in Msg.Code.
const (
	CodeCancelled = "cancelled" // stopped after a Cancel
	CodeBadInput  = "bad_input" // the task's inputs or spec were unusable
	CodeInternal  = "engine_error"
	// CodeStopped: ended after a Stop, its last step checkpointed (v2).
	CodeStopped = "stopped"
	// CodeBadCheckpoint: the task's resume cannot be continued from (a
	// state of another format, schedule or spec); the agent then starts
	// the denoise over from noise (v2).
	CodeBadCheckpoint = "bad_checkpoint"
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
	// Versions the engine speaks (none: Version1 only), a msgpack array
	// of ints (int32, not uint8: msgpack/v5 would write []uint8 as bin);
	// Features, of Version2 on, it asks for. Welcome's Features are the
	// granted ones.
	Versions []int32  `msgpack:"versions,omitempty"`
	Features []string `msgpack:"features,omitempty"`

	// welcome
	ArenaSize   int64  `msgpack:"arena_size,omitempty"`
	HeartbeatMS int64  `msgpack:"heartbeat_ms,omitempty"`
	Node        string `msgpack:"node,omitempty"`
	Version     uint8  `msgpack:"version,omitempty"` // the version chosen (omitted: Version1)

	// task
	Stage      string       `msgpack:"stage,omitempty"`
	Model      string       `msgpack:"model,omitempty"`
	Spec       *engine.Spec `msgpack:"spec,omitempty"`
	Inputs     []Region     `msgpack:"inputs,omitempty"`
	Output     *Region      `msgpack:"output,omitempty"`
	FirstFrame int32        `msgpack:"first_frame,omitempty"` // decode: latent frame of the input's first
	Frames     int32        `msgpack:"frames,omitempty"`      // decode: frames in the input
	// task, v2 (FeatureCheckpoint): checkpoint after every
	// CheckpointEvery-th step; the checkpoints' latent goes to
	// CheckpointBuf; Resume continues from a checkpoint.
	CheckpointEvery int32   `msgpack:"checkpoint_every,omitempty"`
	CheckpointBuf   *Region `msgpack:"checkpoint_buf,omitempty"`
	Resume          *Resume `msgpack:"resume,omitempty"`
	// task, v2 (shapes.go): the named tensors of a named-conditioning
	// model (encode's outputs, denoise's inputs), the complete model
	// parameters, the reference image, and the video frames a decode of a
	// temporal latent writes.
	Conds       []NamedRegion `msgpack:"conds,omitempty"`
	Params      engine.Params `msgpack:"params,omitempty"`
	RefImage    *Region       `msgpack:"ref_image,omitempty"`
	VideoFirst  int32         `msgpack:"video_first,omitempty"`
	VideoFrames int32         `msgpack:"video_frames,omitempty"`
	// done, v2 (FeatureNamedCond): the length an encode wrote of each
	// named tensor of variable length.
	Lens map[string]int32 `msgpack:"lens,omitempty"`
	// v2 (lifecycle.go): a decode task's place in its stream (Stream, Job,
	// Chunk, Last; stream_end's Stream), a denoise's chunk_ready (Chunk),
	// and the adapter a denoise runs with or a lifecycle frame names.
	Stream  uint64 `msgpack:"stream,omitempty"`
	Job     string `msgpack:"job,omitempty"`
	Chunk   int32  `msgpack:"chunk,omitempty"`
	Last    bool   `msgpack:"last,omitempty"`
	Adapter string `msgpack:"adapter,omitempty"`
	// task, v2 (batch.go): the batch the task goes in, and how many tasks
	// it has (the engine runs them in one call once all have come).
	Batch     uint64 `msgpack:"batch,omitempty"`
	BatchSize int32  `msgpack:"batch_size,omitempty"`

	// progress, preview
	Step  int32  `msgpack:"step,omitempty"`
	Total int32  `msgpack:"total,omitempty"`
	Image []byte `msgpack:"image,omitempty"` // preview: PNG
	// checkpoint: the sampler state after Step of Total (v2).
	State []byte `msgpack:"state,omitempty"`

	// tensor_get, tensor, tensor_put (v2, FeatureTensorCache).
	Key    string  `msgpack:"key,omitempty"`
	Len    int64   `msgpack:"len,omitempty"`    // tensor_get: the value's size, lent on a miss (0: none)
	Found  bool    `msgpack:"found,omitempty"`  // tensor: Region holds the cached value
	Region *Region `msgpack:"region,omitempty"` // tensor: the value, or where to write it for tensor_put
	Data   []byte  `msgpack:"data,omitempty"`   // tensor_put: the value inline (else it is in the lent region)

	// failed, refused
	Code   string `msgpack:"code,omitempty"`
	Reason string `msgpack:"reason,omitempty"`
}

// Resume is where a task continues from (v2): the sampler state after
// Step of Total, and its latent in the arena.
type Resume struct {
	Sampler string `msgpack:"sampler"`
	Step    int32  `msgpack:"step"`
	Total   int32  `msgpack:"total"`
	State   []byte `msgpack:"state"`
	Latent  Region `msgpack:"latent"`
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
	// Checkpoint, if set, says the model's denoise checkpoints and
	// resumes (v2, FeatureCheckpoint); the agent drops it unless granted.
	Checkpoint *CheckpointSpec `msgpack:"checkpoint,omitempty"`
	// TensorCache says the model's denoise uses the tensor cache (v2,
	// FeatureTensorCache); the agent drops it unless granted.
	TensorCache bool `msgpack:"tensor_cache,omitempty"`
	// Conds, Image and Params are the model's named conditioning tensors,
	// reference image and parameter schema (v2, shapes.go); the agent
	// drops each unless its feature is granted.
	Conds  []CondTensor       `msgpack:"conds,omitempty"`
	Image  *ImageDecl         `msgpack:"image,omitempty"`
	Params []engine.ParamSpec `msgpack:"params,omitempty"`
	// Batch is, per stage, the most tasks of it one engine call takes
	// (v2, batch.go); the agent drops it unless batching is granted.
	Batch map[string]int32 `msgpack:"batch,omitempty"`
}

// CheckpointSpec is what a model's checkpoints are.
type CheckpointSpec struct {
	// Sampler names the state's format and schedule; a checkpoint resumes
	// only on a model registering the same name.
	Sampler string `msgpack:"sampler"`
	// DType and Channels lay out the checkpoint's latent: [frames,
	// channels, height/scale, width/scale] (the scale the latent's), so a
	// sampler keeping more than one latent (a multistep solver) stacks
	// them as channels.
	DType    string `msgpack:"dtype"`
	Channels int32  `msgpack:"channels"`
	// Every is the model's default checkpoint period in steps (0: none).
	Every int32 `msgpack:"every,omitempty"`
}

// CheckpointLatent is the layout of mo's checkpoint latent for s (mo must
// have a Checkpoint), and its size in bytes.
func (mo Model) CheckpointLatent(s engine.Spec) (Layout, int64) {
	sc := int64(mo.Latent.Scale)
	l := Layout{DType: mo.Checkpoint.DType, Shape: []int64{int64(mo.LatentFrames(s.Frames)), int64(mo.Checkpoint.Channels), int64(s.Height) / sc, int64(s.Width) / sc}}
	n := DTypeSize(l.DType)
	for _, d := range l.Shape {
		n *= d
	}
	return l, n
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
	// Temporal is the latent's temporal compression (v2,
	// FeatureTemporal): 0 or 1 none, else video frames Temporal*k+1 make
	// k+1 latent frames (Model.LatentFrames).
	Temporal int32 `msgpack:"temporal,omitempty"`
}

// Errors of the wire format.
var (
	ErrBadFrame = errors.New("extengine: bad frame")
	ErrTooLarge = errors.New("extengine: frame too large")
)

// WriteMsg encodes m as one length-prefixed frame (EncodeMsg).
func WriteMsg(w io.Writer, m *Msg) error {
	b, err := EncodeMsg(m)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// EncodeMsg returns m as one length-prefixed frame, stamped Version1 when
// m.V is 0 (a connection stamps the version its welcome chose).
func EncodeMsg(m *Msg) ([]byte, error) {
	if m.V == 0 {
		m.V = Version1
	}
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

// Validate checks the fields a frame of its type uses: the version is one
// this package speaks and has the type, and every field is within bounds.
// Whether the version is the connection's is the connection's check.
func (m *Msg) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	if m.V < Version1 || m.V > ProtocolVersion {
		return fmt.Errorf("%w: protocol version %d, this agent speaks %d-%d", ErrBadFrame, m.V, Version1, ProtocolVersion)
	}
	if v2Only[m.T] && m.V < Version2 {
		return bad("a version %d frame (%s is version %d)", m.V, m.T, Version2)
	}
	if len(m.Engine) > MaxText || len(m.Reason) > MaxText || len(m.Code) > 64 || len(m.Node) > MaxText {
		return bad("text field longer than %d bytes", MaxText)
	}
	if len(m.State) > MaxState {
		return bad("state of %d bytes, at most %d", len(m.State), MaxState)
	}
	if m.V < Version2 && (m.CheckpointEvery != 0 || m.CheckpointBuf != nil || m.Resume != nil) {
		return bad("version %d fields in a version %d frame", Version2, m.V)
	}
	if err := m.validateShapeFields(); err != nil {
		return err
	}
	if err := m.validateLifecycleFields(); err != nil {
		return err
	}
	if err := m.validateBatchFields(); err != nil {
		return err
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
		if len(m.Versions) > MaxVersions {
			return bad("%d versions, at most %d", len(m.Versions), MaxVersions)
		}
		if err := validFeatures(m.Features); err != nil {
			return bad("%v", err)
		}
	case TypeWelcome:
		if m.ArenaSize <= 0 || m.HeartbeatMS <= 0 {
			return bad("arena size %d, heartbeat %d ms", m.ArenaSize, m.HeartbeatMS)
		}
		if m.Version > ProtocolVersion {
			return bad("version %d chosen, this package speaks %d-%d", m.Version, Version1, ProtocolVersion)
		}
		if err := validFeatures(m.Features); err != nil {
			return bad("%v", err)
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
		if m.CheckpointEvery < 0 || m.CheckpointEvery > MaxLimitSteps {
			return bad("checkpoint_every %d, want 0-%d", m.CheckpointEvery, MaxLimitSteps)
		}
		if m.CheckpointBuf != nil {
			if err := m.CheckpointBuf.validate(); err != nil {
				return bad("checkpoint_buf: %v", err)
			}
		}
		if r := m.Resume; r != nil {
			if err := validSampler(r.Sampler); err != nil {
				return bad("resume: %v", err)
			}
			if err := validSteps(r.Step, r.Total, r.State); err != nil {
				return bad("resume: %v", err)
			}
			if err := r.Latent.validate(); err != nil {
				return bad("resume latent: %v", err)
			}
		}
	case TypeCancel, TypeDone, TypeStop:
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
	case TypeCheckpoint:
		if m.Task == 0 {
			return bad("no task id")
		}
		if err := validSteps(m.Step, m.Total, m.State); err != nil {
			return bad("%v", err)
		}
	case TypeCheckpointed:
		if m.Task == 0 || m.Step < 1 {
			return bad("task %d, step %d", m.Task, m.Step)
		}
	case TypeTensorGet, TypeTensor, TypeTensorPut:
		if m.Task == 0 {
			return bad("no task id")
		}
		if err := ValidKey(m.Key); err != nil {
			return bad("%v", err)
		}
		switch {
		case m.Len < 0 || m.Len > MaxTensor:
			return bad("len %d, want 0-%d", m.Len, MaxTensor)
		case len(m.Data) > MaxInlineTensor:
			return bad("%d bytes inline, at most %d", len(m.Data), MaxInlineTensor)
		case m.T == TypeTensor && m.Found && m.Region == nil:
			return bad("found, but no region")
		}
		if m.Region != nil {
			if err := m.Region.validate(); err != nil {
				return bad("%v", err)
			}
			if m.Region.Len > MaxTensor {
				return bad("region of %d bytes, at most %d", m.Region.Len, MaxTensor)
			}
		}
	case TypeChunkReady, TypeStreamEnd, TypeAddModel, TypeRemoveModel, TypeAdapterLoaded, TypeAdapterUnloaded, TypeAck:
		return m.validateLifecycle()
	default:
		return fmt.Errorf("%w: unknown type %q", ErrBadFrame, m.T)
	}
	return nil
}

// validFeatures bounds a feature list: names of lower-case letters, digits
// and '_', unknown ones included (a newer engine asks for more).
func validFeatures(fs []string) error {
	if len(fs) > MaxFeatures {
		return fmt.Errorf("%d features, at most %d", len(fs), MaxFeatures)
	}
	for _, f := range fs {
		if f == "" || len(f) > maxFeatureLen {
			return fmt.Errorf("feature name of %d bytes, want 1-%d", len(f), maxFeatureLen)
		}
		for _, c := range []byte(f) {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
				return fmt.Errorf("feature %q: want [a-z0-9_]", f)
			}
		}
	}
	return nil
}

// ValidKey reports whether key can name a cached tensor: 1 to MaxKey bytes
// of [A-Za-z0-9._:/=+-].
func ValidKey(key string) error {
	if key == "" || len(key) > MaxKey {
		return fmt.Errorf("key of %d bytes, want 1-%d", len(key), MaxKey)
	}
	for _, c := range []byte(key) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("._:/=+-", c) >= 0) {
			return fmt.Errorf("key %q: want [A-Za-z0-9._:/=+-]", key)
		}
	}
	return nil
}

// validSampler reports whether s can name a checkpoint format: 1 to
// MaxSampler printable ASCII bytes.
func validSampler(s string) error {
	if s == "" || len(s) > MaxSampler {
		return fmt.Errorf("sampler name of %d bytes, want 1-%d", len(s), MaxSampler)
	}
	for _, c := range []byte(s) {
		if c < 0x21 || c > 0x7e {
			return fmt.Errorf("sampler name %q: want printable ASCII", s)
		}
	}
	return nil
}

// validSteps bounds a checkpoint's step and state: it is taken after a
// step that is not the last (after the last the output is written).
func validSteps(step, total int32, state []byte) error {
	if step < 1 || step >= total || total > MaxLimitSteps {
		return fmt.Errorf("step %d of %d, want 1 <= step < total <= %d", step, total, MaxLimitSteps)
	}
	if len(state) > MaxState {
		return fmt.Errorf("state of %d bytes, at most %d", len(state), MaxState)
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
	if ck := mo.Checkpoint; ck != nil {
		if !slices.Contains(mo.Stages, StageDenoise) {
			return errors.New("checkpoint declared, but the model's denoise is not served")
		}
		if err := validSampler(ck.Sampler); err != nil {
			return fmt.Errorf("checkpoint: %v", err)
		}
		if !validDType(ck.DType) || ck.Channels < 1 || ck.Channels > 4096 || ck.Every < 0 || ck.Every > MaxLimitSteps {
			return fmt.Errorf("checkpoint latent %s, %d channels, every %d", ck.DType, ck.Channels, ck.Every)
		}
	}
	if err := mo.validateBatch(); err != nil {
		return err
	}
	return mo.validateShapes()
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
