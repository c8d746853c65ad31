package agent

import (
	"context"
	"errors"
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// StageRunner is what runs a stage's math for the worker: the built-in
// engine in this process, an external engine process on the engine socket,
// or one given by Config.NewRunner (the benches' simulated GPU,
// testbed/simgpu). The worker keeps everything else (claims, credits,
// transfers, commits), whichever runs the math.
type StageRunner interface {
	// Serves reports whether stage st of model can run here now.
	Serves(st jobs.Stage, model string) bool
	// Slots is how many tasks of st may run at once (beside the agent's
	// own credits); 0 while nothing serves st.
	Slots(st jobs.Stage) int
	// Models lists the models served, by stage, for gossip.
	Models() map[string][]jobs.Stage
	// DefaultSteps is model's registered default step count, or 0.
	DefaultSteps(model string) int
	// Changed is closed the next time what the runner serves changes.
	Changed() <-chan struct{}

	CondMeta(s engine.Spec) (transfer.TensorMeta, error)
	LatentMeta(s engine.Spec) (transfer.TensorMeta, error)
	Encode(ctx context.Context, s engine.Spec, dst []byte) error
	Denoise(ctx context.Context, d DenoiseCall) error
	// Checkpoints reports whether s's denoise can checkpoint and resume
	// (DenoiseCall's Resume, CheckpointEvery, Checkpoint and Stop), and the
	// model's default checkpoint period (0: none registered).
	Checkpoints(s engine.Spec) (ok bool, every int)
	NewDecoder(s engine.Spec) (FrameDecoder, error)
}

// DenoiseCall is one denoise stage's work: the sampler over Spec from
// Cond into Dst (LatentMeta(Spec).Bytes() long), with its checkpoints.
type DenoiseCall struct {
	Spec engine.Spec
	Cond engine.Tensor
	Dst  []byte
	// Progress is called after every step, ChunkDone as soon as latent
	// chunk k is final (engine.Engine.DenoiseInto's callbacks); either may
	// be nil.
	Progress  func(step, total int)
	ChunkDone func(k int)
	// Resume, if not nil, continues from this checkpoint of the job's
	// denoise, taken here or on another worker.
	Resume *engine.Checkpoint
	// CheckpointEvery > 0 asks for Checkpoint after every
	// CheckpointEvery-th step but the last.
	CheckpointEvery int
	// Checkpoint receives the checkpoints; it must return at once (the
	// sampler waits) and may keep its argument.
	Checkpoint func(engine.Checkpoint)
	// Stop, when closed, has the sampler finish its step, checkpoint it
	// and return engine.ErrStopped.
	Stop <-chan struct{}
	// KV caches tensors computed from the conditioning alone (the
	// unconditional branch's attention keys and values) across requests;
	// nil caches nothing.
	KV engine.KVCache
}

// FrameDecoder decodes a latent frame range by frame range and assembles the
// file (engine.FrameDecoder is one).
type FrameDecoder interface {
	FrameBytes() int
	DecodeFrames(ctx context.Context, first int, frames []byte) error
	FramePreview(f int) ([]byte, error)
	Finish() ([]byte, string, error)
}

// builtinRunner is the built-in engine: model engine.DefaultModel, every
// stage, always ready.
type builtinRunner struct{ e *engine.Engine }

func (b builtinRunner) Serves(_ jobs.Stage, model string) bool { return model == engine.DefaultModel }
func (b builtinRunner) Slots(jobs.Stage) int                   { return math.MaxInt }
func (b builtinRunner) Changed() <-chan struct{}               { return nil } // never changes
func (b builtinRunner) Models() map[string][]jobs.Stage {
	return map[string][]jobs.Stage{engine.DefaultModel: jobs.Stages()}
}

// DefaultSteps is 0: the built-in model's default is engine.DefaultSpec's.
func (b builtinRunner) DefaultSteps(string) int                           { return 0 }
func (b builtinRunner) CondMeta(engine.Spec) (transfer.TensorMeta, error) { return b.e.CondMeta(), nil }
func (b builtinRunner) LatentMeta(s engine.Spec) (transfer.TensorMeta, error) {
	return b.e.LatentMeta(s), nil
}
func (b builtinRunner) Encode(ctx context.Context, s engine.Spec, dst []byte) error {
	_, err := b.e.EncodeInto(ctx, s, dst)
	return err
}
func (b builtinRunner) Denoise(ctx context.Context, d DenoiseCall) error {
	_, err := b.e.DenoiseWith(ctx, d.Spec, d.Cond, d.Dst, engine.DenoiseOptions{
		Progress: d.Progress, ChunkDone: d.ChunkDone,
		Resume: d.Resume, CheckpointEvery: d.CheckpointEvery, Checkpoint: d.Checkpoint, Stop: d.Stop,
		KV: d.KV,
	})
	return err
}

// EncoderVersion is the engine's id for the model it serves: what it makes
// of a text changes only with it.
func (b builtinRunner) EncoderVersion(model string) string {
	if model != engine.DefaultModel {
		return ""
	}
	return b.e.ID()
}

// BranchMeta and EncodeText make one text's half of the conditioning.
func (b builtinRunner) BranchMeta(engine.Spec) (transfer.TensorMeta, error) {
	return b.e.BranchMeta(), nil
}
func (b builtinRunner) EncodeText(ctx context.Context, _ engine.Spec, text string, dst []byte) error {
	return b.e.EncodeTextInto(ctx, text, dst)
}

// Checkpoints: the built-in sampler checkpoints every model it serves,
// with no default period of its own (the agent's flag decides).
func (b builtinRunner) Checkpoints(engine.Spec) (bool, int)            { return true, 0 }
func (b builtinRunner) NewDecoder(s engine.Spec) (FrameDecoder, error) { return b.e.NewFrameDecoder(s) }

// externalRunner runs stages on the engine registered on the engine socket.
// Tensors go to the engine as arena offsets; one that landed on the heap
// (the arena was full) is copied into an arena buffer first. A denoise
// checkpoints, resumes and stops when the engine's session granted
// checkpoints (protocol v2): its checkpoints travel as engine.Checkpoint,
// so the agent stores, resumes, drains, preempts and forks them as the
// built-in engine's.
type externalRunner struct {
	srv    engineServer
	xfer   engineArena
	limits engine.Limits
	log    *zap.Logger
	// images reads a job's reference image for a model that takes one
	// (nil: no image can be delivered; such tasks fail).
	images jobImages
}

// engineServer is the engine socket as externalRunner uses it
// (extengine.Server).
type engineServer interface {
	Engine() *extengine.Registration
	Changed() <-chan struct{}
	Run(ctx context.Context, r extengine.Request) error
}

// engineArena is the agent's arena as externalRunner uses it
// (transfer.Service).
type engineArena interface {
	ArenaOffset(p []byte) (int64, bool)
	Alloc(n int64) (*transfer.Buffer, error)
}

func (x *externalRunner) Serves(st jobs.Stage, model string) bool {
	return x.srv.Engine().Serves(string(st), model)
}
func (x *externalRunner) Slots(st jobs.Stage) int  { return x.srv.Engine().SlotsFor(string(st)) }
func (x *externalRunner) Changed() <-chan struct{} { return x.srv.Changed() }
func (x *externalRunner) Models() map[string][]jobs.Stage {
	reg := x.srv.Engine()
	if reg == nil {
		return nil
	}
	out := map[string][]jobs.Stage{}
	for _, m := range reg.Models {
		for _, st := range m.Stages {
			out[m.Name] = append(out[m.Name], jobs.Stage(st))
		}
	}
	return out
}

func (x *externalRunner) DefaultSteps(model string) int {
	reg := x.srv.Engine()
	if reg == nil {
		return 0
	}
	for _, m := range reg.Models {
		if m.Name == model {
			return int(m.DefaultSteps)
		}
	}
	return 0
}

// model is the registered model serving st of s, checked against its limits.
func (x *externalRunner) model(st jobs.Stage, s engine.Spec) (extengine.Model, error) {
	m, ok := x.srv.Engine().Model(string(st), s.ModelName())
	if !ok {
		return m, fmt.Errorf("%w: %s of model %q", extengine.ErrNoEngine, st, s.ModelName())
	}
	if err := s.Validate(m.Limits(x.limits)); err != nil {
		return m, fmt.Errorf("%w: model %q: %w", engine.ErrBadSpec, m.Name, err)
	}
	if s.Width%int(m.Latent.Scale) != 0 || s.Height%int(m.Latent.Scale) != 0 {
		return m, fmt.Errorf("%w: model %q needs sides that are multiples of %d", engine.ErrBadSpec, m.Name, m.Latent.Scale)
	}
	return m, nil
}

func (x *externalRunner) CondMeta(s engine.Spec) (transfer.TensorMeta, error) {
	m, err := x.model(jobs.Encode, s)
	if err != nil {
		if m, err = x.model(jobs.Denoise, s); err != nil {
			return transfer.TensorMeta{}, err
		}
	}
	return transfer.TensorMeta{DType: transfer.DType(m.Cond.DType), Shape: append([]int64(nil), m.Cond.Shape...), NumChunks: 1}, nil
}

func (x *externalRunner) LatentMeta(s engine.Spec) (transfer.TensorMeta, error) {
	m, err := x.model(jobs.Denoise, s)
	if err != nil {
		if m, err = x.model(jobs.Decode, s); err != nil {
			return transfer.TensorMeta{}, err
		}
	}
	return latentMeta(m, s), nil
}

// latentMeta is m's latent for s: one chunk per latent frame, which a
// temporal latent has fewer of than the video has frames.
func latentMeta(m extengine.Model, s engine.Spec) transfer.TensorMeta {
	sc := int64(m.Latent.Scale)
	frames := m.LatentFrames(s.Frames)
	return transfer.TensorMeta{
		DType:     transfer.DType(m.Latent.DType),
		Shape:     []int64{int64(frames), int64(m.Latent.Channels), int64(s.Height) / sc, int64(s.Width) / sc},
		NumChunks: max(frames, 1),
	}
}

// inArena returns t's bytes where the engine can see them: t itself, or a
// copy in a fresh arena buffer (release it after the call).
func (x *externalRunner) inArena(b []byte) ([]byte, func(), error) {
	if _, ok := x.xfer.ArenaOffset(b); ok {
		return b, func() {}, nil
	}
	buf, err := x.xfer.Alloc(int64(len(b)))
	if err != nil {
		return nil, nil, fmt.Errorf("%w: arena buffer for the engine: %v", errTransient, err)
	}
	if _, ok := x.xfer.ArenaOffset(buf.Bytes()); !ok {
		buf.Release()
		return nil, nil, fmt.Errorf("%w: the arena has no room for the engine's tensor", errTransient)
	}
	copy(buf.Bytes(), b)
	return buf.Bytes(), buf.Release, nil
}

// run sends one request, classifying the failure as the worker needs it:
// an engine that went away is transient (another agent or a restarted
// engine takes the task); a denoise stopped at a checkpoint is
// engine.ErrStopped and a resume refused engine.ErrBadCheckpoint, as the
// built-in engine says them; a task the engine failed fails the job.
func (x *externalRunner) run(ctx context.Context, r extengine.Request) error {
	err := x.srv.Run(ctx, r)
	switch {
	case err == nil, ctx.Err() != nil:
		return err
	case errors.Is(err, extengine.ErrEngineLost), errors.Is(err, extengine.ErrNoEngine), errors.Is(err, extengine.ErrNotInArena),
		errors.Is(err, extengine.ErrLostState), errors.Is(err, extengine.ErrNoAdapter):
		return fmt.Errorf("%w: %v", errTransient, err)
	case errors.Is(err, extengine.ErrStopped):
		return fmt.Errorf("%w: %w", engine.ErrStopped, err)
	case errors.Is(err, extengine.ErrBadCheckpoint):
		return fmt.Errorf("%w: %w", engine.ErrBadCheckpoint, err)
	}
	return err
}

func (x *externalRunner) Encode(ctx context.Context, s engine.Spec, dst []byte) error {
	meta, err := x.CondMeta(s)
	if err != nil {
		return err
	}
	out, done, err := x.outBuf(dst)
	if err != nil {
		return err
	}
	img, relImg, err := x.refImage(ctx, extengine.StageEncode, s)
	if err != nil {
		done(false)
		return err
	}
	defer relImg()
	if err := x.run(ctx, extengine.Request{Stage: extengine.StageEncode, Model: s.ModelName(), Spec: s, Image: img,
		Output: extengine.Tensor{DType: string(meta.DType), Shape: meta.Shape, Data: out}}); err != nil {
		done(false)
		return err
	}
	done(true)
	return nil
}

// outBuf is dst where the engine can write it; done(ok) copies a heap
// destination's result back.
func (x *externalRunner) outBuf(dst []byte) ([]byte, func(ok bool), error) {
	out, rel, err := x.inArena(dst)
	if err != nil {
		return nil, nil, err
	}
	return out, func(ok bool) {
		if ok && &out[0] != &dst[0] {
			copy(dst, out)
		}
		rel()
	}, nil
}

func (x *externalRunner) Denoise(ctx context.Context, d DenoiseCall) error {
	s, cond := d.Spec, d.Cond
	meta, err := x.LatentMeta(s)
	if err != nil {
		return err
	}
	in, relIn, err := x.inArena(cond.Data)
	if err != nil {
		return err
	}
	defer relIn()
	img, relImg, err := x.refImage(ctx, extengine.StageDenoise, s)
	if err != nil {
		return err
	}
	defer relImg()
	out, done, err := x.outBuf(d.Dst)
	if err != nil {
		return err
	}
	req := extengine.Request{Stage: extengine.StageDenoise, Model: s.ModelName(), Spec: s, Image: img,
		Inputs:   []extengine.Tensor{{DType: string(cond.Meta.DType), Shape: cond.Meta.Shape, Data: in}},
		Output:   extengine.Tensor{DType: string(meta.DType), Shape: meta.Shape, Data: out},
		Progress: d.Progress, CheckpointEvery: d.CheckpointEvery, Stop: d.Stop,
		// Each latent chunk as the engine says it is final (chunk_ready),
		// the rest at done: the early handoff starts on chunk 0.
		ChunkReady: d.ChunkDone}
	if d.KV != nil {
		req.Tensors = d.KV // the same contract: Get's value is not modified, Put owns its value
	}
	if d.Resume != nil {
		ck, err := extengine.FromEngineCheckpoint(*d.Resume)
		if err != nil { // another engine's (the built-in one's) or damaged
			done(false)
			return fmt.Errorf("%w: %w", engine.ErrBadCheckpoint, err)
		}
		req.Resume = &ck
	}
	if d.Checkpoint != nil {
		req.OnCheckpoint = func(ck extengine.Checkpoint) {
			eck, err := ck.EngineCheckpoint() // copies out of the arena buffer the engine reuses
			if err != nil {
				x.log.Warn("engine checkpoint not encodable; not kept", zap.String("model", s.ModelName()), zap.Int("step", ck.Step), zap.Error(err))
				return
			}
			d.Checkpoint(eck)
		}
	}
	err = x.run(ctx, req)
	done(err == nil)
	return err
}

// EncoderVersion is the registered engine's name and version when it
// serves model's encode: the protocol says nothing finer, so any new engine
// build is a new encoder version. The engine encodes both texts as one
// tensor, so its conditioning is cached whole.
func (x *externalRunner) EncoderVersion(model string) string {
	reg := x.srv.Engine()
	if reg == nil || !reg.Serves(extengine.StageEncode, model) {
		return ""
	}
	return reg.Engine
}

// Checkpoints: s's denoise checkpoints when the engine's session granted
// checkpoints and its model declared them; every is the model's
// registered default period (0: the agent's flag decides).
func (x *externalRunner) Checkpoints(s engine.Spec) (bool, int) {
	ck, ok := x.srv.Engine().Checkpoints(s.ModelName())
	if !ok {
		return false, 0
	}
	return true, int(ck.Every)
}

func (x *externalRunner) NewDecoder(s engine.Spec) (FrameDecoder, error) {
	m, err := x.model(jobs.Decode, s)
	if err != nil {
		return nil, err
	}
	sink, err := engine.NewFrameSink(s, m.Limits(x.limits))
	if err != nil {
		return nil, err
	}
	lm := latentMeta(m, s)
	fb := lm.DType.ElemSize() * lm.Shape[1] * lm.Shape[2] * lm.Shape[3]
	return &externalDecoder{x: x, s: s, m: m, sink: sink, frameBytes: int(fb)}, nil
}

// externalDecoder has the engine render frames to RGBA pixels in the arena
// and assembles the file in Go (engine.NewFrameSink): PNG and GIF encoding
// are the agent's, so equal pixels give byte-identical files whichever
// engine decoded them.
type externalDecoder struct {
	x          *externalRunner
	s          engine.Spec
	m          extengine.Model
	sink       *engine.FrameDecoder
	frameBytes int
	stream     *extengine.Stream // nil: no job named (NewDecoder)
}

func (d *externalDecoder) FrameBytes() int                    { return d.frameBytes }
func (d *externalDecoder) FramePreview(f int) ([]byte, error) { return d.sink.FramePreview(f) }
func (d *externalDecoder) Finish() ([]byte, string, error)    { return d.sink.Finish() }

func (d *externalDecoder) DecodeFrames(ctx context.Context, first int, frames []byte) error {
	if len(frames) == 0 || len(frames)%d.frameBytes != 0 {
		return fmt.Errorf("%w: %d bytes is not whole %d-byte frames", engine.ErrBadTensor, len(frames), d.frameBytes)
	}
	k := len(frames) / d.frameBytes
	lm := latentMeta(d.m, d.s)
	if first < 0 || first+k > int(lm.Shape[0]) {
		return fmt.Errorf("%w: latent frames [%d,%d) outside [0,%d)", engine.ErrBadTensor, first, first+k, lm.Shape[0])
	}
	// A temporal latent's frames decode to more video frames (VideoFrames).
	vfirst, n := d.VideoFrames(first, k)
	in, relIn, err := d.x.inArena(frames)
	if err != nil {
		return err
	}
	defer relIn()
	pix := 4 * d.s.Width * d.s.Height
	buf, err := d.x.xfer.Alloc(int64(n * pix))
	if err != nil {
		return fmt.Errorf("%w: arena buffer for decoded pixels: %v", errTransient, err)
	}
	defer buf.Release()
	out, done, err := d.x.outBuf(buf.Bytes())
	if err != nil {
		return err
	}
	err = d.x.run(ctx, extengine.Request{Stage: extengine.StageDecode, Model: d.s.ModelName(), Spec: d.s,
		Inputs:     []extengine.Tensor{{DType: string(lm.DType), Shape: []int64{int64(k), lm.Shape[1], lm.Shape[2], lm.Shape[3]}, Data: in}},
		Output:     extengine.Tensor{DType: "uint8", Shape: []int64{int64(n), int64(d.s.Height), int64(d.s.Width), 4}, Data: out},
		FirstFrame: first, Frames: k,
		// The chunks of one decode stage are one stream (decodestream.go).
		Stream: d.stream, LastChunk: first+k == int(lm.Shape[0])})
	done(err == nil)
	if err != nil {
		return err
	}
	rgba := buf.Bytes()
	for i := range n {
		if err := d.sink.PutRGBA(vfirst+i, rgba[i*pix:(i+1)*pix]); err != nil {
			return err
		}
	}
	return nil
}

// VideoFrames is the range of video frames latent frames [first,
// first+k) decode to (the worker previews those).
func (d *externalDecoder) VideoFrames(first, k int) (vfirst, n int) {
	return d.m.VideoFrames(first, k)
}

// Engine is the external engine registered on this agent's engine socket,
// or nil (none yet, or the agent runs the built-in engine).
func (a *Agent) Engine() *extengine.Registration {
	if a.ext == nil {
		return nil
	}
	return a.ext.Engine()
}

// EngineCalls is how many calls of stage st this agent has made to its
// external engine (a batch is one call; 0 with the built-in engine).
func (a *Agent) EngineCalls(st jobs.Stage) int64 {
	if a.ext == nil {
		return 0
	}
	return a.ext.Calls(string(st))
}

// checkBatchSlots warns when the engine batches a stage in calls larger
// than this agent's --slots lets run at once: the batches never fill.
func (a *Agent) checkBatchSlots() {
	reg := a.Engine()
	if reg == nil {
		return
	}
	for st, c := range a.credits {
		if n := reg.StageBatch(string(st)); n > c.Total() {
			a.log.Warn("the engine batches this stage, but --slots lets fewer of its tasks run at once: raise --slots to fill its batches",
				zap.String("stage", string(st)), zap.Int("batch", n), zap.Int("slots", c.Total()))
		}
	}
}

// EngineChanged returns a channel closed the next time an external engine
// registers or goes away (nil for the built-in engine, which never does).
func (a *Agent) EngineChanged() <-chan struct{} { return a.runner.Changed() }

// EngineSocket is the engine socket's path ("" without one).
func (a *Agent) EngineSocket() string {
	if a.ext == nil {
		return ""
	}
	return a.ext.Addr()
}

// ModelServed reports whether, as this agent's gossip tells, live members
// serve every stage of model (what a submission of it needs).
func (a *Agent) ModelServed(model string) bool { return a.modelServed(model) }
