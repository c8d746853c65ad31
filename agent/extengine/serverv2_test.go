package extengine

import (
	"bytes"
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// v2Register registers model m2 (a denoiser that checkpoints and uses the
// tensor cache) offering versions and asking for features.
func v2Register(versions []int32, features ...string) *Msg {
	return &Msg{T: TypeRegister, Engine: "test-v2/1", Versions: versions, Features: features, Models: []Model{{
		Name: "m2", Stages: []string{StageDenoise}, Cond: Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent:      LatentLayout{DType: "float32", Channels: 4, Scale: 8},
		Checkpoint:  &CheckpointSpec{Sampler: "go-sampler/1", DType: "float32", Channels: 4, Every: 5},
		TensorCache: true,
	}}}
}

// noAllocArena is an Arena that cannot lend memory: the Server grants no
// v2 feature with it.
type noAllocArena struct{ a checkArena }

func (n noAllocArena) ArenaFd() (int, int64, bool)        { return n.a.ArenaFd() }
func (n noAllocArena) ArenaOffset(p []byte) (int64, bool) { return n.a.ArenaOffset(p) }
func (n noAllocArena) Retain(p []byte) (func(), bool)     { return n.a.Retain(p) }

// denoiseRequest is a 64x64 denoise of m2: cond and latent of 1 KiB each.
func denoiseRequest(t *testing.T, ar *arena.Arena, steps int) Request {
	t.Helper()
	in, err := ar.Alloc(2 * 8 * 16 * 4)
	if err != nil {
		t.Fatal(err)
	}
	out, err := ar.Alloc(4 * 8 * 8 * 4)
	if err != nil {
		t.Fatal(err)
	}
	return Request{Stage: StageDenoise, Model: "m2", Spec: engine.Spec{Model: "m2", Prompt: "p", Width: 64, Height: 64, Frames: 1, Steps: steps},
		Inputs: []Tensor{{DType: "float32", Shape: []int64{2, 8, 16}, Data: ar.Slice(in)}},
		Output: Tensor{DType: "float32", Shape: []int64{1, 4, 8, 8}, Data: ar.Slice(out)}}
}

// Negotiation: the highest version both speak, and of the features asked
// for those this agent grants (none without an allocator, none to a v1
// engine); what a model declares of a feature not granted is dropped.
func TestNegotiation(t *testing.T) {
	lending := func(ar *arena.Arena) Arena { return checkArena{ar} }
	both := []string{FeatureCheckpoint, FeatureTensorCache}
	for _, tc := range []struct {
		name         string
		wrap         func(*arena.Arena) Arena
		versions     []int32
		features     []string
		wantVersion  int
		wantFeatures []string
	}{
		{"v1 engine", lending, nil, nil, Version1, nil},
		{"v1 engine asking for features", lending, []int32{Version1}, both, Version1, nil},
		{"v2 engine, an unknown feature too", lending, []int32{Version1, Version2}, append(slices.Clone(both), "not_a_feature"), Version2, both},
		{"v2 engine, the tensor cache only", lending, []int32{Version2}, []string{FeatureTensorCache}, Version2, []string{FeatureTensorCache}},
		{"a newer engine", lending, []int32{Version1, Version2, 3}, both, Version2, both},
		{"an agent that cannot lend memory", func(ar *arena.Arena) Arena { return noAllocArena{checkArena{ar}} }, []int32{Version1, Version2}, both, Version2, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := testServerOn(t, tc.wrap)
			e := dialEngineWith(t, s, v2Register(tc.versions, tc.features...))
			reg := s.Engine()
			if reg == nil {
				t.Fatal("no engine registered")
			}
			wantWire := uint8(tc.wantVersion)
			if tc.wantVersion == Version1 {
				wantWire = 0 // omitted: a v1 engine reads the welcome it always did
			}
			if e.welcome.Version != wantWire || !slices.Equal(e.welcome.Features, tc.wantFeatures) {
				t.Errorf("welcome chose version %d, features %v; want %d, %v", e.welcome.Version, e.welcome.Features, wantWire, tc.wantFeatures)
			}
			if reg.Version != tc.wantVersion || !slices.Equal(reg.Features, tc.wantFeatures) {
				t.Errorf("registration: version %d, features %v; want %d, %v", reg.Version, reg.Features, tc.wantVersion, tc.wantFeatures)
			}
			_, ck := reg.Checkpoints("m2")
			m, _ := reg.Model(StageDenoise, "m2")
			if ck != slices.Contains(tc.wantFeatures, FeatureCheckpoint) || m.TensorCache != slices.Contains(tc.wantFeatures, FeatureTensorCache) {
				t.Errorf("model m2 checkpoints %v, uses the tensor cache %v; want what was granted, %v", ck, m.TensorCache, tc.wantFeatures)
			}
			// The session's frames carry its version: the agent's heartbeat,
			// and the engine's, which the agent accepts.
			e.send(t, &Msg{T: TypeHeartbeat})
			hb, err := ReadMsg(e.c)
			if err != nil || hb.V != uint8(tc.wantVersion) {
				t.Fatalf("agent's frame after the welcome: %+v, %v; want version %d", hb, err, tc.wantVersion)
			}
			if s.Engine() == nil {
				t.Error("a heartbeat of the session's version dropped the engine")
			}
		})
	}
}

// A register frame the agent cannot negotiate is refused with a reason
// naming both sides' versions.
func TestNegotiationRefusals(t *testing.T) {
	for _, tc := range []struct {
		name string
		reg  *Msg
		want string
	}{
		{"only a newer version", v2Register([]int32{3, 4}, FeatureCheckpoint), "the engine speaks protocol versions [3 4], this agent 1-2"},
		{"a register of version 2", func() *Msg { m := v2Register([]int32{Version2}); m.V = Version2; return m }(), `first frame is "register" of version 2, want "register" of version 1`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := testServer(t)
			c := dialRaw(t, s)
			if err := WriteMsg(c, tc.reg); err != nil {
				t.Fatal(err)
			}
			m, err := ReadMsg(c)
			if err != nil || m.T != TypeRefused || !strings.Contains(m.Reason, tc.want) {
				t.Fatalf("answer %+v, %v; want refused, %q", m, err, tc.want)
			}
			if s.Engine() != nil {
				t.Error("a refused engine is registered")
			}
		})
	}
}

// Frames that break v2's rules end the connection, failing the task the
// engine was running with ErrEngineLost.
func TestV2ProtocolErrorsCloseConnection(t *testing.T) {
	v2 := v2Register([]int32{Version1, Version2}, FeatureCheckpoint, FeatureTensorCache)
	noCache := v2Register([]int32{Version1, Version2}, FeatureCheckpoint, FeatureTensorCache)
	noCache.Models[0].TensorCache = false
	v1 := v2Register(nil)
	for _, tc := range []struct {
		name  string
		reg   *Msg
		every int
		bad   func(task *Msg) *Msg
		want  string
	}{
		{"a v2 frame in a v1 session", v1, 0, func(task *Msg) *Msg {
			return &Msg{V: Version1, T: TypeCheckpoint, Task: task.Task, Step: 1, Total: 4}
		}, "checkpoint: a version 1 frame (checkpoint is version 2)"},
		{"a v1 frame in a v2 session", v2, 0, func(*Msg) *Msg { return &Msg{V: Version1, T: TypeHeartbeat} },
			"a version 1 heartbeat in a version 2 session"},
		{"a checkpoint without a buffer", v2, 0, func(task *Msg) *Msg {
			return &Msg{T: TypeCheckpoint, Task: task.Task, Step: 1, Total: 4}
		}, "which has no checkpoint buffer"},
		{"a checkpoint of another step count", v2, 2, func(task *Msg) *Msg {
			return &Msg{T: TypeCheckpoint, Task: task.Task, Step: 2, Total: 5}
		}, "after step 2 of 5; the task has 4 steps"},
		{"a checkpoint after the last step", v2, 2, func(task *Msg) *Msg {
			return &Msg{T: TypeCheckpoint, Task: task.Task, Step: 4, Total: 4}
		}, "checkpoint: step 4 of 4, want 1 <= step < total"},
		{"a tensor_put with nothing lent for it", v2, 0, func(task *Msg) *Msg {
			return &Msg{T: TypeTensorPut, Task: task.Task, Key: "neg/a"}
		}, "with no data and no region lent for it"},
		{"a tensor_get of a model without tensor_cache", noCache, 0, func(task *Msg) *Msg {
			return &Msg{T: TypeTensorGet, Task: task.Task, Key: "neg/a", Len: 64}
		}, "whose model does not declare tensor_cache"},
		{"a key the protocol does not allow", v2, 0, func(task *Msg) *Msg {
			return &Msg{T: TypeTensorGet, Task: task.Task, Key: "neg a", Len: 64}
		}, `key "neg a": want [A-Za-z0-9._:/=+-]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, ar := testServer(t)
			e := dialEngineWith(t, s, tc.reg)
			r := denoiseRequest(t, ar, 4)
			r.CheckpointEvery = tc.every
			done := make(chan error, 1)
			go func() { done <- s.Run(context.Background(), r) }()
			task := e.next(t)
			bad := tc.bad(task)
			if bad.V == 0 {
				bad.V = max(e.welcome.Version, Version1)
			}
			if err := WriteMsg(e.c, bad); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				if !errors.Is(err, ErrEngineLost) {
					t.Fatalf("Run: %v, want ErrEngineLost", err)
				}
				t.Logf("XX %v", err)
			case <-time.After(5 * time.Second):
				t.Fatal("the connection outlived a frame breaking the protocol")
			}
			if s.Engine() != nil {
				t.Error("the engine is still registered")
			}
		})
	}
}

// The whole v2 round over a real socket: a checkpoint's latent goes
// through the lent buffer and is acknowledged; a tensor put through a lent
// region reaches the agent's cache (an engine.KVCache) under the engine's
// and model's prefix and comes back to the next task; a resume carries
// the state and the latent; a stop ends at a checkpoint with ErrStopped;
// a resume the engine or the agent refuses is an ErrBadCheckpoint.
func TestCheckpointsAndTensorCacheOverSocket(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngineWith(t, s, v2Register([]int32{Version1, Version2}, FeatureCheckpoint, FeatureTensorCache))
	kv := engine.NewKVCache(1 << 20)
	pattern := func(n int, seed byte) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = seed + byte(i*7)
		}
		return b
	}
	run := func(r Request) chan error {
		done := make(chan error, 1)
		go func() { done <- s.Run(context.Background(), r) }()
		return done
	}
	region := func(r *Region) []byte { return e.mem[r.Off : r.Off+r.Len] }
	getTensor := func(task *Msg, key string, n int64) *Msg {
		e.send(t, &Msg{T: TypeTensorGet, Task: task.Task, Key: key, Len: n})
		a := e.next(t)
		if a.T != TypeTensor || a.Key != key {
			t.Fatalf("answer to tensor_get: %+v", a)
		}
		return a
	}

	// 1. A 4-step denoise checkpointing every 2 steps, computing and
	// putting its tensor.
	var cks []Checkpoint
	r := denoiseRequest(t, ar, 4)
	r.CheckpointEvery, r.Tensors = 2, kv
	r.OnCheckpoint = func(ck Checkpoint) { cks = append(cks, ck.clone()) }
	done := run(r)
	task := e.next(t)
	if task.CheckpointEvery != 2 || task.CheckpointBuf == nil || task.CheckpointBuf.Len != 1024 || !slices.Equal(task.CheckpointBuf.Shape, []int64{1, 4, 8, 8}) || task.Resume != nil {
		t.Fatalf("task: checkpoint_every %d, buffer %+v, resume %+v", task.CheckpointEvery, task.CheckpointBuf, task.Resume)
	}
	a := getTensor(task, "neg/a", 64)
	if a.Found || a.Region == nil || a.Region.Len != 64 {
		t.Fatalf("tensor_get on an empty cache: %+v, want not found with 64 bytes lent", a)
	}
	copy(region(a.Region), pattern(64, 1))
	e.send(t, &Msg{T: TypeTensorPut, Task: task.Task, Key: "neg/a"})
	copy(region(task.CheckpointBuf), pattern(1024, 2))
	e.send(t, &Msg{T: TypeCheckpoint, Task: task.Task, Step: 2, Total: 4, State: []byte("after 2")})
	if ack := e.next(t); ack.T != TypeCheckpointed || ack.Step != 2 || ack.Task != task.Task {
		t.Fatalf("answer to a checkpoint: %+v, want checkpointed step 2", ack)
	}
	copy(region(task.Output), pattern(1024, 3))
	e.send(t, &Msg{T: TypeDone, Task: task.Task})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(cks) != 1 || cks[0].Step != 2 || cks[0].Total != 4 || cks[0].Sampler != "go-sampler/1" || string(cks[0].State) != "after 2" || !bytes.Equal(cks[0].Latent, pattern(1024, 2)) {
		t.Fatalf("checkpoints handed on: %+v", cks)
	}
	if v, ok := kv.Get("extengine/test-v2/1/m2/neg/a"); !ok || !bytes.Equal(v, pattern(64, 1)) {
		t.Fatalf("the agent's cache holds %v (%v) under the engine's and model's prefix", v, ok)
	}

	// 2. A resume from it: the state inline, the latent in the arena, and
	// the cached tensor found.
	r = denoiseRequest(t, ar, 4)
	r.Resume, r.Tensors = &cks[0], kv
	done = run(r)
	task = e.next(t)
	if res := task.Resume; res == nil || res.Step != 2 || res.Total != 4 || res.Sampler != "go-sampler/1" || string(res.State) != "after 2" || !bytes.Equal(region(&res.Latent), pattern(1024, 2)) {
		t.Fatalf("resume %+v", task.Resume)
	}
	if task.CheckpointBuf != nil {
		t.Errorf("a task that neither checkpoints nor can be stopped was lent a checkpoint buffer: %+v", task.CheckpointBuf)
	}
	if a := getTensor(task, "neg/a", 64); !a.Found || !bytes.Equal(region(a.Region), pattern(64, 1)) {
		t.Fatalf("tensor_get of a tensor put before: %+v", a)
	}
	e.send(t, &Msg{T: TypeDone, Task: task.Task})
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// 3. A stop: the engine checkpoints the step it is at and ends stopped.
	cks = nil
	stop := make(chan struct{})
	r = denoiseRequest(t, ar, 4)
	r.Stop = stop
	r.OnCheckpoint = func(ck Checkpoint) { cks = append(cks, ck.clone()) }
	done = run(r)
	task = e.next(t)
	e.send(t, &Msg{T: TypeProgress, Task: task.Task, Step: 1, Total: 4})
	close(stop)
	if m := e.next(t); m.T != TypeStop || m.Task != task.Task {
		t.Fatalf("after Stop: %+v, want a stop frame", m)
	}
	copy(region(task.CheckpointBuf), pattern(1024, 4))
	e.send(t, &Msg{T: TypeCheckpoint, Task: task.Task, Step: 1, Total: 4, State: []byte("after 1")})
	if ack := e.next(t); ack.T != TypeCheckpointed || ack.Step != 1 {
		t.Fatalf("answer to the stop's checkpoint: %+v", ack)
	}
	e.send(t, &Msg{T: TypeFailed, Task: task.Task, Code: CodeStopped, Reason: "stopped"})
	if err := <-done; !errors.Is(err, ErrStopped) {
		t.Fatalf("a stopped task: %v, want ErrStopped", err)
	}
	if len(cks) != 1 || cks[0].Step != 1 || !bytes.Equal(cks[0].Latent, pattern(1024, 4)) {
		t.Fatalf("stop's checkpoint: %+v", cks)
	}

	// 4. The engine refuses a resume: an ErrBadCheckpoint.
	r = denoiseRequest(t, ar, 4)
	r.Resume = &cks[0]
	done = run(r)
	task = e.next(t)
	e.send(t, &Msg{T: TypeFailed, Task: task.Task, Code: CodeBadCheckpoint, Reason: "not mine"})
	var te *TaskError
	if err := <-done; !errors.Is(err, ErrBadCheckpoint) || !errors.As(err, &te) || te.Reason != "not mine" {
		t.Fatalf("a resume the engine refused: %v, want a TaskError that is an ErrBadCheckpoint", err)
	}

	// 5. The agent refuses what the engine cannot resume, before sending.
	for name, mut := range map[string]func(*Checkpoint){
		"another sampler":  func(c *Checkpoint) { c.Sampler = "builtin/ddim" },
		"another size":     func(c *Checkpoint) { c.Latent = c.Latent[:512] },
		"past the request": func(c *Checkpoint) { c.Step, c.Total = 5, 8 },
	} {
		ck := cks[0].clone()
		mut(&ck)
		r = denoiseRequest(t, ar, 4)
		r.Resume = &ck
		if err := s.Run(context.Background(), r); !errors.Is(err, ErrBadCheckpoint) {
			t.Errorf("resume of %s: %v, want ErrBadCheckpoint", name, err)
		}
	}
	if s.Engine() == nil {
		t.Fatal("the engine was dropped")
	}
}

// dialRaw connects to s without registering.
func dialRaw(t *testing.T, s *Server) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.Addr(), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	return c
}
