package extengine

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// batchRegister registers model m2's denoise batching up to max tasks a
// call, slots calls at once.
func batchRegister(max, slots int32) *Msg {
	reg := v2Register([]int32{Version1, Version2}, FeatureBatch)
	reg.Models[0].Checkpoint, reg.Models[0].TensorCache = nil, false
	reg.Models[0].Batch = map[string]int32{StageDenoise: max}
	reg.Slots = map[string]int32{StageDenoise: slots}
	return reg
}

// batchServer is a Server whose batches wait at most window.
func batchServer(t *testing.T, window time.Duration) (*Server, *arena.Arena) {
	return testServerWith(t, func(ar *arena.Arena) Arena { return checkArena{ar} }, func(c *Config) { c.BatchWindow = window })
}

// runAll starts a Run of each request and returns their results' channel.
func runAll(s *Server, ctxs []context.Context, rs []Request) []chan error {
	res := make([]chan error, len(rs))
	for i := range rs {
		res[i] = make(chan error, 1)
		go func() { res[i] <- s.Run(ctxs[i], rs[i]) }()
	}
	return res
}

// Tasks of a batching model reach the engine as one batch once it is full:
// back to back, one batch id, the batch's size; each is answered on its
// own, and the Server counts one call.
func TestBatchGoesWhenFull(t *testing.T) {
	s, ar := batchServer(t, time.Minute) // a window no test waits out
	e := dialEngineWith(t, s, batchRegister(3, 1))
	if !s.Engine().Supports(FeatureBatch) || s.Engine().MaxBatch(StageDenoise, "m2") != 3 || s.Engine().SlotsFor(StageDenoise) != 3 {
		t.Fatalf("registration: batch granted %v, max %d, slots %d; want granted, 3, 3 (1 call of 3)",
			s.Engine().Supports(FeatureBatch), s.Engine().MaxBatch(StageDenoise, "m2"), s.Engine().SlotsFor(StageDenoise))
	}
	rs := []Request{denoiseRequest(t, ar, 4), denoiseRequest(t, ar, 4), denoiseRequest(t, ar, 4)}
	ctx := context.Background()
	res := runAll(s, []context.Context{ctx, ctx, ctx}, rs)
	var got []*Msg
	for range rs {
		got = append(got, e.next(t))
	}
	for _, m := range got {
		if m.T != TypeTask || m.Batch != got[0].Batch || m.Batch == 0 || m.BatchSize != 3 {
			t.Fatalf("task %d: %s in batch %d of size %d; want three tasks of one batch of 3", m.Task, m.T, m.Batch, m.BatchSize)
		}
	}
	for i, m := range got {
		e.send(t, &Msg{T: TypeProgress, Task: m.Task, Step: 4, Total: 4})
		if i == 1 {
			e.send(t, &Msg{T: TypeFailed, Task: m.Task, Code: CodeBadInput, Reason: "this one's input"})
		} else {
			e.send(t, &Msg{T: TypeDone, Task: m.Task})
		}
	}
	failed := 0
	for _, ch := range res {
		if err := <-ch; err != nil {
			var te *TaskError
			if !errors.As(err, &te) || te.Code != CodeBadInput {
				t.Fatalf("a member: %v", err)
			}
			failed++
		}
	}
	if failed != 1 {
		t.Fatalf("%d members failed, want the one the engine failed", failed)
	}
	if n := s.Calls(StageDenoise); n != 1 {
		t.Fatalf("%d engine calls, want 1", n)
	}
}

// A lone task goes when its window ends, with no batch fields.
func TestLoneTaskGoesAfterItsWindow(t *testing.T) {
	const window = 100 * time.Millisecond
	s, ar := batchServer(t, window)
	e := dialEngineWith(t, s, batchRegister(4, 1))
	start := time.Now()
	res := runAll(s, []context.Context{context.Background()}, []Request{denoiseRequest(t, ar, 2)})
	m := e.next(t)
	if m.Batch != 0 || m.BatchSize != 0 {
		t.Fatalf("a lone task sent in batch %d of %d", m.Batch, m.BatchSize)
	}
	if waited := time.Since(start); waited < window {
		t.Fatalf("a lone task went after %v, before its %v window ended", waited, window)
	}
	e.send(t, &Msg{T: TypeDone, Task: m.Task})
	if err := <-res[0]; err != nil {
		t.Fatal(err)
	}
}

// Cancelling one member cancels only it: the engine gets a cancel of that
// task, and the others' answers still come back.
func TestBatchMemberCancel(t *testing.T) {
	s, ar := batchServer(t, time.Minute)
	e := dialEngineWith(t, s, batchRegister(2, 1))
	cctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	res := runAll(s, []context.Context{context.Background(), cctx}, []Request{denoiseRequest(t, ar, 8), denoiseRequest(t, ar, 8)})
	a, b := e.next(t), e.next(t)
	if a.Batch == 0 || a.Batch != b.Batch {
		t.Fatalf("batches %d and %d, want one", a.Batch, b.Batch)
	}
	cancel()
	m := e.next(t)
	var victim, other uint64 = b.Task, a.Task
	if m.T != TypeCancel || m.Task != victim && m.Task != other {
		t.Fatalf("after the cancel: %s of task %d", m.T, m.Task)
	}
	victim, other = m.Task, map[uint64]uint64{a.Task: b.Task, b.Task: a.Task}[m.Task]
	e.send(t, &Msg{T: TypeFailed, Task: victim, Code: CodeCancelled, Reason: "cancelled"})
	e.send(t, &Msg{T: TypeDone, Task: other})
	var errs []error
	for _, ch := range res {
		errs = append(errs, <-ch)
	}
	if errs[0] != nil || !errors.Is(errs[1], context.Canceled) {
		t.Fatalf("results %v; want the kept member done and the cancelled one cancelled", errs)
	}
}

// While the engine's call slots are taken, a batch keeps taking members,
// and goes once a call ends: under load batches fill.
func TestBatchWaitsForACallSlot(t *testing.T) {
	s, ar := batchServer(t, time.Millisecond)
	e := dialEngineWith(t, s, batchRegister(4, 1))
	ctx := context.Background()
	first := runAll(s, []context.Context{ctx}, []Request{denoiseRequest(t, ar, 2)})
	m := e.next(t) // the engine's one call
	rest := runAll(s, []context.Context{ctx, ctx}, []Request{denoiseRequest(t, ar, 2), denoiseRequest(t, ar, 2)})
	for waitingIn(s) < 2 { // both joined, their window long past: only the call slot holds them
		time.Sleep(time.Millisecond)
	}
	e.send(t, &Msg{T: TypeDone, Task: m.Task})
	if err := <-first[0]; err != nil {
		t.Fatal(err)
	}
	a, b := e.next(t), e.next(t)
	if a.Batch == 0 || a.Batch != b.Batch || a.BatchSize != 2 {
		t.Fatalf("after the call ended: batches %d and %d of size %d; want one batch of the two that waited", a.Batch, b.Batch, a.BatchSize)
	}
	e.send(t, &Msg{T: TypeDone, Task: a.Task})
	e.send(t, &Msg{T: TypeDone, Task: b.Task})
	for _, ch := range rest {
		if err := <-ch; err != nil {
			t.Fatal(err)
		}
	}
	if n := s.Calls(StageDenoise); n != 2 {
		t.Fatalf("%d engine calls, want 2", n)
	}
}

// batchFrames are frames with every batch field, seeds of FuzzDecodeMsg.
func batchFrames() []*Msg {
	return []*Msg{
		batchRegister(4, 2),
		{V: Version2, T: TypeTask, Task: 6, Stage: StageDenoise, Model: "m2",
			Spec:   &engine.Spec{Model: "m2", Prompt: "p", Width: 64, Height: 64, Frames: 1, Steps: 4, GuidanceScale: 5},
			Inputs: []Region{{Off: 0, Len: 1024, DType: "float32", Shape: []int64{2, 8, 16}}}, Output: &Region{Off: 4096, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}},
			Batch: 3, BatchSize: 4},
	}
}

// Batch fields outside a version 2 task, and batches a model cannot
// declare, are refused.
func TestBatchFieldsValidated(t *testing.T) {
	for name, m := range map[string]*Msg{
		"v1 task":      {V: Version1, T: TypeTask, Batch: 1, BatchSize: 2},
		"not a task":   {V: Version2, T: TypeDone, Task: 1, Batch: 1, BatchSize: 2},
		"size 1":       {V: Version2, T: TypeTask, Batch: 1, BatchSize: 1},
		"size too big": {V: Version2, T: TypeTask, Batch: 1, BatchSize: MaxBatch + 1},
		"no batch id":  {V: Version2, T: TypeTask, BatchSize: 2},
	} {
		if err := m.validateBatchFields(); !errors.Is(err, ErrBadFrame) {
			t.Errorf("%s: %v, want ErrBadFrame", name, err)
		}
	}
	reg := batchRegister(4, 1)
	for name, batch := range map[string]map[string]int32{
		"unserved stage": {StageDecode: 2},
		"zero":           {StageDenoise: 0},
		"too big":        {StageDenoise: MaxBatch + 1},
	} {
		mo := reg.Models[0]
		mo.Batch = batch
		if err := mo.validate(); err == nil {
			t.Errorf("a model batching %s: accepted", name)
		}
	}
}

// waitingIn is how many tasks wait in s's forming batches.
func waitingIn(s *Server) int {
	s.batch.mu.Lock()
	defer s.batch.mu.Unlock()
	n := 0
	for _, f := range s.batch.open {
		n += len(f.members)
	}
	return n
}

// An engine gone fails the members of its batches, sent or forming, as
// the engine's loss (the agent runs them elsewhere).
func TestBatchMembersFailWithTheirEngine(t *testing.T) {
	s, ar := batchServer(t, time.Millisecond)
	e := dialEngineWith(t, s, batchRegister(2, 1))
	ctx := context.Background()
	sent := runAll(s, []context.Context{ctx, ctx}, []Request{denoiseRequest(t, ar, 2), denoiseRequest(t, ar, 2)})
	e.next(t)
	e.next(t)
	waiting := runAll(s, []context.Context{ctx}, []Request{denoiseRequest(t, ar, 2)}) // no call free: it waits
	for waitingIn(s) < 1 {
		time.Sleep(time.Millisecond)
	}
	e.c.Close()
	for _, ch := range append(sent, waiting...) {
		if err := <-ch; !errors.Is(err, ErrEngineLost) {
			t.Fatalf("a member after its engine went: %v, want ErrEngineLost", err)
		}
	}
}
