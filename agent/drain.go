package agent

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// Why a running task's context was cancelled when it is to be given back
// to the queue (jobs.Store.Requeue) rather than retried or dropped.
var (
	errPreempted = errors.New("agent: preempted for interactive work")
	errDrained   = errors.New("agent: requeued by a drain")
)

// runningTasks is the tasks executing on this agent, with the means to
// stop one so that it is requeued. changed is closed and replaced on every
// change, so the preemption loop sleeps instead of polling.
type runningTasks struct {
	mu      sync.Mutex // guards the fields below
	tasks   map[string]*runningTask
	changed chan struct{}
}

type runningTask struct {
	claim     *jobs.Claim
	stop      context.CancelCauseFunc
	handedOff *handoffFlag // committed early: its consumer needs the tail, never stop it for a preemption
	// yield, for a denoise whose engine checkpoints, stops it at a
	// checkpoint instead of cancelling it; done is its context's end.
	yield *yielder
	done  <-chan struct{}
}

func (r *runningTasks) init() {
	r.tasks = map[string]*runningTask{}
	r.changed = make(chan struct{})
}

func (r *runningTasks) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *runningTasks) add(t *runningTask) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tasks[t.claim.Task.ID] = t
	r.notifyLocked()
}

func (r *runningTasks) remove(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.tasks, id)
	r.notifyLocked()
}

// changes returns the channel closed at the next change of the set (a task
// leaves it once its commit, requeue or failure is recorded).
func (r *runningTasks) changes() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.changed
}

// snapshot lists the running tasks of stage st ("" for all) and the
// channel closed at the next change.
func (r *runningTasks) snapshot(st jobs.Stage) ([]*runningTask, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*runningTask, 0, len(r.tasks))
	for _, t := range r.tasks {
		if st == "" || t.claim.Task.Stage == st {
			out = append(out, t)
		}
	}
	return out, r.changed
}

// stop cancels task id with cause, or for a denoise that can stop at a
// checkpoint asks it to; false when it is no longer running, or was asked
// to stop already.
func (r *runningTasks) stop(id string, cause error) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.tasks[id]
	switch {
	case ok && t.yield != nil:
		return t.yield.ask(cause, t.stop, t.done)
	case ok:
		t.stop(cause)
	}
	return ok
}

func candidate(t jobs.Task) routing.Candidate {
	return routing.Candidate{ID: t.ID, Class: t.Class, Enqueued: t.EnqueuedAt, Deadline: t.Deadline, Hint: t.Hint, Preempted: t.PreemptedAt}
}

// batchOnly returns this agent's running tasks of stage st when every one
// is batch work that may be stopped (none has handed off early), and nil
// otherwise: what it may give way with for interactive work.
func (a *Agent) batchOnly(st jobs.Stage) []routing.Candidate {
	tasks, _ := a.running.snapshot(st)
	out := make([]routing.Candidate, 0, len(tasks))
	for _, t := range tasks {
		if t.claim.Task.Class != routing.Batch || t.handedOff.Load() {
			return nil
		}
		c := candidate(t.claim.Task)
		c.Node = a.id
		out = append(out, c)
	}
	return out
}

// preemptLoop watches stage st while every slot is busy with batch work:
// when the queue policy says an interactive task pushed here and waiting
// for a slot has waited long enough (routing.QueuePolicy.Preempt), it
// stops the batch task to give way for it, which its worker requeues
// (jobs.Store.Yield: fenced by the claim, so the task is never lost nor
// committed twice) and which resumes later from its last checkpoint. The
// freed credit then goes to the interactive task. Interactive work that
// waits with no worker free is pushed by its dispatcher to a worker that
// gossip shows running batch work (NodeMeta.Yields, dispatch.go), so
// each worker answers only for the claims pushed to it. It sleeps on task
// starts and ends, its inbox, and the time the answer changes.
func (a *Agent) preemptLoop(st jobs.Stage) {
	credits := a.credits[st]
	for a.pullCtx.Err() == nil {
		changed := a.running.changes() // before the snapshot batchOnly takes
		busy := credits.Free() == 0 || credits.InUse() >= a.runner.Slots(st)
		mine := a.batchOnly(st)
		if !busy || len(mine) == 0 {
			select {
			case <-changed:
			case <-a.pullCtx.Done():
			}
			continue
		}
		q := a.inboxes[st]
		queueChanged := q.Changed() // before the inbox is read
		now := time.Now()
		var pushed []routing.Candidate
		for _, c := range q.Pushed(a.member.Lease()) {
			if !c.Task.NotBefore.After(now) && a.runner.Serves(st, c.Task.Spec.ModelName()) {
				pushed = append(pushed, candidate(c.Task)) // pushed here, waiting for a slot
			}
		}
		victim, wake := a.cfg.Queue.Preempt(pushed, mine, a.id, now)
		if victim != "" && a.running.stop(victim, errPreempted) {
			a.log.Info("preempting a batch task for waiting interactive work", zap.String("stage", string(st)), zap.String("task", victim))
			a.metrics.Preempted()
			a.preempted.Add(1)
			select { // until the victim is gone (requeued)
			case <-changed:
			case <-a.pullCtx.Done():
			}
			continue
		}
		// Wake when a task starts or ends, the queue moves, or the answer
		// changes by the clock.
		a.waitView(queueChanged, changed, nil, wake)
	}
}

// Drain takes this agent out of service without losing work: it stops
// pulling tasks, turns /readyz to 503, lets running tasks finish within
// DrainTimeout and requeues those still running after it (fenced:
// jobs.Store.Requeue; another agent runs them again), then waits, within
// the same deadline, for the outputs it holds peer to peer to be consumed
// so that no job has to start over. The caller then closes the agent,
// which deregisters it. Drain returns when done or ctx ends; a second call
// waits for the first. Drained is closed when it is done.
func (a *Agent) Drain(ctx context.Context) error {
	a.drainOnce.Do(func() {
		a.drainErr = a.drain(ctx)
		close(a.drained)
	})
	select {
	case <-a.drained:
		return a.drainErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Drained is closed once a drain has finished (Drain).
func (a *Agent) Drained() <-chan struct{} { return a.drained }

func (a *Agent) drain(ctx context.Context) error {
	a.draining.Store(true)
	a.log.Info("draining: no new tasks", zap.Duration("timeout", a.cfg.DrainTimeout))
	a.publishMeta() // no free credit: no more hints or pushed claims
	a.stopPull()
	a.workers.Wait() // no claim is made after this
	a.returnAllPushes()
	deadline := time.Now().Add(a.cfg.DrainTimeout)
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	// A denoise whose engine checkpoints is handed over at once: it stops
	// at its next step, checkpoints it and is requeued, and another worker
	// goes on from there (finishing it here could take minutes).
	if n := a.handOverDenoise(); n > 0 {
		a.log.Info("drain: handing running denoise tasks over at a checkpoint", zap.Int("tasks", n))
	}
	if !a.waitRunning(dctx) {
		tasks, _ := a.running.snapshot("")
		a.log.Info("drain deadline: requeuing running tasks", zap.Int("tasks", len(tasks)))
		for _, t := range tasks {
			a.running.stop(t.claim.Task.ID, errDrained)
		}
		// Requeuing is one fenced etcd write per task; the caller's
		// context bounds it.
		if !a.waitRunning(ctx) {
			return ctx.Err()
		}
	}
	// Outputs handed on peer to peer live here until their consumer
	// commits: leaving now would make their jobs start over. Unless no
	// other agent takes the stages after this one's: nobody would consume
	// them before the deadline, and waiting for it only delays the exit (a
	// lone agent of every role waited the whole drain timeout).
	for {
		released := a.releasedSignal() // before the read, so a release in between is not missed
		held, err := a.store.Recorded(dctx, a.id)
		if err == nil && len(held) == 0 {
			break
		}
		if err == nil && !a.othersConsume() {
			a.log.Info("drain: no other agent takes the next stages; leaving now, the jobs of the outputs held here start over", zap.Int("outputs", len(held)))
			break
		}
		if err != nil && dctx.Err() == nil {
			a.log.Warn("drain: reading held outputs", zap.Error(err))
			a.sleepCtx(dctx, a.cfg.RetryBackoff)
			continue
		}
		if dctx.Err() == nil {
			select { // releases arrive by the payloads watch (WatchReleases)
			case <-released:
				continue
			case <-dctx.Done():
			}
		}
		a.log.Warn("drain deadline: leaving with outputs not yet consumed; their jobs start over", zap.Int("outputs", len(held)))
		break
	}
	a.returnAllPushes() // any pushed before the peers saw this agent drain
	a.log.Info("drained")
	return nil
}

// handOverDenoise stops every running denoise that can stop at a
// checkpoint (and has not handed off early: its consumer needs the tail
// from here), for a drain; it returns how many.
func (a *Agent) handOverDenoise() int {
	tasks, _ := a.running.snapshot(jobs.Denoise)
	n := 0
	for _, t := range tasks {
		if t.yield != nil && !t.handedOff.Load() && a.running.stop(t.claim.Task.ID, errDrained) {
			n++
		}
	}
	return n
}

// othersConsume reports whether, as gossip has it, another live agent takes
// work for a stage after one of this agent's roles: someone who could pull
// the outputs this agent holds.
func (a *Agent) othersConsume() bool {
	for _, st := range a.cfg.Roles {
		next, last := st.Next()
		if last {
			continue
		}
		for _, p := range a.member.Peers() {
			if p.Record.ID != a.id && p.Alive && !p.Suspect && slices.Contains(p.Meta.Roles, string(next)) {
				return true
			}
		}
	}
	return false
}

// waitRunning waits until no task runs here; false when ctx ended first.
func (a *Agent) waitRunning(ctx context.Context) bool {
	for {
		tasks, changed := a.running.snapshot("")
		if len(tasks) == 0 {
			return true
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false
		case <-a.ctx.Done():
			return false
		}
	}
}

func (a *Agent) sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
