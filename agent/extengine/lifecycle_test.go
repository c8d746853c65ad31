package extengine

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// lifecycleRegister registers m2 (a denoiser) and m (a decoder) asking
// for the lifecycle features.
func lifecycleRegister() *Msg {
	reg := v2Register([]int32{Version1, Version2}, lifecycleFeatures...)
	reg.Models = append(reg.Models, validRegister().Models...)
	return reg
}

// lifecycleFrames are one well-formed frame of every lifecycle type and
// field: the round trip's cases and the fuzzer's seeds.
func lifecycleFrames() []*Msg {
	out := Region{Off: 4096, Len: 64 * 64 * 4, DType: "uint8", Shape: []int64{1, 64, 64, 4}}
	added := validRegister().Models[0]
	added.Name = "m3"
	return []*Msg{
		lifecycleRegister(),
		{V: Version2, T: TypeTask, Task: 5, Stage: StageDecode, Model: "m",
			Spec:   &engine.Spec{Model: "m", Prompt: "p", Width: 64, Height: 64, Frames: 3, Steps: 4, GuidanceScale: 5},
			Inputs: []Region{{Off: 0, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}}}, Output: &out,
			FirstFrame: 2, Frames: 1, Stream: 7, Job: "0123456789abcdef", Chunk: 2, Last: true},
		{V: Version2, T: TypeTask, Task: 6, Stage: StageDenoise, Model: "m2",
			Spec:   &engine.Spec{Model: "m2", Prompt: "p", Width: 64, Height: 64, Frames: 1, Steps: 4, GuidanceScale: 5},
			Inputs: []Region{{Off: 0, Len: 1024, DType: "float32", Shape: []int64{2, 8, 16}}}, Output: &Region{Off: 4096, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}},
			Adapter: "paint-v1"},
		{V: Version2, T: TypeChunkReady, Task: 6, Chunk: 3},
		{V: Version2, T: TypeStreamEnd, Stream: 7},
		{V: Version2, T: TypeAddModel, Models: []Model{added}},
		{V: Version2, T: TypeRemoveModel, Model: "m3"},
		{V: Version2, T: TypeAdapterLoaded, Model: "m2", Adapter: "paint-v1"},
		{V: Version2, T: TypeAdapterUnloaded, Model: "m2", Adapter: "paint-v1"},
		{V: Version2, T: TypeAck, Model: "m2", Adapter: "paint-v1", Reason: "adapter \"paint-v1\" of model \"m2\" is not loaded"},
		{V: Version2, T: TypeFailed, Task: 5, Code: CodeLostState, Reason: "no state"},
	}
}

// Lifecycle frames and fields out of bounds, or where they do not belong,
// are refused before anything acts on them.
func TestDecodeRejectsLifecycle(t *testing.T) {
	enc := func(m map[string]any) []byte { b, _ := msgpack.Marshal(m); return b }
	task := func(extra map[string]any) []byte {
		m := map[string]any{"v": 2, "t": "task", "task": 1, "stage": "decode", "spec": map[string]any{},
			"output": map[string]any{"off": 0, "len": 4, "dtype": "uint8", "shape": []int{4}}}
		for k, v := range extra {
			m[k] = v
		}
		return enc(m)
	}
	cases := map[string][]byte{
		"chunk_ready at v1":          enc(map[string]any{"v": 1, "t": "chunk_ready", "task": 1, "chunk": 1}),
		"chunk_ready without a task": enc(map[string]any{"v": 2, "t": "chunk_ready", "chunk": 1}),
		"negative chunk":             enc(map[string]any{"v": 2, "t": "chunk_ready", "task": 1, "chunk": -1}),
		"chunk past the frames":      enc(map[string]any{"v": 2, "t": "chunk_ready", "task": 1, "chunk": MaxLimitFrames}),
		"stream field at v1":         enc(map[string]any{"v": 1, "t": "task", "task": 1, "stage": "decode", "spec": map[string]any{}, "output": map[string]any{"off": 0, "len": 4, "dtype": "uint8", "shape": []int{4}}, "stream": 1}),
		"chunk without a stream":     task(map[string]any{"chunk": 1}),
		"stream of a denoise":        task(map[string]any{"stage": "denoise", "stream": 1}),
		"job id too long":            task(map[string]any{"stream": 1, "job": strings.Repeat("j", MaxJobID+1)}),
		"job id with a newline":      task(map[string]any{"stream": 1, "job": "a\nb"}),
		"adapter of a decode":        task(map[string]any{"adapter": "a"}),
		"adapter name too long":      enc(map[string]any{"v": 2, "t": "adapter_loaded", "model": "m2", "adapter": strings.Repeat("a", engine.MaxAdapterLen+1)}),
		"adapter name with a slash":  enc(map[string]any{"v": 2, "t": "adapter_loaded", "model": "m2", "adapter": "a/b"}),
		"adapter_loaded no adapter":  enc(map[string]any{"v": 2, "t": "adapter_loaded", "model": "m2"}),
		"adapter_unloaded no model":  enc(map[string]any{"v": 2, "t": "adapter_unloaded", "adapter": "a"}),
		"adapter in a progress":      enc(map[string]any{"v": 2, "t": "progress", "task": 1, "step": 1, "total": 2, "adapter": "a"}),
		"stream_end without a id":    enc(map[string]any{"v": 2, "t": "stream_end"}),
		"add_model of two models":    enc(map[string]any{"v": 2, "t": "add_model", "models": []any{validRegister().Models[0], validRegister().Models[0]}}),
		"add_model of a bad model":   enc(map[string]any{"v": 2, "t": "add_model", "models": []any{map[string]any{"name": "a b", "stages": []string{"decode"}}}}),
		"remove_model no name":       enc(map[string]any{"v": 2, "t": "remove_model"}),
	}
	for name, b := range cases {
		if _, err := DecodeMsg(b); !errors.Is(err, ErrBadFrame) {
			t.Errorf("%s: got %v, want a bad frame", name, err)
		}
	}
}

// A denoise's chunk_ready hands chunk k on at once (before the task's
// done), and the chunks the engine did not report are handed on at done,
// each chunk exactly once.
func TestChunkReadyBeforeDone(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngineWith(t, s, lifecycleRegister())
	r := denoiseRequest(t, ar, 4)
	out, err := ar.Alloc(3 * 4 * 8 * 8 * 4) // three latent frames
	if err != nil {
		t.Fatal(err)
	}
	r.Spec.Frames = 3
	r.Output = Tensor{DType: "float32", Shape: []int64{3, 4, 8, 8}, Data: ar.Slice(out)}
	early := make(chan int, 1)
	var got []int
	r.ChunkReady = func(k int) {
		got = append(got, k)
		if len(got) == 1 {
			early <- k
		}
	}
	res := make(chan error, 1)
	go func() { res <- s.Run(context.Background(), r) }()
	m := e.next(t)
	e.send(t, &Msg{T: TypeChunkReady, Task: m.Task, Chunk: 1})
	if k := <-early; k != 1 {
		t.Fatalf("first chunk handed on: %d, want 1", k)
	}
	select {
	case err := <-res:
		t.Fatalf("Run returned (%v) before the engine's done", err)
	default:
	}
	e.send(t, &Msg{T: TypeDone, Task: m.Task})
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []int{1, 0, 2}) {
		t.Fatalf("chunks handed on %v, want [1 0 2]: the reported one, then the rest at done", got)
	}
}

// A malformed or misplaced chunk_ready ends the connection: the task fails
// as the engine's loss, and the reason names what was wrong.
func TestBadChunkReadyClosesConnection(t *testing.T) {
	for _, tc := range []struct {
		name   string
		frames []func(task uint64) *Msg
		want   string
	}{
		{"a chunk past the latent", []func(uint64) *Msg{func(id uint64) *Msg { return &Msg{T: TypeChunkReady, Task: id, Chunk: 1} }},
			"chunk_ready of chunk 1 of task 1, whose latent has 1 chunks"},
		{"a chunk twice", []func(uint64) *Msg{
			func(id uint64) *Msg { return &Msg{T: TypeChunkReady, Task: id} },
			func(id uint64) *Msg { return &Msg{T: TypeChunkReady, Task: id} }},
			"chunk_ready of chunk 0 of task 1 twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, ar := testServer(t)
			gone := make(chan error, 1)
			s.cfg.OnGone = func(err error) { gone <- err }
			e := dialEngineWith(t, s, lifecycleRegister())
			r := denoiseRequest(t, ar, 4)
			r.ChunkReady = func(int) {}
			res := make(chan error, 1)
			go func() { res <- s.Run(context.Background(), r) }()
			m := e.next(t)
			for _, f := range tc.frames {
				e.send(t, f(m.Task))
			}
			if err := <-res; !errors.Is(err, ErrEngineLost) {
				t.Fatalf("Run: %v, want ErrEngineLost", err)
			}
			if err := <-gone; !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("connection ended for %q, want it to say %q", err, tc.want)
			}
		})
	}
}

// A decode stream: its chunks carry one stream id, the job, their index and
// the last flag; another decode gets another stream; Close of a stream
// whose last chunk never went tells the engine to drop it; a chunk the
// engine answers lost_state fails as ErrLostState, and so does every later
// chunk of that stream (the decode stage starts again).
func TestDecodeStream(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngineWith(t, s, lifecycleRegister())
	run := func(st *Stream, last bool, answer func(m *Msg) *Msg) (*Msg, error) {
		r := decodeRequest(t, ar)
		r.Stream, r.LastChunk = st, last
		res := make(chan error, 1)
		go func() { res <- s.Run(context.Background(), r) }()
		m := e.next(t)
		e.send(t, answer(m))
		return m, <-res
	}
	done := func(m *Msg) *Msg { return &Msg{T: TypeDone, Task: m.Task} }
	a, b := NewStream("0123456789abcdef"), NewStream("fedcba9876543210")
	m0, err := run(a, false, done)
	if err != nil || m0.Stream == 0 || m0.Job != "0123456789abcdef" || m0.Chunk != 0 || m0.Last {
		t.Fatalf("chunk 0: %+v, %v", m0, err)
	}
	mb, err := run(b, false, done)
	if err != nil || mb.Stream == m0.Stream {
		t.Fatalf("a second stream's chunk 0 has stream %d (%v), the first's is %d", mb.Stream, err, m0.Stream)
	}
	m1, err := run(a, true, done)
	if err != nil || m1.Stream != m0.Stream || m1.Chunk != 1 || !m1.Last {
		t.Fatalf("chunk 1: %+v, %v; want stream %d, chunk 1, last", m1, err, m0.Stream)
	}
	a.Close() // ended by its last chunk: nothing to tell the engine
	b.Close()
	if m := e.next(t); m.T != TypeStreamEnd || m.Stream != mb.Stream {
		t.Fatalf("after closing an unfinished stream the engine got %+v, want stream_end of stream %d", m, mb.Stream)
	}
	c := NewStream("c")
	if _, err := run(c, false, done); err != nil {
		t.Fatal(err)
	}
	_, err = run(c, false, func(m *Msg) *Msg { return &Msg{T: TypeFailed, Task: m.Task, Code: CodeLostState, Reason: "no state"} })
	if !errors.Is(err, ErrLostState) {
		t.Fatalf("a chunk answered lost_state: %v, want ErrLostState", err)
	}
	r := decodeRequest(t, ar)
	r.Stream = c
	if err := s.Run(context.Background(), r); !errors.Is(err, ErrLostState) {
		t.Fatalf("a chunk after a failed one: %v, want ErrLostState without a task sent", err)
	}
}

// add_model, remove_model, adapter_loaded and adapter_unloaded change the
// registration (each wakes Changed) and are acked; a refused one is acked
// with the reason and changes nothing. A denoise names its adapter only
// while the engine has it loaded; a no_adapter answer is ErrNoAdapter.
func TestLifecycleFrames(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngineWith(t, s, lifecycleRegister())
	do := func(m *Msg) *Msg {
		t.Helper()
		ch := s.Changed()
		e.send(t, m)
		ack := e.next(t)
		if ack.T != TypeAck {
			t.Fatalf("answer to %s: %+v, want an ack", m.T, ack)
		}
		if ack.Reason == "" {
			select {
			case <-ch:
			case <-time.After(5 * time.Second):
				t.Fatalf("%s taken, but Changed was not closed", m.T)
			}
		}
		return ack
	}
	added := validRegister().Models[0]
	added.Name = "m3"
	if ack := do(&Msg{T: TypeAddModel, Models: []Model{added}}); ack.Reason != "" || !s.Engine().Serves(StageDecode, "m3") {
		t.Fatalf("add_model: ack %q; m3 served: %v", ack.Reason, s.Engine().Serves(StageDecode, "m3"))
	}
	if ack := do(&Msg{T: TypeAddModel, Models: []Model{added}}); !strings.Contains(ack.Reason, `model "m3" is already registered`) {
		t.Fatalf("add_model twice: ack %q", ack.Reason)
	}
	if ack := do(&Msg{T: TypeRemoveModel, Model: "m3"}); ack.Reason != "" || s.Engine().Serves(StageDecode, "m3") {
		t.Fatalf("remove_model: ack %q", ack.Reason)
	}
	if ack := do(&Msg{T: TypeAdapterLoaded, Model: "m", Adapter: "a1"}); !strings.Contains(ack.Reason, "not registered with a denoise") {
		t.Fatalf("an adapter of a decode-only model: ack %q", ack.Reason)
	}
	before := s.Engine()
	if ack := do(&Msg{T: TypeAdapterLoaded, Model: "m2", Adapter: "a1"}); ack.Reason != "" || !s.Engine().HasAdapter("m2", "a1") {
		t.Fatalf("adapter_loaded: ack %q", ack.Reason)
	}
	if before.HasAdapter("m2", "a1") {
		t.Fatal("a Registration handed out before the change was changed")
	}
	r := denoiseRequest(t, ar, 2)
	r.Spec.Adapter = "a1"
	res := make(chan error, 1)
	go func() { res <- s.Run(context.Background(), r) }()
	m := e.next(t)
	if m.Adapter != "a1" {
		t.Fatalf("task of a job naming adapter a1 carries adapter %q", m.Adapter)
	}
	e.send(t, &Msg{T: TypeFailed, Task: m.Task, Code: CodeNoAdapter, Reason: "unloaded"})
	if err := <-res; !errors.Is(err, ErrNoAdapter) {
		t.Fatalf("a task answered no_adapter: %v, want ErrNoAdapter", err)
	}
	if ack := do(&Msg{T: TypeAdapterUnloaded, Model: "m2", Adapter: "a1"}); ack.Reason != "" || s.Engine().HasAdapter("m2", "a1") {
		t.Fatalf("adapter_unloaded: ack %q", ack.Reason)
	}
	if err := s.Run(context.Background(), denoiseWith(t, ar, "a1")); !errors.Is(err, ErrNoAdapter) {
		t.Fatalf("a denoise naming an unloaded adapter: %v, want ErrNoAdapter before anything is sent", err)
	}
	if ack := do(&Msg{T: TypeAdapterUnloaded, Model: "m2", Adapter: "a1"}); !strings.Contains(ack.Reason, `adapter "a1" of model "m2" is not loaded`) {
		t.Fatalf("adapter_unloaded twice: ack %q", ack.Reason)
	}
}

func denoiseWith(t *testing.T, ar *arena.Arena, adapter string) Request {
	r := denoiseRequest(t, ar, 2)
	r.Spec.Adapter = adapter
	return r
}

// A lifecycle frame of a feature the session did not grant ends the
// connection.
func TestLifecycleNotGrantedClosesConnection(t *testing.T) {
	s, _ := testServer(t)
	gone := make(chan error, 1)
	s.cfg.OnGone = func(err error) { gone <- err }
	e := dialEngineWith(t, s, v2Register([]int32{Version2}, FeatureModelLifecycle))
	e.send(t, &Msg{T: TypeAdapterLoaded, Model: "m2", Adapter: "a1"})
	if err := <-gone; !strings.Contains(err.Error(), "adapter_loaded, but the session has no adapters feature") {
		t.Fatalf("connection ended for %v", err)
	}
}
