package extengine

// This file holds protocol v2's batching (feature `batch`, issue 20): a
// model declares, per stage, the most tasks one engine call takes
// (Model.Batch); the agent sends up to that many compatible tasks (same
// stage, model, size, frames, steps and adapter) back to back, each a task
// frame of its own that carries the batch's id and size, and the engine
// runs them in one call. Everything else stays per task: its own id,
// progress, checkpoints, cancel, stop and answer, so a member cancelled or
// failed does not fail the others, and the agent keeps a fenced claim,
// admission and a commit per member as for any task.
//
// Which tasks go together is the Server's (batcher): a task of a batching
// model waits at most Config.BatchWindow for more of its kind, and goes at
// once when its batch is full; a batch then waits for a call of its stage
// to be free on the engine (Registration.Slots), taking more members
// meanwhile, so that under load the batches fill while the engine works.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// FeatureBatch is batching: Model.Batch, and a task's Batch and BatchSize.
const FeatureBatch = "batch"

// MaxBatch bounds a model's batch per stage, and a batch's size.
const MaxBatch = 64

// validateBatch checks what mo declares of batching: stages it serves,
// each at most MaxBatch tasks a call.
func (mo *Model) validateBatch() error {
	if len(mo.Batch) > 3 {
		return fmt.Errorf("batch for %d stages, want at most 3", len(mo.Batch))
	}
	for st, n := range mo.Batch {
		if !slices.Contains(mo.Stages, st) {
			return fmt.Errorf("batch for stage %q, which the model does not serve", st)
		}
		if n < 1 || n > MaxBatch {
			return fmt.Errorf("batch of %d %s tasks, want 1-%d", n, st, MaxBatch)
		}
	}
	return nil
}

// validateBatchFields checks a frame's batch fields: only in a version 2
// task, both or neither, the size 2-MaxBatch.
func (m *Msg) validateBatchFields() error {
	if m.Batch == 0 && m.BatchSize == 0 {
		return nil
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	switch {
	case m.V < Version2:
		return bad("version %d fields in a version %d frame", Version2, m.V)
	case m.T != TypeTask:
		return bad("batch fields outside a task")
	case m.Batch == 0 || m.BatchSize < 2 || m.BatchSize > MaxBatch:
		return bad("batch %d of size %d, want an id and a size of 2-%d", m.Batch, m.BatchSize, MaxBatch)
	}
	return nil
}

// MaxBatch is how many tasks of stage of model one engine call takes: the
// model's batch when the session granted batching, else 1.
func (r *Registration) MaxBatch(stage, model string) int {
	m, ok := r.Model(stage, model)
	if !ok || !r.Supports(FeatureBatch) {
		return 1
	}
	return max(1, int(m.Batch[stage]))
}

// StageBatch is the largest batch of stage among the models serving it.
func (r *Registration) StageBatch(stage string) int {
	n := 1
	for _, m := range r.Models {
		if slices.Contains(m.Stages, stage) {
			n = max(n, r.MaxBatch(stage, m.Name))
		}
	}
	return n
}

// batchable reports whether r may share an engine call: not a resume
// (each continues from its own step), not a chunk of a longer decode
// stream (sent in order, one at a time).
func batchable(r Request) bool {
	return r.Resume == nil && (r.Stream == nil || r.FirstFrame == 0 && r.LastChunk)
}

// batchKey is what tasks sharing a call have in common.
type batchKey struct {
	stage, model, adapter string
	width, height, frames int
	steps                 int
	firstFrame, nframes   int // a decode's input
}

func keyOf(r Request) batchKey {
	return batchKey{stage: r.Stage, model: r.Model, adapter: r.Spec.Adapter,
		width: r.Spec.Width, height: r.Spec.Height, frames: r.Spec.Frames, steps: r.Spec.Steps,
		firstFrame: r.FirstFrame, nframes: r.Frames}
}

// batcher forms the batches of one Server: open holds the batch of each
// kind still taking members, on the connection they will go to. A batch
// goes when it is full or its window ends, and then only once the engine
// has a call of its stage free (Registration.Slots): a batch waiting for
// the engine keeps taking members, so under load batches fill while the
// engine is busy.
type batcher struct {
	s    *Server
	ids  atomic.Uint64
	mu   sync.Mutex
	open map[batchKey]*forming
	// made counts engine calls by stage (a batch is one), for Calls.
	made map[string]*atomic.Int64
}

// newBatcher is s's batcher.
func newBatcher(s *Server) batcher {
	made := map[string]*atomic.Int64{}
	for _, st := range []string{StageEncode, StageDenoise, StageDecode} {
		made[st] = new(atomic.Int64)
	}
	return batcher{s: s, open: map[batchKey]*forming{}, made: made}
}

// member is one task waiting in a forming batch: sent gets the write's
// outcome once its frame went (m.Task set), or was never sent.
type member struct {
	m    *Msg
	p    *pending
	sent chan error
}

type forming struct {
	key     batchKey
	c       *conn
	max     int
	members []*member
	ready   chan struct{} // closed when it is full
	flushed bool          // gone: no more members
	left    atomic.Int32  // members sent and not yet answered
	slot    chan struct{} // the call slot it holds once sent
}

// callSlots is c's call slots of stage, a buffered channel of the
// engine's slots (1 unless it said): a batch takes one from when it goes
// until its last member is answered.
func (c *conn) callSlots(stage string) chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := c.calls[stage]
	if ch == nil {
		n, ok := c.reg.Slots[stage]
		if !ok || n < 1 {
			n = 1
		}
		ch = make(chan struct{}, n)
		c.calls[stage] = ch
	}
	return ch
}

// join adds task m (its pending p) to the forming batch of r's kind on c,
// of at most n tasks, and returns once the batch went (nil: m.Task is set
// and the engine has it) or could not be sent; a member whose ctx ends
// before its batch goes leaves it, unsent (ctx's error). done, once the
// task is answered, frees the batch's call slot after its last member.
func (b *batcher) join(ctx context.Context, c *conn, r Request, n int, m *Msg, p *pending) (done func(), err error) {
	me := &member{m: m, p: p, sent: make(chan error, 1)}
	key := keyOf(r)
	b.mu.Lock()
	f := b.open[key]
	if f == nil || f.c != c {
		f = &forming{key: key, c: c, max: n, ready: make(chan struct{}), slot: c.callSlots(r.Stage)}
		b.open[key] = f
		go b.launch(f)
	}
	f.members = append(f.members, me)
	if len(f.members) == f.max {
		delete(b.open, key) // full: it goes, and the next task of its kind starts another
		close(f.ready)
	}
	b.mu.Unlock()
	done = func() {
		if f.left.Add(-1) == 0 {
			<-f.slot
		}
	}
	select {
	case err := <-me.sent:
		return done, err
	case <-ctx.Done():
	}
	b.mu.Lock()
	if i := slices.Index(f.members, me); i >= 0 && !f.flushed {
		f.members = slices.Delete(f.members, i, i+1)
		b.mu.Unlock()
		return func() {}, ctx.Err()
	}
	b.mu.Unlock()
	return done, <-me.sent // it went meanwhile: the caller cancels it as any task
}

// launch sends f once it should go and the engine has a call of its stage
// free: each task is added to the connection, then all the frames are
// written in one write, so that the engine reads them back to back.
func (b *batcher) launch(f *forming) {
	t := time.NewTimer(b.s.cfg.BatchWindow)
	select {
	case <-f.ready:
	case <-t.C:
	case <-f.c.dead:
	}
	t.Stop()
	select {
	case f.slot <- struct{}{}: // meanwhile f still takes members, up to its size
	case <-f.c.dead:
	}
	b.mu.Lock()
	f.flushed = true
	if b.open[f.key] == f {
		delete(b.open, f.key)
	}
	members := f.members
	b.mu.Unlock()
	select {
	case <-f.c.dead:
		for _, me := range members {
			me.sent <- ErrEngineLost
		}
		return
	default:
	}
	if len(members) == 0 {
		<-f.slot
		return
	}
	f.left.Store(int32(len(members)))
	id := b.ids.Add(1)
	msgs := make([]*Msg, 0, len(members))
	var err error
	for _, me := range members {
		tid, added := f.c.add(me.p)
		if !added {
			err = ErrEngineLost
			break
		}
		me.m.Task = tid
		if len(members) > 1 {
			me.m.Batch, me.m.BatchSize = id, int32(len(members))
		}
		msgs = append(msgs, me.m)
	}
	if err == nil {
		b.made[f.key.stage].Add(1)
		if err = f.c.write(msgs...); err != nil {
			f.c.fail(fmt.Errorf("send batch: %w", err))
			err = fmt.Errorf("%w: %v", ErrEngineLost, err)
		}
	}
	for _, me := range members {
		me.sent <- err
	}
}

// Calls is how many engine calls of stage this Server has made: a batch is
// one, whatever its size.
func (s *Server) Calls(stage string) int64 {
	if n := s.batch.made[stage]; n != nil {
		return n.Load()
	}
	return 0
}
