package agent

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/transfer"
)

// fakeEngineServer stands in for the engine socket (extengine.Server, whose
// own tests drive real engines): it records each request and answers with
// run.
type fakeEngineServer struct {
	reg  *extengine.Registration
	run  func(r extengine.Request) error
	runs int
}

func (f *fakeEngineServer) Engine() *extengine.Registration { return f.reg }
func (f *fakeEngineServer) Changed() <-chan struct{}        { return nil }
func (f *fakeEngineServer) Run(_ context.Context, r extengine.Request) error {
	f.runs++
	err := f.run(r)
	if err == nil && r.ChunkReady != nil && len(r.Output.Shape) > 0 {
		for k := range r.Output.Shape[0] { // as the Server does at done
			r.ChunkReady(int(k))
		}
	}
	return err
}

// inPlaceArena counts every buffer as in the arena: the fake server reads
// and writes them where they are.
type inPlaceArena struct{}

func (inPlaceArena) ArenaOffset([]byte) (int64, bool) { return 0, true }
func (inPlaceArena) Alloc(int64) (*transfer.Buffer, error) {
	return nil, errors.New("the test arena lends nothing")
}

// v2Registration is an engine whose model m checkpoints (sampler s/1,
// every 5 steps by default) when granted is true.
func v2Registration(granted bool) *extengine.Registration {
	m := extengine.Model{Name: "m", Stages: []string{extengine.StageDenoise},
		Cond:   extengine.Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent: extengine.LatentLayout{DType: "float32", Channels: 4, Scale: 8}}
	reg := &extengine.Registration{Engine: "fake/1", Version: extengine.Version1, Models: []extengine.Model{m}}
	if granted {
		reg.Models[0].Checkpoint = &extengine.CheckpointSpec{Sampler: "s/1", DType: "float32", Channels: 4, Every: 5}
		reg.Version, reg.Features = extengine.Version2, []string{extengine.FeatureCheckpoint}
	}
	return reg
}

func denoiseCallOf(t *testing.T) DenoiseCall {
	t.Helper()
	s := engine.Spec{Model: "m", Prompt: "p", Seed: 1, Width: 64, Height: 64, Frames: 1, Steps: 8, GuidanceScale: 5}
	return DenoiseCall{Spec: s,
		Cond: engine.Tensor{Meta: transfer.TensorMeta{DType: "float32", Shape: []int64{2, 8, 16}, NumChunks: 1}, Data: make([]byte, 1024)},
		Dst:  make([]byte, 1024)}
}

// The external runner checkpoints exactly when the session granted it,
// hands the engine's checkpoints on as engine.Checkpoint (copied out of
// the buffer the engine reuses) and resumes from them, passes the period,
// the stop and the agent's tensor cache, and says stops and refused
// resumes as the built-in engine does, so the worker's checkpoint paths
// (drain, preemption, unusableCheckpoint) work unchanged.
func TestExternalRunnerCheckpoints(t *testing.T) {
	srv := &fakeEngineServer{reg: v2Registration(false)}
	x := &externalRunner{srv: srv, xfer: inPlaceArena{}, limits: engine.DefaultLimits(), log: zaptest.NewLogger(t)}
	spec := denoiseCallOf(t).Spec
	if ok, _ := x.Checkpoints(spec); ok {
		t.Fatal("a session without the checkpoint feature checkpoints")
	}
	srv.reg = v2Registration(true)
	if ok, every := x.Checkpoints(spec); !ok || every != 5 {
		t.Fatalf("Checkpoints = %v, %d; want true and the model's registered period 5", ok, every)
	}
	other := spec
	other.Model = "not-served"
	if ok, _ := x.Checkpoints(other); ok {
		t.Fatal("a model the engine does not serve checkpoints")
	}

	// A denoise checkpointing every 3 steps: the engine's checkpoint comes
	// back as an engine.Checkpoint holding a copy of its latent.
	latent := bytes.Repeat([]byte{7}, 1024)
	kv := engine.NewKVCache(1 << 20)
	stop := make(chan struct{})
	var got []engine.Checkpoint
	call := denoiseCallOf(t)
	call.CheckpointEvery, call.Stop, call.KV = 3, stop, kv
	call.Checkpoint = func(ck engine.Checkpoint) { got = append(got, ck) }
	chunks := 0
	call.ChunkDone = func(int) { chunks++ }
	srv.run = func(r extengine.Request) error {
		if r.CheckpointEvery != 3 || r.Stop != (<-chan struct{})(stop) || r.Tensors != extengine.TensorCache(kv) || r.Resume != nil {
			t.Errorf("request: every %d, stop %v, tensors %v, resume %v", r.CheckpointEvery, r.Stop != nil, r.Tensors, r.Resume)
		}
		buf := bytes.Clone(latent)
		r.OnCheckpoint(extengine.Checkpoint{Sampler: "s/1", Step: 3, Total: 8, State: []byte("three"), Latent: buf})
		clear(buf) // the engine reuses its buffer once the checkpoint is acknowledged
		return nil
	}
	if err := x.Denoise(context.Background(), call); err != nil {
		t.Fatal(err)
	}
	if chunks != 1 {
		t.Errorf("%d chunks done, want 1", chunks)
	}
	if len(got) != 1 || got[0].Sampler != "s/1" || got[0].Step != 3 || got[0].Total != 8 {
		t.Fatalf("checkpoints handed to the agent: %+v", got)
	}
	ck, err := extengine.FromEngineCheckpoint(got[0])
	if err != nil || string(ck.State) != "three" || !bytes.Equal(ck.Latent, latent) {
		t.Fatalf("the stored checkpoint decodes to %+v, %v; want the engine's state and latent as they were", ck, err)
	}

	// Resuming it hands the engine the same state and latent.
	call = denoiseCallOf(t)
	call.Resume = &got[0]
	srv.run = func(r extengine.Request) error {
		if r.Resume == nil || r.Resume.Sampler != "s/1" || r.Resume.Step != 3 || string(r.Resume.State) != "three" || !bytes.Equal(r.Resume.Latent, latent) {
			t.Errorf("resume %+v", r.Resume)
		}
		return nil
	}
	if err := x.Denoise(context.Background(), call); err != nil {
		t.Fatal(err)
	}

	// What the worker must tell apart.
	builtin := engine.Checkpoint{Sampler: "builtin/v4/ddim-cosine", Step: 3, Total: 8, State: []byte("LMSD")}
	runs := srv.runs
	call = denoiseCallOf(t)
	call.Resume = &builtin
	if err := x.Denoise(context.Background(), call); !errors.Is(err, engine.ErrBadCheckpoint) || srv.runs != runs {
		t.Errorf("resume of the built-in engine's checkpoint: %v (sent: %v), want engine.ErrBadCheckpoint before anything is sent", err, srv.runs != runs)
	}
	for _, tc := range []struct {
		name          string
		answer        error
		is            error
		transient     bool
		stillTaskFail bool
	}{
		{"stopped at a checkpoint", extengine.ErrStopped, engine.ErrStopped, false, false},
		{"resume refused by the engine", &extengine.TaskError{Code: extengine.CodeBadCheckpoint, Reason: "not mine"}, engine.ErrBadCheckpoint, false, true},
		{"resume refused by the agent's server", extengine.ErrBadCheckpoint, engine.ErrBadCheckpoint, false, false},
		{"engine lost", extengine.ErrEngineLost, errTransient, true, false},
	} {
		srv.run = func(extengine.Request) error { return tc.answer }
		err := x.Denoise(context.Background(), denoiseCallOf(t))
		var te *extengine.TaskError
		if !errors.Is(err, tc.is) || errors.Is(err, errTransient) != tc.transient || errors.As(err, &te) != tc.stillTaskFail {
			t.Errorf("%s: %v; want it to be %v (transient %v)", tc.name, err, tc.is, tc.transient)
		}
	}
}

// imagesOf serves one reference image from memory.
type imagesOf []byte

func (i imagesOf) jobImage(context.Context, engine.ImageRef) ([]byte, func(), error) {
	return i, func() {}, nil
}

// A temporal latent has a chunk per latent frame (81 frames: 21), a
// decoder maps its latent frames to the video frames they make, and a
// model taking its image at denoise gets it there and nowhere else.
func TestExternalRunnerShapes(t *testing.T) {
	m := i2vModel()
	m.Image.Stages = []string{extengine.StageDenoise}
	reg := &extengine.Registration{Engine: "fake/2", Version: extengine.Version2, Models: []extengine.Model{m},
		Features: []string{extengine.FeatureTemporal, extengine.FeatureImage, extengine.FeatureParams}}
	pix := bytes.Repeat([]byte{9}, 16*8*4)
	srv := &fakeEngineServer{reg: reg}
	x := &externalRunner{srv: srv, xfer: inPlaceArena{}, limits: engine.DefaultLimits(), log: zaptest.NewLogger(t), images: imagesOf(pix)}
	spec := engine.Spec{Model: "i2v", Prompt: "p", Seed: 1, Width: 64, Height: 64, Frames: 81, Steps: 2, GuidanceScale: 5,
		Image: &engine.ImageRef{Object: "j.input.image", Width: 16, Height: 8}}
	meta, err := x.LatentMeta(spec)
	if err != nil || meta.Shape[0] != 21 || meta.Chunks() != 21 {
		t.Fatalf("latent meta %+v (%v): want 21 frames, a chunk each", meta, err)
	}
	fd, err := x.NewDecoder(spec)
	if err != nil {
		t.Fatal(err)
	}
	if fd.FrameBytes() != 4*4*8*8 {
		t.Errorf("a latent frame of %d bytes, want %d", fd.FrameBytes(), 4*4*8*8)
	}
	vf, ok := fd.(videoFrames)
	if !ok {
		t.Fatal("the external decoder does not map latent frames to video frames")
	}
	if first, n := vf.VideoFrames(1, 1); first != 1 || n != 4 {
		t.Errorf("latent frame 1 decodes to video frames %d+%d, want 1+4", first, n)
	}

	var stages []string
	srv.run = func(r extengine.Request) error {
		stages = append(stages, r.Stage)
		if got := r.Image != nil; got != (r.Stage == extengine.StageDenoise) {
			t.Errorf("%s: image sent %v", r.Stage, got)
		}
		if r.Image != nil && (!bytes.Equal(r.Image.Data, pix) || r.Image.Shape[0] != 8 || r.Image.Shape[1] != 16) {
			t.Errorf("%s: image %v of %d bytes", r.Stage, r.Image.Shape, len(r.Image.Data))
		}
		return nil
	}
	call := DenoiseCall{Spec: spec, Cond: engine.Tensor{Meta: transfer.TensorMeta{DType: "float32", Shape: []int64{2, 8}, NumChunks: 1}, Data: make([]byte, 64)},
		Dst: make([]byte, meta.Bytes())}
	if err := x.Denoise(context.Background(), call); err != nil {
		t.Fatal(err)
	}
	if err := x.Encode(context.Background(), spec, make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	if len(stages) != 2 {
		t.Errorf("stages run: %v", stages)
	}
	x.images = nil
	if err := x.Denoise(context.Background(), call); !errors.Is(err, extengine.ErrNoImage) {
		t.Errorf("a denoise with no way to read its image: %v, want ErrNoImage", err)
	}
}
