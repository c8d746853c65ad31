// Package simgpu is a simulated GPU for the benches (`latentmesh-dev bench
// serve`, `bench control`): an agent.StageRunner that spends a model's GPU
// time, from a cost model, on one simulated accelerator per agent and writes
// payloads of the model's real sizes. Agents take it through
// agent.Config.NewRunner; the daemon never links it. Only testbed and its
// benches use it.
package simgpu

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"sort"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// Config stands in for a GPU engine in `latentmesh-dev bench serve`: each
// stage spends a model's GPU time (from a cost model) on this agent's one
// simulated GPU and writes payloads of the model's latent and conditioning
// sizes. The agent is one GPU: every stage it runs, of every model, takes
// turns on that GPU (a FIFO of one), so a colocated agent's encode, denoise
// and decode never run side by side. A denoise takes the GPU step by step,
// as time slicing between kernels of several streams would.
//
// The built-in engine's math is not run: at a real model's latent sizes it
// would cost more CPU than the simulated GPU time it stands beside.
type Config struct {
	// Models are the models served, by name, on every role of the agent.
	Models map[string]Model
	// Observe, when set, is told of each stretch of GPU time, from the
	// task's goroutine: it must be quick and safe for concurrent use.
	Observe func(Span)
	// NoCheckpoints makes the runner one that cannot checkpoint (Checkpoints
	// reports false): the agent neither writes step checkpoints nor stops a
	// preempted denoise at a step, it cancels it, as before checkpoints. A
	// bench's baseline.
	NoCheckpoints bool
}

// Model is one model's cost on one GPU and its tensors' shapes.
type Model struct {
	Encode time.Duration // one encode
	Step   time.Duration // one denoise step (Spec.Steps of them)
	Decode time.Duration // decoding the whole latent
	// Cond is the encoder's output; Latent the denoiser's, frame-major
	// with one chunk per latent frame for videos.
	Cond, Latent transfer.TensorMeta
	// ResultBytes is the size of the finished file.
	ResultBytes int
}

// Span is a stretch of simulated GPU time: Queued when the stage asked
// for the GPU, Start when it got it, End when it gave it back.
type Span struct {
	Node string
	Tag  string // the request's prompt: a benchmark names its jobs by it
	// Seed is the request's: with Tag it names a job when prompts repeat.
	Seed  int64
	Stage jobs.Stage
	// Frame is the first latent frame a decode span covers (-1 otherwise).
	Frame int
	// Step is the denoise step a denoise span ran (1 to Spec.Steps; 0
	// otherwise): a resumed denoise's spans start after its checkpoint's.
	Step               int
	Queued, Start, End time.Time
}

// gpu is one simulated accelerator: a FIFO lock held for the simulated time.
type gpu struct {
	node    string
	turn    chan struct{} // a token; holding it is owning the GPU
	observe func(Span)
}

// run holds the GPU for d on behalf of stage st of s (decode frame or
// denoise step, -1 and 0 where there is none). debt is time
// overslept earlier in the same stage, taken off this sleep so timer
// granularity does not stretch a 50-step denoise; it returns the new debt.
func (g *gpu) run(ctx context.Context, s engine.Spec, st jobs.Stage, frame, step int, d, debt time.Duration) (time.Duration, error) {
	queued := time.Now()
	select {
	case g.turn <- struct{}{}:
	case <-ctx.Done():
		return debt, ctx.Err()
	}
	start := time.Now()
	want := d - debt
	err := engine.Spend(ctx, want)
	end := time.Now()
	<-g.turn
	if g.observe != nil {
		g.observe(Span{Node: g.node, Tag: s.Prompt, Seed: s.Seed, Stage: st, Frame: frame, Step: step, Queued: queued, Start: start, End: end})
	}
	return max(0, end.Sub(start)-want), err
}

// runner is the agent.StageRunner of one agent's simulated GPU.
type runner struct {
	cfg Config
	gpu *gpu
}

// Runner returns the stage runner of node's own simulated GPU, with the
// models checked; as a method value it is an agent.Config.NewRunner, so
// every agent built with it gets a GPU of its own.
func (c Config) Runner(node string) (agent.StageRunner, error) {
	for name, m := range c.Models {
		if err := engine.ValidModel(name); err != nil {
			return nil, fmt.Errorf("simgpu: model %q: %w", name, err)
		}
		if m.Encode < 0 || m.Step < 0 || m.Decode < 0 || m.ResultBytes <= 0 {
			return nil, fmt.Errorf("simgpu: model %q: negative cost or no result size", name)
		}
		if err := m.Cond.Validate(math.MaxInt64); err != nil {
			return nil, fmt.Errorf("simgpu: model %q cond: %w", name, err)
		}
		if err := m.Latent.Validate(math.MaxInt64); err != nil || len(m.Latent.Shape) != 4 || m.Latent.NumChunks != int(m.Latent.Shape[0]) {
			return nil, fmt.Errorf("simgpu: model %q latent %+v: want [frames, c, h, w] with a chunk per frame (%v)", name, m.Latent, err)
		}
	}
	return &runner{cfg: c, gpu: &gpu{node: node, turn: make(chan struct{}, 1), observe: c.Observe}}, nil
}

func (r *runner) model(s engine.Spec) (Model, error) {
	m, ok := r.cfg.Models[s.ModelName()]
	if !ok {
		return m, fmt.Errorf("%w: model %q is not simulated here", engine.ErrBadSpec, s.ModelName())
	}
	return m, nil
}

func (r *runner) Serves(_ jobs.Stage, model string) bool { _, ok := r.cfg.Models[model]; return ok }
func (r *runner) Slots(jobs.Stage) int                   { return math.MaxInt } // the GPU lock serialises
func (r *runner) Changed() <-chan struct{}               { return nil }

// DefaultSteps is 0: bench serve names the steps of every job it submits.
func (r *runner) DefaultSteps(string) int { return 0 }

func (r *runner) Models() map[string][]jobs.Stage {
	out := map[string][]jobs.Stage{}
	names := make([]string, 0, len(r.cfg.Models))
	for n := range r.cfg.Models {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		out[n] = jobs.Stages()
	}
	return out
}

func (r *runner) CondMeta(s engine.Spec) (transfer.TensorMeta, error) {
	m, err := r.model(s)
	return m.Cond, err
}

func (r *runner) LatentMeta(s engine.Spec) (transfer.TensorMeta, error) {
	m, err := r.model(s)
	return m.Latent, err
}

func (r *runner) Encode(ctx context.Context, s engine.Spec, dst []byte) error {
	m, err := r.model(s)
	if err != nil {
		return err
	}
	if _, err := r.gpu.run(ctx, s, jobs.Encode, -1, 0, m.Encode, 0); err != nil {
		return err
	}
	fill(dst, s, 1)
	return nil
}

// EncoderVersion names the simulated encoder of model (its conditioning
// can be cached), and BranchMeta and EncodeText make one text's half of
// it at half an encode's GPU time: the cost model's split of an encode
// between the prompt and the negative prompt.
func (r *runner) EncoderVersion(model string) string {
	m, ok := r.cfg.Models[model]
	if !ok {
		return ""
	}
	return fmt.Sprintf("simgpu/%s/%v", model, m.Encode)
}

func (r *runner) BranchMeta(s engine.Spec) (transfer.TensorMeta, error) {
	m, err := r.model(s)
	if err != nil {
		return transfer.TensorMeta{}, err
	}
	n := m.Cond.Bytes()
	if n%2 != 0 {
		return transfer.TensorMeta{}, fmt.Errorf("%w: simgpu: %s's conditioning of %d bytes has no halves", engine.ErrBadSpec, s.ModelName(), n)
	}
	return transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{n / 2}, NumChunks: 1}, nil
}

func (r *runner) EncodeText(ctx context.Context, s engine.Spec, text string, dst []byte) error {
	m, err := r.model(s)
	if err != nil {
		return err
	}
	if _, err := r.gpu.run(ctx, s, jobs.Encode, -1, 0, m.Encode/2, 0); err != nil {
		return err
	}
	t := s
	t.Prompt = text
	fill(dst, t, 3)
	return nil
}

func (r *runner) Denoise(ctx context.Context, d agent.DenoiseCall) error {
	s := d.Spec
	m, err := r.model(s)
	if err != nil {
		return err
	}
	first := 1
	if d.Resume != nil {
		if d.Resume.Sampler != sampler(s) || d.Resume.Total != s.Steps || d.Resume.Step < 1 || d.Resume.Step >= s.Steps {
			return fmt.Errorf("%w: simgpu: checkpoint %s at %d/%d does not fit %s with %d steps",
				engine.ErrBadTensor, d.Resume.Sampler, d.Resume.Step, d.Resume.Total, sampler(s), s.Steps)
		}
		first = d.Resume.Step + 1
	}
	var debt time.Duration
	for step := first; step <= s.Steps; step++ {
		if debt, err = r.gpu.run(ctx, s, jobs.Denoise, -1, step, m.Step, debt); err != nil {
			return err
		}
		if d.Progress != nil {
			d.Progress(step, s.Steps)
		}
		if step == s.Steps {
			break
		}
		stopped := false
		select {
		case <-d.Stop:
			stopped = true
		default:
		}
		if d.Checkpoint != nil && (stopped || d.CheckpointEvery > 0 && step%d.CheckpointEvery == 0) {
			d.Checkpoint(r.checkpoint(s, m, step))
		}
		if stopped {
			return engine.ErrStopped
		}
	}
	// Every frame of a video latent is final only after the last step.
	fill(d.Dst, s, 2)
	if d.ChunkDone != nil {
		for k := range m.Latent.Chunks() {
			d.ChunkDone(k)
		}
	}
	return nil
}

// Checkpoints: the simulated sampler checkpoints and resumes every model,
// unless the config says it cannot.
func (r *runner) Checkpoints(engine.Spec) (bool, int) { return !r.cfg.NoCheckpoints, 0 }

// sampler names the simulated sampler's state for s's model.
func sampler(s engine.Spec) string { return "simgpu/" + s.ModelName() }

// checkpoint is the simulated sampler's state after step: as large as the
// model's latent (a real checkpoint holds the latent), so writing it moves
// real bytes through the Store.
func (r *runner) checkpoint(s engine.Spec, m Model, step int) engine.Checkpoint {
	state := make([]byte, m.Latent.Bytes())
	fill(state, s, uint64(100+step))
	return engine.Checkpoint{Sampler: sampler(s), Step: step, Total: s.Steps, State: state}
}

func (r *runner) NewDecoder(s engine.Spec) (agent.FrameDecoder, error) {
	m, err := r.model(s)
	if err != nil {
		return nil, err
	}
	frames := int(m.Latent.Shape[0])
	return &decoder{r: r, s: s, m: m, frames: frames, frameBytes: int(m.Latent.Bytes()) / frames}, nil
}

// decoder spends the model's decode time in proportion to the latent
// frames it is given.
type decoder struct {
	r          *runner
	s          engine.Spec
	m          Model
	frames     int
	frameBytes int
	debt       time.Duration
}

func (d *decoder) FrameBytes() int { return d.frameBytes }

func (d *decoder) DecodeFrames(ctx context.Context, first int, frames []byte) error {
	if len(frames) == 0 || len(frames)%d.frameBytes != 0 {
		return fmt.Errorf("%w: %d bytes is not whole %d-byte frames", engine.ErrBadTensor, len(frames), d.frameBytes)
	}
	k := len(frames) / d.frameBytes
	var err error
	d.debt, err = d.r.gpu.run(ctx, d.s, jobs.Decode, first, 0, d.m.Decode*time.Duration(k)/time.Duration(d.frames), d.debt)
	return err
}

// FramePreview is a small stand-in for a frame's PNG.
func (d *decoder) FramePreview(f int) ([]byte, error) {
	b := make([]byte, 1024)
	fill(b, d.s, uint64(100+f))
	return b, nil
}

func (d *decoder) Finish() ([]byte, string, error) {
	b := make([]byte, d.m.ResultBytes)
	fill(b, d.s, 3)
	return b, "application/octet-stream", nil
}

// fill writes bytes that depend only on the request and the stage: the
// payloads are real memory moved between agents, and equal requests give
// equal bytes.
func fill(b []byte, s engine.Spec, salt uint64) {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d/%d", s.Prompt, s.Seed, salt)
	x := h.Sum64() | 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
	for ; i < len(b); i++ {
		b[i] = byte(x >> (8 * (i % 8)))
	}
}
