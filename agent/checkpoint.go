package agent

// This file holds step checkpoints on the worker's side: publishing a
// running denoise's checkpoints to the Store without stalling its sampler,
// finding the one a retried (or forked) denoise resumes from, and stopping
// a denoise at a checkpoint for a preemption or a drain.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// checkpointReplicas is R of a checkpoint: it outlives its worker (which is
// what it is for) and survives one holder's loss.
const checkpointReplicas = 2

// checkpointEvery is the checkpoint period of c's denoise: the request's,
// else the model's registered default, else the agent's flag; 0 for none.
func (a *Agent) checkpointEvery(t jobs.Task) int {
	ok, model := a.runner.Checkpoints(t.Spec)
	switch {
	case !ok:
		return 0
	case t.Checkpointing != nil && t.Checkpointing.Every != nil:
		return *t.Checkpointing.Every
	case model > 0:
		return model
	}
	return a.cfg.CheckpointEvery
}

// checkpointer writes one denoise task's checkpoints to the Store, one at a
// time, off the sampler's goroutine: a checkpoint that comes while the one
// before is still being written replaces any waiting one (the newest is
// all a resume needs). Each is one Store put and one etcd transaction,
// which also deletes the record of the one before the checkpoint it
// follows: the two newest are kept, so that a write whose copies are
// still on their way when a holder dies costs a resume from the one
// before, not from noise (the record is committed while the first copy
// lands; a first copy that then fails has its record taken back). A job that
// keeps its checkpoints for forks (keep_checkpoints) has every one written
// and none deleted: a fork may start from any of them.
type checkpointer struct {
	a    *Agent
	c    *jobs.Claim
	ttl  time.Duration
	keep bool // keep every checkpoint (for forks)
	log  *zap.Logger

	mu      sync.Mutex
	waiting []engine.Checkpoint // not yet being written: the newest only, or every one when keep
	busy    bool                // a writer goroutine runs
	idle    chan struct{}       // closed when busy turns false; replaced when it turns true
	last    string              // object id of the newest checkpoint written, "" for none
	older   string              // the one before it, deleted with the next write
	step    int                 // its step
	written int
	err     error // the last write's failure, nil after a success
}

func (a *Agent) newCheckpointer(c *jobs.Claim, prev string, prevStep int) *checkpointer {
	ttl, keep := a.cfg.CheckpointTTL, false
	if k := c.Task.Checkpointing; k != nil && k.Keep > 0 {
		ttl, keep = k.Keep, true
	}
	idle := make(chan struct{})
	close(idle)
	return &checkpointer{a: a, c: c, ttl: ttl, keep: keep, idle: idle, last: prev, step: prevStep,
		log: a.log.With(zap.String("job", c.Task.JobID))}
}

// offer hands a checkpoint on for writing; it returns at once.
func (k *checkpointer) offer(ck engine.Checkpoint) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.keep {
		k.waiting = append(k.waiting, ck)
	} else {
		k.waiting = append(k.waiting[:0], ck)
	}
	if k.busy {
		return
	}
	k.busy, k.idle = true, make(chan struct{})
	go k.drain()
}

func (k *checkpointer) drain() {
	for {
		k.mu.Lock()
		if len(k.waiting) == 0 {
			k.busy = false
			close(k.idle)
			k.mu.Unlock()
			return
		}
		ck := k.waiting[0]
		k.waiting = k.waiting[1:]
		prev, drop := k.last, k.older
		if k.keep {
			drop = ""
		}
		k.mu.Unlock()
		id, err := k.write(ck, prev, drop)
		k.mu.Lock()
		k.err = err
		if err == nil {
			if id != prev {
				k.older, k.last = prev, id
			}
			k.step = ck.Step
			k.written++
		}
		k.mu.Unlock()
	}
}

// write puts ck and makes it the job's newest checkpoint, deleting drop's
// record (prev is the newest until now).
func (k *checkpointer) write(ck engine.Checkpoint, prev, drop string) (string, error) {
	a, c := k.a, k.c
	data, err := ck.MarshalBinary()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(a.ctx, 4*a.cfg.EtcdTimeout)
	defer cancel()
	id := jobs.CheckpointID(c.Task.JobID, ck.Step)
	if id == prev {
		return id, nil // a stop right after a periodic checkpoint of the same step
	}
	// FirstCopy: StageBytes returns once the holders have published their
	// copies in flight, and the record is committed (fenced by the claim)
	// while the first copy lands; the write is done once that copy is
	// whole. The second follows it along the chain. A reader that finds
	// the record meanwhile waits for the copy's bytes.
	st, err := a.cstore.StageBytes(ctx, cache.PutSpec{
		ID: id, Mode: cache.TTL, Job: c.Task.JobID, TTL: k.ttl, Replicas: checkpointReplicas,
		ContentType: "application/x-latentmesh-checkpoint", FirstCopy: true,
	}, data)
	if err != nil {
		k.log.Warn("checkpoint not written", zap.Int("step", ck.Step), zap.Error(err))
		return "", err
	}
	if err := a.store.SaveCheckpoint(ctx, c, st, drop); err != nil {
		st.Abort(a.ctx)
		k.log.Warn("checkpoint not recorded", zap.Int("step", ck.Step), zap.Error(err))
		return "", err
	}
	if err := st.FirstCopied(ctx); err != nil {
		// The first copy failed after the commit: FirstCopied deleted the
		// record (unfenced, but only while it names this write's copies),
		// so none names a copy that never was. prev, the checkpoint
		// before, is kept: a resume goes on from it.
		k.log.Warn("checkpoint's first copy failed; its record taken back", zap.Int("step", ck.Step), zap.Error(err))
		return "", err
	}
	a.metrics.Checkpointed()
	k.log.Debug("checkpoint written", zap.Int("step", ck.Step), zap.Int("bytes", len(data)))
	return id, nil
}

// flush waits until every checkpoint offered so far is written (or failed)
// and returns the newest step written and the last write's error.
func (k *checkpointer) flush(ctx context.Context) (int, error) {
	k.mu.Lock()
	idle := k.idle
	k.mu.Unlock()
	select {
	case <-idle:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.step, k.err
}

// count is how many checkpoints were written.
func (k *checkpointer) count() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.written
}

// resumePoint finds the checkpoint c's denoise starts from: the newest of
// its own job's (an earlier attempt was killed, lost its lease, was
// preempted or drained, or the job was rewound), else the forked job's.
// A task that cannot have one costs no etcd read. ok false: start from
// noise.
func (a *Agent) resumePoint(ctx context.Context, c *jobs.Claim) (ck *engine.Checkpoint, id string, err error) {
	t := c.Task
	if t.Attempt > 1 || t.Requeues > 0 || t.Rewinds > 0 {
		recs, err := a.cstore.List(ctx, jobs.CheckpointsOf(t.JobID))
		if err != nil {
			return nil, "", fmt.Errorf("%w: list checkpoints: %v", errTransient, err)
		}
		type cand struct {
			id   string
			step int
		}
		var cands []cand
		for _, r := range recs {
			if n, ok := jobs.CheckpointStep(t.JobID, r.ID); ok && n < t.Spec.Steps {
				cands = append(cands, cand{r.ID, n})
			}
		}
		slices.SortFunc(cands, func(x, y cand) int { return y.step - x.step }) // newest first
		for _, cd := range cands {
			ck, err := a.readCheckpoint(ctx, cd.id)
			if err == nil {
				return ck, cd.id, nil
			}
			// Unreadable (every holder gone): the one before, else from noise.
			a.log.Warn("checkpoint unreadable", zap.String("job", t.JobID), zap.String("checkpoint", cd.id), zap.Error(err))
		}
	}
	if t.Fork != nil {
		ck, err := a.readCheckpoint(ctx, t.Fork.Object)
		if err != nil {
			return nil, "", fmt.Errorf("%w: checkpoint %s of forked job %s: %v", errForkLost, t.Fork.Object, t.Fork.Job, err)
		}
		return ck, t.Fork.Object, nil
	}
	return nil, "", nil
}

// errForkLost: the checkpoint a fork starts from is gone (its job was
// deleted, or the checkpoint's retention passed); the fork fails.
var errForkLost = errors.New("agent: forked checkpoint lost")

func (a *Agent) readCheckpoint(ctx context.Context, id string) (*engine.Checkpoint, error) {
	data, _, err := a.cstore.ReadAll(ctx, id)
	if err != nil {
		return nil, err
	}
	var ck engine.Checkpoint
	if err := ck.UnmarshalBinary(data); err != nil {
		return nil, err
	}
	return &ck, nil
}

// yielder asks a running denoise to stop at a checkpoint (DenoiseCall's
// Stop) instead of being cancelled, so a preemption or a drain loses no
// step. If the sampler has not stopped within yieldGrace (an engine that
// ignores it), the task is cancelled as before.
type yielder struct {
	once  sync.Once
	stop  chan struct{}
	cause atomic.Pointer[error]
}

// yieldGrace bounds how long a stop at a checkpoint may take before the
// task is cancelled instead: a step and a checkpoint's write.
const yieldGrace = 30 * time.Second

func newYielder() *yielder { return &yielder{stop: make(chan struct{})} }

// ask stops the sampler at its next step with cause; cancel is called
// with the same cause if it has not returned by yieldGrace. It reports
// whether this call asked: a stop is asked once, whatever asks again
// while the sampler finishes its step.
func (y *yielder) ask(cause error, cancel context.CancelCauseFunc, done <-chan struct{}) (asked bool) {
	y.once.Do(func() {
		asked = true
		y.cause.Store(&cause)
		close(y.stop)
		go func() {
			t := time.NewTimer(yieldGrace)
			defer t.Stop()
			select {
			case <-t.C:
				cancel(cause)
			case <-done:
			}
		}()
	})
	return asked
}

// why is the cause a stop was asked with, nil if none was.
func (y *yielder) why() error {
	if y == nil {
		return nil
	}
	if p := y.cause.Load(); p != nil {
		return *p
	}
	return nil
}

type yielderKey struct{}

func withYielder(ctx context.Context, y *yielder) context.Context {
	return context.WithValue(ctx, yielderKey{}, y)
}

func yielderOf(ctx context.Context) *yielder {
	y, _ := ctx.Value(yielderKey{}).(*yielder)
	return y
}

// denoiseCall builds c's call to the runner: where it resumes from, when
// it checkpoints (with the checkpointer that writes them, nil when the
// runner cannot), the stop a preemption or drain asks for, and the
// agent's tensor cache.
func (a *Agent) denoiseCall(ctx context.Context, c *jobs.Claim, cond engine.Tensor, dst []byte) (DenoiseCall, *checkpointer, error) {
	call := DenoiseCall{Spec: c.Task.Spec, Cond: cond, Dst: dst, KV: a.kv}
	if ok, _ := a.runner.Checkpoints(c.Task.Spec); !ok {
		return call, nil, nil
	}
	resume, id, err := a.resumePoint(ctx, c)
	if err != nil {
		return call, nil, err
	}
	prev, prevStep := "", 0
	if resume != nil {
		call.Resume = resume
		if step, own := jobs.CheckpointStep(c.Task.JobID, id); own {
			prev, prevStep = id, step // replaced by the next one; a fork's source is another job's
		}
		a.metrics.Resumed()
		a.log.Info("denoise resumes from a checkpoint", zap.String("job", c.Task.JobID), zap.String("checkpoint", id), zap.Int("step", resume.Step))
	}
	ckp := a.newCheckpointer(c, prev, prevStep)
	call.CheckpointEvery = a.checkpointEvery(c.Task)
	call.Checkpoint = ckp.offer
	if y := yielderOf(ctx); y != nil {
		call.Stop = y.stop
	}
	return call, ckp, nil
}

// unusableCheckpoint is what a resume the engine refused (another engine
// version wrote the checkpoint, say) turns into: a fork fails, having
// nothing else to start from; a retry runs again from noise, its own
// checkpoints deleted first so the next attempt does not pick the same one.
func (a *Agent) unusableCheckpoint(c *jobs.Claim, err error) error {
	if c.Task.Fork != nil {
		if _, own := a.ownCheckpoints(c); !own {
			return fmt.Errorf("%w: %v", errForkLost, err)
		}
	}
	a.log.Warn("checkpoint refused by the engine; the denoise starts over", zap.String("job", c.Task.JobID), zap.Error(err))
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	recs, lerr := a.cstore.List(ctx, jobs.CheckpointsOf(c.Task.JobID))
	for _, r := range recs {
		if derr := a.cstore.Delete(ctx, r.ID); derr != nil {
			lerr = errors.Join(lerr, derr)
		}
	}
	return fmt.Errorf("%w: resume refused (%v); checkpoints dropped: %v", errTransient, err, lerr)
}

// ownCheckpoints reports whether c's job has checkpoints of its own (a
// fork's retry resumes from those, not from its source).
func (a *Agent) ownCheckpoints(c *jobs.Claim) (int, bool) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	recs, err := a.cstore.List(ctx, jobs.CheckpointsOf(c.Task.JobID))
	return len(recs), err == nil && len(recs) > 0
}

// ForkPoint reads job id and its checkpoint after step (httpapi.Jobs).
func (a *Agent) ForkPoint(ctx context.Context, id string, step int) (j jobs.Job, from jobs.ForkFrom, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) (err error) {
		j, from, err = a.store.ForkPoint(ctx, id, step)
		return err
	})
	return j, from, err
}
