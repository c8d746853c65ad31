package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
)

// Why a task did not produce output; execute turns each into a store call.
var (
	errInputLost = errors.New("agent: input payload lost with its producer") // -> Rewind
	errTransient = errors.New("agent: transient failure")                    // -> Abandon, retry later
	// errCommit is a commit etcd failed (not refused): transient, but a job
	// that keeps failing it fails with its own code.
	errCommit = fmt.Errorf("%w: commit failed", errTransient)
	// errMaybeCommitted marks an outcome recorded after a commit attempt
	// that got no answer: that attempt may have committed.
	errMaybeCommitted = errors.New("agent: a commit attempt got no answer")
)

// worker is the loop of one stage: wait for a free credit, take the best
// claim pushed to this node (its inbox: by a task's creator or its
// dispatcher, dispatch.go), take the credit, run the task in its own
// goroutine, repeat. It never polls: it sleeps on a freed credit, its
// inbox's watch, or the exact time a held-back task becomes eligible. The credit is
// taken only once a task is claimed, so an idle agent gossips all its
// credits as free; this loop is the ledger's only taker, so a credit seen
// free before the claim is still free after it.
func (a *Agent) worker(st jobs.Stage) {
	credits := a.credits[st]
	hb := a.live.pull[st] // the watchdog's view of this loop (liveness.go)
	for a.pullCtx.Err() == nil {
		hb.Beat()
		freed := credits.Freed() // before Free, so a release in between is not missed
		engineChanged := a.runner.Changed()
		if credits.Free() == 0 || credits.InUse() >= a.runner.Slots(st) {
			// No credit, or the engine's slots are taken (none while no
			// external engine is registered). Claims pushed here meanwhile
			// wait for a slot, or go to a free worker or their dispatcher.
			q := a.inboxes[st]
			pushes := q.Changed()
			var due <-chan time.Time
			timer := (*time.Timer)(nil)
			if next := a.returnPushes(st, q); !next.IsZero() {
				timer = time.NewTimer(time.Until(next))
				due = timer.C
			}
			hb.Wait()
			select {
			case <-freed:
			case <-engineChanged:
			case <-pushes:
				a.publishMeta() // a claim pushed here, or gone: its slot is spoken for, or free
			case <-due:
			case <-a.pullCtx.Done():
			}
			if timer != nil {
				timer.Stop()
			}
			continue
		}
		c, err := a.claimNext(st)
		if err != nil {
			if a.pullCtx.Err() != nil {
				return // draining or closing; a claim made meanwhile is returned, not lost
			}
			a.log.Warn("claim failed", zap.String("stage", string(st)), zap.Error(err))
			a.sleep(a.cfg.RetryBackoff)
			continue
		}
		if err := credits.TryAcquire(); err != nil {
			panic("agent: credit taken by someone else while claiming") // only this loop takes credits
		}
		revoke, slotFreed := a.books[st].Take(c.Task.Dispatcher, time.Now())
		if revoke != "" {
			a.revokeGrant(st, revoke)
		}
		a.publishMeta()
		a.grantQueue(st, c.Task.Dispatcher)
		a.wg.Go(func() {
			var once sync.Once
			workDone := func(ok bool) {
				once.Do(func() {
					slotFreed(time.Now(), ok)
					credits.Release()
					a.publishMeta()
					a.grantFreed(st, c)
				})
			}
			defer workDone(false)
			a.execute(c, workDone)
		})
	}
}

func (a *Agent) publishMeta() {
	if err := a.member.UpdateMeta(a.meta()); err != nil {
		a.log.Warn("meta update", zap.Error(err))
	}
}

func (a *Agent) sleep(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-a.ctx.Done():
	}
}

// claimNext blocks until this node holds a claim on a task of stage st.
// It gives up when the agent stops pulling (a.pullCtx: drain or close).
func (a *Agent) claimNext(st jobs.Stage) (*jobs.Claim, error) {
	hb := a.live.pull[st]
	for {
		hb.Beat()
		if err := a.pullCtx.Err(); err != nil {
			return nil, err
		}
		if a.alarms.NoSpace() != nil {
			// etcd refuses every claim while its database is full: wait for
			// the operator (the alarm watcher logs it; /readyz says it).
			a.sleepCtx(a.pullCtx, a.cfg.AlarmEvery)
			continue
		}
		engineChanged := a.runner.Changed() // before the scan reads what the runner serves
		changed := a.member.LeaseChanged()  // before Lease, so a change in between is not missed
		lease := a.member.Lease()
		if lease == 0 { // re-registering after a lost lease
			hb.Wait()
			select {
			case <-changed:
			case <-a.pullCtx.Done():
			}
			continue
		}
		q := a.inboxes[st]
		inboxChanged := q.Changed() // before the inbox is read, so a change in between is not missed
		if !q.Synced() {
			hb.Wait()
			select { // the inbox's first read is on its way
			case <-inboxChanged:
			case <-a.pullCtx.Done():
			}
			continue
		}
		settled := a.running.changes() // before admit counts the tasks still committing
		ok, down := a.admit(st)
		if !ok {
			// Downstream is full: wait for its queue to move, or for a task
			// of ours to be recorded (a preempted or failed task frees its
			// share without a downstream task). Credits arrive by gossip,
			// which etcd cannot watch, so look again within a second. A
			// claim pushed here meanwhile may go to a worker that can start it.
			wake := earliest(time.Now().Add(time.Second), a.returnPushes(st, q))
			hb.Wait()
			a.waitView(a.fed[down].Changed(), settled, nil, wake)
			continue
		}
		pushed := a.pushedClaims(st, q, lease) // claims made for this agent, to start without a transaction
		now := time.Now()
		var wake time.Time
		cands := make([]routing.Candidate, 0, len(pushed))
		for _, c := range pushed {
			if c.Task.NotBefore.After(now) {
				wake = earliest(wake, c.Task.NotBefore)
				continue
			}
			cands = append(cands, candidate(c.Task))
		}
		ordered, retry := a.cfg.Queue.Order(cands, a.id, now)
		wake = earliest(wake, retry)
		fits := a.roomForOutputs()
		for _, c := range ordered {
			pc := pushed[c.ID]
			if !fits(pc.Task) {
				continue // memory backpressure: its output has nowhere to go yet
			}
			q.Take(pc)
			a.metrics.PushedClaim(st, false)
			a.setBlocked(st, false)
			return pc, nil
		}
		if len(ordered) > 0 {
			// Tasks wait but none fits: say so in gossip (no free credit)
			// and look again as memory frees, which gossip and releases
			// tell, not etcd: within a second. They go to a worker with
			// room after the steal grace (returnPushes).
			a.setBlocked(st, true)
			wake = earliest(wake, time.Now().Add(time.Second))
			wake = earliest(wake, a.returnPushes(st, q))
		}
		var mesh <-chan struct{}
		if len(ordered) == 0 {
			// A free slot and nothing pushed here: tell a dispatcher that
			// has work waiting (a slot freed while admission held the
			// stage back was granted to nobody), and look again when
			// gossip shows another.
			mesh = a.meshChanged.Wait()
			wake = earliest(wake, a.grantIdle(st, "")) // a slot whose owner let it lapse gets another
		}
		// An engine registering (or going) changes which tasks are ours:
		// look again then too, not only when the inbox moves.
		hb.Wait()
		a.waitView(inboxChanged, engineChanged, mesh, wake)
	}
}

// waitView sleeps until a view (an inbox, a ledger) changes, other or more
// is closed (nil: never), the deadline passes (zero: none), or the agent
// stops.
func (a *Agent) waitView(changed, other, more <-chan struct{}, deadline time.Time) {
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-changed:
	case <-other:
	case <-more:
	case <-timeout:
	case <-a.pullCtx.Done():
	}
}

// setBlocked records whether stage st is starved of memory for its outputs
// and gossips the change.
func (a *Agent) setBlocked(st jobs.Stage, b bool) {
	if a.blocked[st].Swap(b) != b {
		if b {
			a.log.Info("no room for this stage's outputs; not claiming until memory frees", zap.String("stage", string(st)))
		}
		a.publishMeta()
	}
}

// outputBytes is what task t will place in this node's arena: the encoded
// conditioning, the latent. A decode's file goes to the Store, where it may
// overflow (putResult), so decode never waits for room.
func (a *Agent) outputBytes(t jobs.Task) int64 {
	var meta transfer.TensorMeta
	var err error
	switch t.Stage {
	case jobs.Encode:
		meta, err = a.runner.CondMeta(t.Spec)
	case jobs.Denoise:
		meta, err = a.runner.LatentMeta(t.Spec)
	default:
		return 0
	}
	if err != nil {
		return 0 // the stage fails with the same error once claimed
	}
	return meta.Bytes()
}

// roomForOutputs returns a check of whether a task's output has room: a
// free block of the arena for the producer's buffer and, when it will be
// relayed, a Store member with room (memory or spill disk) for a copy. The
// arena and the Store are read once, when the check first needs them, not
// once per candidate of a queue scan.
func (a *Agent) roomForOutputs() func(jobs.Task) bool {
	arenaBlock := sync.OnceValue(func() int64 {
		if st := a.xfer.Stats(); st.HasArena {
			return st.Arena.LargestFree
		}
		return math.MaxInt64
	})
	storeRoom := sync.OnceValue(func() int64 { _, largest := a.storeRoom(); return largest })
	return func(t jobs.Task) bool {
		n := a.outputBytes(t)
		switch {
		case n == 0:
			return true
		case arenaBlock() < n:
			return false
		case a.transferMode(t) == jobs.StoreRelay:
			return storeRoom() >= n
		}
		return true
	}
}

func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// execute runs a claimed task and records the outcome in etcd.
//
// workDone gives the task's credit back: execute calls it once the stage's
// work is done (ok: it ran to its end), before writing the outcome to etcd. A credit is a slot of
// the GPU, which a commit does not need; the next task's claim and pull
// then overlap this one's commit. Until execute returns, the task counts
// as running for admission (a.committing).
func (a *Agent) execute(c *jobs.Claim, workDone func(ok bool)) {
	st := c.Task.Stage
	log := a.log.With(zap.String("job", c.Task.JobID), zap.String("stage", string(st)), zap.Int("attempt", c.Task.Attempt))
	// The task starts here (a pushed claim was made with the task, maybe
	// long before). fed_rev, a revision at which the next stage held no
	// more of this agent's outputs than admission counted, places the
	// start in etcd's order: no later than it happened, and not before the
	// count admission went by (TestBackpressureManyProducers counts the
	// backlog by it).
	log.Debug("task started", zap.Int64("claim_rev", c.Rev), zap.Bool("pushed", c.Pushed), zap.Int64("fed_rev", a.fedSeen(st)))
	a.recent.note(c.Task.JobID)
	defer a.untrack(c)
	defer a.inboxes[st].Done(c)
	var handedOff handoffFlag // set once an early handoff committed the stage
	var ran atomic.Bool       // set once run returned: no work is left to stop
	ctx, stop := a.watchCancel(c, &handedOff, &ran)
	defer stop()
	// Until it is recorded, preemption and drain may stop it (with a cause
	// that makes it a requeue).
	defer func() {
		a.running.remove(c.Task.ID)
		a.publishMeta() // NodeMeta.Yields follows what runs
	}()
	start := time.Now()
	var staged []*cache.Staged // Store objects the task staged; their records come with its commit
	var pulled pullTime
	var via pullVia      // the transports that carried the input, for the stage record
	var first firstFrame // a video's first preview, for metrics
	a.metrics.ObserveQueueWait(st, c.Task.Class, start.Sub(c.Task.EnqueuedAt))
	out, published, committed, err := a.run(withFirstFrame(withPullTime(transfer.WithPullObserver(ctx, via.add), &pulled), &first), c, &handedOff, &staged)
	ran.Store(true)
	out.Work, out.Pull, out.Transport = time.Since(start), time.Duration(pulled.Load()), via.String(c.Task.Inputs)
	// Counted as committing from before the credit goes back (admission
	// never counts the task out) until its output is in this agent's
	// ledger (commit), never in both: counted twice, a producer held
	// itself back after each commit, and gossip showed it full to the
	// producer about to push to it.
	uncount := a.countCommitting(st)
	defer uncount()
	workDone(err == nil) // a task stopped early says nothing of how long one takes

	release := func() {
		for _, id := range published {
			a.release(id)
		}
		a.abort(staged)
	}
	if committed {
		// Early handoff: the commit already happened inside run.
		switch {
		case err == nil:
			a.metrics.ObserveStage(st, c.Task.Class, out.Work)
			log.Info("stage committed early", zap.Duration("took", out.Work))
		case errors.Is(err, errMaybeCommitted):
			// Refused after an attempt whose answer was lost, and etcd
			// could not say whether that attempt took effect.
			log.Warn("early commit refused after a retry; output discarded unless an earlier attempt committed it", zap.Error(err))
			a.releaseUncommitted(published, err)
			a.abort(staged)
		case errors.Is(err, jobs.ErrFenced), errors.Is(err, jobs.ErrFinished):
			log.Warn("early commit refused; output discarded", zap.Error(err))
			release()
		default:
			log.Error("stage failed after early handoff", zap.Error(err))
			release()
		}
		return
	}
	var uncertain bool // a commit attempt got no answer: it may have taken effect
	if err == nil {
		uncertain, err = a.commit(ctx, c, out, false, uncount, log)
		lost := errors.Is(err, jobs.ErrFenced) || (ctx.Err() != nil && a.member.Lease() != c.Lease)
		if err != nil && lost && a.ctx.Err() == nil {
			// The claim went with the lease while the finished output
			// waited for etcd (an etcd majority frozen and thawed expires
			// leases as it resumes; only the claim's lease or its holder
			// deletes a claim): take the task back if nobody has since,
			// and commit it.
			if c2 := a.reclaim(c, log); c2 != nil {
				ctx2, stop2 := a.watchCancel(c2, &handedOff, &ran)
				defer stop2()
				var u2 bool
				u2, err = a.commit(ctx2, c2, out, true, uncount, log)
				c, ctx, uncertain = c2, ctx2, uncertain || u2
			}
		}
		switch {
		case err == nil:
			a.metrics.ObserveStage(st, c.Task.Class, out.Work)
			if st == jobs.Decode {
				a.metrics.JobFinished(jobs.Succeeded)
				a.observeJob(c, &first)
			}
			log.Info("stage committed", zap.Duration("took", out.Work))
			return
		case (errors.Is(err, jobs.ErrFenced) || errors.Is(err, jobs.ErrFinished)) && uncertain:
			// An attempt whose answer was lost may have committed after
			// all: its payloads then belong to the next stage.
			log.Warn("commit refused after a retry; output discarded unless an earlier attempt committed it", zap.Error(err))
			a.releaseUncommitted(published, err)
			a.abort(staged)
			return
		case errors.Is(err, jobs.ErrFenced), errors.Is(err, jobs.ErrFinished):
			// Lost the claim or the job was cancelled: the output is nobody's.
			log.Warn("commit refused; output discarded", zap.Error(err))
			release()
			return
		}
		// etcd refused or failed the write (unreachable, request too large):
		// retry like any transient failure, so the claim is not left behind.
		// Staged copies gone before a late commit are transient too: the
		// stage runs again and stages new ones.
		if !errors.Is(err, errTransient) {
			err = fmt.Errorf("%w: %v", errCommit, err)
		}
	}
	if a.ctx.Err() != nil {
		// Shutting down: the lease is revoked on Close and another agent takes over.
		release()
		return
	}
	tries := c.Task.Attempt - c.Task.Requeues // requeues are no failures
	var record func() error
	cause, stopped := context.Cause(ctx), false
	if errors.Is(err, engine.ErrStopped) {
		// Stopped at a checkpoint, as a preemption or a drain asked.
		cause, stopped = yielderOf(ctx).why(), true
	}
	switch {
	case (ctx.Err() != nil || stopped) && errors.Is(cause, errPreempted):
		// Preempted: back to the queue at once, dated, to start over on
		// its next claim.
		log.Info("task requeued", zap.NamedError("why", cause))
		a.metrics.Requeued(st, reasonPreempted)
		record = a.givingBack(c, func() error { return a.store.Yield(a.ctx, c) })
	case (ctx.Err() != nil || stopped) && errors.Is(cause, errDrained):
		log.Info("task requeued", zap.NamedError("why", cause))
		a.metrics.Requeued(st, reasonDrained)
		record = a.givingBack(c, func() error { return a.store.Requeue(a.ctx, c) })
	case ctx.Err() != nil:
		// Cancelled job or lost lease: give the claim up if it is still ours.
		record = func() error { return a.store.Drop(a.ctx, c) }
	case errors.Is(err, errInputLost):
		log.Warn("input lost; restarting job from encode", zap.Error(err))
		reason := err.Error()
		a.metrics.Rewound(st, a.rewindReason(c, err))
		record = func() error {
			err := a.store.Rewind(a.ctx, c, reason)
			if err == nil && c.Next.Key != "" {
				a.fed[jobs.Encode].Created(c.Next) // this agent dispatches the new encode
			}
			return err
		}
	case errors.Is(err, errTransient) && tries < a.cfg.TransientRetries:
		backoff := a.cfg.RetryBackoff << (max(tries, 1) - 1)
		log.Warn("task failed; will retry", zap.Duration("backoff", backoff), zap.Error(err))
		a.metrics.Requeued(st, reasonRetry)
		record = a.givingBack(c, func() error { return a.store.Abandon(a.ctx, c, backoff) })
	default:
		code := "engine_error"
		switch {
		case errors.Is(err, errForkLost):
			code = "checkpoint_lost"
		case errors.Is(err, errAdapterGone):
			code = "adapter_unavailable"
		case errors.Is(err, errCommit):
			code = "commit_failed"
		case errors.Is(err, errTransient):
			code = "transfer_failed"
		}
		log.Error("task failed; failing job", zap.Error(err))
		msg := err.Error()
		record = func() error {
			err := a.store.Fail(a.ctx, c, code, msg)
			if err == nil {
				a.metrics.JobFinished(jobs.Failed)
			}
			return err
		}
	}
	// The outcome must reach etcd, or the claim sits there for as long as
	// this agent's lease lives: keep trying while etcd fails. The writes are
	// fenced by the claim, so retrying is safe.
	backoff := a.cfg.RetryBackoff
	for {
		err := record()
		if err == nil || errors.Is(err, jobs.ErrFenced) || errors.Is(err, jobs.ErrFinished) {
			if err == nil && uncertain {
				err = errMaybeCommitted // keep the payloads a lost commit may have handed on
			}
			a.releaseUncommitted(published, err)
			a.abort(staged)
			return
		}
		if a.ctx.Err() != nil {
			return // the lease is revoked on Close, which frees the claim
		}
		log.Warn("recording task failure; retrying", zap.Duration("backoff", backoff), zap.Error(err))
		a.sleep(backoff)
		backoff = min(2*backoff, 5*time.Second)
	}
}

// commit commits a finished stage. While etcd does not answer (or is full)
// it keeps the output and retries the fenced commit with backoff, for as
// long as the claim may still be valid: it stops when ctx (the task's) ends,
// on a cancelled job or a changed lease, and etcd itself refuses the commit
// (ErrFenced) once the claim's lease has expired. Rerunning the stage
// instead would throw away finished GPU work over an etcd hiccup. Each
// attempt runs under the agent's context, not the task's, so that a cancel
// never cuts one off halfway: its outcome is always known from its answer.
// uncertain reports that some attempt got no answer, so it may have taken
// effect even if the returned error says otherwise. waited says the output
// has already waited for etcd (a reclaimed task): its staged Store copies
// are confirmed before the first attempt, as before every retry. counted
// (nil: none) is called once the commit's output is in the ledger, so the
// task stops counting as committing (countCommitting).
func (a *Agent) commit(ctx context.Context, c *jobs.Claim, out jobs.Output, waited bool, counted func(), log *zap.Logger) (uncertain bool, err error) {
	if next, last := c.Task.Stage.Next(); !last && out.Push == nil {
		// The next stage's worker is chosen now, not when the stage began
		// (a video's denoise takes minutes): one free now gets the task
		// with its claim.
		if hint, push := a.pushTarget(next, c.Task.Spec); push != nil {
			out.Hint, out.Push = hint, push
			out.Payloads = a.issueTickets(out.Payloads, hint)
		}
	}
	a.fixOutput(c, &out)
	defer func() {
		a.committedOutput(c, err)
		if err == nil && counted != nil {
			counted() // the output is in the ledger now
		}
	}()
	backoff := a.cfg.RetryBackoff
	for attempt := 1; ; attempt++ {
		if attempt > 1 || waited {
			// The staged copies have waited for this commit (etcd did not
			// answer, or the task was reclaimed after its lease went):
			// commit only those that still exist, and keep them.
			if err := keepStaged(a.ctx, out.Records, a.cfg.EtcdTimeout); err != nil {
				return uncertain, fmt.Errorf("%w: %v", errTransient, err)
			}
		}
		actx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
		err = a.store.Commit(actx, c, out)
		cancel()
		a.commitRejected(c.Task.Stage, err)

		if err == nil || a.ctx.Err() != nil {
			return uncertain, err
		}
		if !errors.Is(err, context.DeadlineExceeded) && !jobs.IsUnavailable(err) && !jobs.IsNoSpace(err) {
			return uncertain, err // refused (fenced, finished, too large): retrying cannot help
		}
		uncertain = uncertain || !jobs.IsNoSpace(err) // a NOSPACE refusal is an answer
		a.alarms.Observe(err)
		log.Warn("commit failed; keeping the output and retrying", zap.Int("commit_try", attempt), zap.Duration("backoff", backoff), zap.Error(err))
		if !a.waitKeeping(ctx, backoff, out.Records) {
			return uncertain, err
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// waitKeeping waits d, or until ctx ends (false), and meanwhile confirms
// the staged copies of recs every third of the Store's stage timeout, so
// that their holders do not drop them while the commit waits for etcd.
func (a *Agent) waitKeeping(ctx context.Context, d time.Duration, recs []jobs.StagedRecord) bool {
	every := max(a.cfg.Store.StageTimeout/3, 10*time.Millisecond)
	deadline := time.Now().Add(d)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return true
		}
		t := time.NewTimer(min(left, every))
		select {
		case <-ctx.Done():
			t.Stop()
			return false
		case <-t.C:
		}
		if len(recs) > 0 && time.Until(deadline) > 0 {
			// An error here is met again by the check before the next attempt.
			keepStaged(a.ctx, recs, a.cfg.EtcdTimeout)
		}
	}
}

// keeper is a staged record whose copies can be confirmed before a late
// commit (*cache.Staged).
type keeper interface {
	Keep(ctx context.Context) error
}

// keepStaged confirms the copies of every staged record of a commit that
// waited, each under timeout (see cache.Staged.Keep).
func keepStaged(ctx context.Context, recs []jobs.StagedRecord, timeout time.Duration) error {
	for _, r := range recs {
		k, ok := r.(keeper)
		if !ok {
			continue
		}
		kctx, cancel := context.WithTimeout(ctx, timeout)
		err := k.Keep(kctx)
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

// reclaim takes c's task back under this node's lease, for a finished
// output whose claim went with the lease it was made under
// (jobs.Store.Reclaim says when that is safe). A commit refused as fenced
// can come before this node learns that its lease is gone: a reclaim under
// the old lease then fails as "lease not found", and it waits for the new
// one. It retries while etcd does not answer; nil means the task is no
// longer this node's to commit.
func (a *Agent) reclaim(c *jobs.Claim, log *zap.Logger) *jobs.Claim {
	backoff := a.cfg.RetryBackoff
	for a.ctx.Err() == nil {
		changed := a.member.LeaseChanged() // before Lease, so a change in between is not missed
		lease := a.member.Lease()
		if lease == 0 { // registering again: waiting for etcd
			select {
			case <-changed:
			case <-a.ctx.Done():
			}
			continue
		}
		ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
		c2, err := a.store.Reclaim(ctx, c, lease)
		cancel()
		switch {
		case err == nil:
			log.Info("claim lost with the output finished; task reclaimed", zap.Int64("lease", int64(lease)))
			return c2
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			select { // this node has yet to notice that its lease is gone
			case <-changed:
			case <-a.ctx.Done():
			}
		case errors.Is(err, context.DeadlineExceeded), jobs.IsUnavailable(err):
			log.Warn("reclaim failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
			a.sleep(backoff)
			backoff = min(2*backoff, 5*time.Second)
		default:
			log.Warn("claim lost with the output finished; the task is no longer this node's", zap.Error(err))
			return nil
		}
	}
	return nil
}

// abort drops the copies of Store objects a task staged but did not commit.
// A holder keeps a copy whose record exists after all (a commit whose reply
// was lost), so this is safe whatever the commit's outcome.
func (a *Agent) abort(staged []*cache.Staged) {
	for _, st := range staged {
		st.Abort(a.ctx)
	}
}

// releaseUncommitted frees the payloads a failed task published. When the
// outcome could not be recorded because the claim was gone (recordErr is
// ErrFenced or ErrFinished), a commit whose reply was lost may have taken
// effect after all: a payload with a record belongs to the next stage now.
func (a *Agent) releaseUncommitted(published []string, recordErr error) {
	for _, id := range published {
		if recordErr != nil {
			if ok, err := a.store.PayloadRecorded(a.ctx, a.id, id); err != nil || ok {
				continue // committed, or unknown: the record's deletion will release it
			}
		}
		a.release(id)
	}
}

// handoffFlag is set once an early handoff committed a denoise, and says
// so on a channel too. The zero value is unset.
type handoffFlag struct {
	mu sync.Mutex
	ch chan struct{} // closed once set; made on first use
}

func (h *handoffFlag) done() chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ch == nil {
		h.ch = make(chan struct{})
	}
	return h.ch
}

// Load reports whether the flag is set.
func (h *handoffFlag) Load() bool {
	select {
	case <-h.done():
		return true
	default:
		return false
	}
}

// Store sets the flag (true; false is a no-op).
func (h *handoffFlag) Store(v bool) {
	if !v {
		return
	}
	ch := h.done()
	h.mu.Lock() // two Stores must not both close it
	defer h.mu.Unlock()
	select {
	case <-ch:
	default:
		close(ch)
	}
}

// Done is closed once the flag is set.
func (h *handoffFlag) Done() <-chan struct{} { return h.done() }

// watchCancel returns a context for running c that ends when the task can
// no longer commit, so its worker is freed at once instead of after the
// stage: the job was cancelled, or this agent's lease changed (the claim
// lived on the old one and another worker may already hold the task). It
// also ends when the agent stops. stop ends the watching. Once ran is set
// the work is done and a cancel is the commit's to find (it is fenced on
// the job record), so the task leaving the queue costs no read.
func (a *Agent) watchCancel(c *jobs.Claim, handedOff *handoffFlag, ran *atomic.Bool) (ctx context.Context, stop func()) {
	ctx, cancelCause := context.WithCancelCause(a.ctx)
	cancel := func() { cancelCause(nil) }
	rt := &runningTask{claim: c, stop: cancelCause, handedOff: handedOff, done: ctx.Done()}
	if ok, _ := a.runner.Checkpoints(c.Task.Spec); ok && c.Task.Stage == jobs.Denoise {
		// A preemption or a drain stops it at a checkpoint.
		rt.yield = newYielder()
		ctx = withYielder(ctx, rt.yield)
	}
	a.running.add(rt)
	a.publishMeta() // whether this node yields batch work (NodeMeta.Yields) follows what runs
	var wg sync.WaitGroup
	wg.Go(func() {
		// A cancel marks the task's claim cancelled even while it runs,
		// and this agent's inbox sees that: no watch of its own per task.
		// After an early handoff the claim is committed and gone: a
		// cancel from then on shows only in the job record.
		gone, forget := a.inboxes[c.Task.Stage].TaskGone(c.Task.ID)
		defer forget()
		select {
		case <-gone:
		case <-handedOff.Done():
		case <-ctx.Done():
			return
		}
		if ran.Load() {
			return
		}
		if !handedOff.Load() {
			j, err := a.store.Get(ctx, c.Task.JobID)
			if errors.Is(err, jobs.ErrNotFound) || (err == nil && j.State == jobs.Cancelled) {
				a.log.Info("job cancelled; stopping its task", zap.String("job", c.Task.JobID))
				cancel()
			}
			return // else its claim went with a lease: the lease watch below stops it
		}
		// An early handoff committed the denoise while its sampler
		// finishes the tail for the decoder.
		if j, err := a.store.Wait(ctx, c.Task.JobID); err == nil && j.State == jobs.Cancelled {
			a.log.Info("job cancelled; stopping the denoise tail", zap.String("job", c.Task.JobID))
			cancel()
		}
	})
	wg.Go(func() {
		for {
			changed := a.member.LeaseChanged()
			if a.member.Lease() != c.Lease && !handedOff.Load() {
				// (After an early handoff the claim is committed and gone; the
				// denoiser finishes the tail its consumer is waiting for.)
				a.log.Warn("lease changed; stopping a task claimed under the old one", zap.String("job", c.Task.JobID))
				cancel()
				return
			}
			select {
			case <-changed:
			case <-ctx.Done():
				return
			}
		}
	})
	return ctx, func() {
		cancel()
		wg.Wait()
	}
}

// run does the stage's work: pull inputs, call the engine, publish outputs.
// published lists payloads this call published, for release on failure.
// committed reports that run already committed the stage itself (early
// handoff); err is then about the work after the commit.
// staged collects the Store objects run staged, for the caller to abort
// when the stage does not commit.
func (a *Agent) run(ctx context.Context, c *jobs.Claim, handedOff *handoffFlag, staged *[]*cache.Staged) (out jobs.Output, published []string, committed bool, err error) {
	ctx = withClaim(ctx, c) // the claim gets this worker the tickets for its inputs
	spec := c.Task.Spec
	switch c.Task.Stage {
	case jobs.Encode:
		if out, ok, err := a.encodeCached(ctx, c); ok {
			return out, nil, false, err
		}
		meta, err := a.runner.CondMeta(spec)
		if err != nil {
			return out, nil, false, err
		}
		p, ref, err := a.begin(c, meta)
		if err != nil {
			return out, nil, false, fmt.Errorf("%w: publish: %v", errTransient, err)
		}
		defer p.Done() // on every path: the buffer is not written after this
		if err := a.runner.Encode(ctx, spec, p.Buf()); err != nil {
			a.release(ref.ID)
			return out, nil, false, err
		}
		if err := p.ChunkReady(0); err != nil {
			a.release(ref.ID)
			return out, nil, false, err
		}
		hint := a.pickHint(jobs.Denoise, spec)
		if a.handoff(c.Task, hint, ref.Meta.Bytes()) == routing.HandoffStore {
			return a.relayOutput(ctx, c, ref, hint, staged)
		}
		out, err = a.output(c, ref, hint)
		return out, []string{ref.ID}, false, err
	case jobs.Denoise:
		return a.denoise(ctx, c, handedOff, staged)
	case jobs.Decode:
		file, ctype, err := a.decode(ctx, c)
		if err != nil {
			return out, nil, false, err
		}
		st, res, err := a.putResult(ctx, c, file, ctype)
		if err != nil {
			return out, nil, false, err
		}
		*staged = append(*staged, st)
		out.Result, out.Records = res, []jobs.StagedRecord{st}
		return out, nil, false, nil
	}
	return out, nil, false, fmt.Errorf("agent: unknown stage %q", c.Task.Stage)
}

// relayOutput hands a finished payload on through the Store. When the
// Store has no room and the job did not insist on a relay, the payload goes
// peer to peer instead; otherwise the task retries later.
func (a *Agent) relayOutput(ctx context.Context, c *jobs.Claim, ref transfer.Ref, hint string, staged *[]*cache.Staged) (jobs.Output, []string, bool, error) {
	out, st, err := a.relay(ctx, c, ref, hint)
	if err == nil {
		*staged = append(*staged, st)
		return out, nil, false, nil
	}
	if ctx.Err() != nil {
		a.release(ref.ID)
		return out, nil, false, ctx.Err()
	}
	if a.transferMode(c.Task) == jobs.StoreRelay {
		a.release(ref.ID)
		return out, nil, false, fmt.Errorf("%w: relay through the Store: %v", errTransient, err)
	}
	a.log.Debug("store relay failed; handing off peer to peer", zap.String("job", c.Task.JobID), zap.Error(err))
	out, err = a.output(c, ref, hint)
	return out, []string{ref.ID}, false, err
}

// begin publishes a payload for c to write, noting it as in flight until
// c's task ends (it has no record before its commit; see resyncHeld).
func (a *Agent) begin(c *jobs.Claim, meta transfer.TensorMeta) (*transfer.Pending, transfer.Ref, error) {
	a.inflightMu.Lock()
	defer a.inflightMu.Unlock()
	p, ref, err := a.xfer.Begin(meta)
	if err == nil {
		a.inflight[ref.ID] = c.Task.ID
	}
	return p, ref, err
}

// untrack forgets the in-flight payloads of c's task.
func (a *Agent) untrack(c *jobs.Claim) {
	a.inflightMu.Lock()
	defer a.inflightMu.Unlock()
	for id, task := range a.inflight {
		if task == c.Task.ID {
			delete(a.inflight, id)
		}
	}
}

// output is the commit record of a stage that produced payload ref, handed
// on peer to peer, with hint the next stage's preferred worker.
func (a *Agent) output(c *jobs.Claim, ref transfer.Ref, hint string) (jobs.Output, error) {
	raw, err := json.Marshal(ref)
	if err != nil {
		return jobs.Output{}, err
	}
	a.markStageOutput(ref.ID) // from now on only the claim holder of its consumer gets a ticket
	return jobs.Output{Payloads: []jobs.Input{{Payload: ref.ID, Node: a.id, Ref: raw}}, Hint: hint}, nil
}

// denoise runs the sampler with the latent written straight into a
// published, chunked payload. With early handoff (a video with more than
// one chunk) the stage commits as soon as frame chunk 0 is final, so the
// decode stage starts pulling and decoding while the denoiser finishes the
// remaining frames; if the denoiser then fails, it releases the payload and
// the consumer's pull fails with "not found", which rewinds the job.
func (a *Agent) denoise(ctx context.Context, c *jobs.Claim, handedOff *handoffFlag, staged *[]*cache.Staged) (out jobs.Output, published []string, committed bool, err error) {
	spec := c.Task.Spec
	if err := a.runAdapter(spec); err != nil {
		return out, nil, false, err
	}
	pull := a.pull
	if len(c.Task.Inputs) > 1 { // a prompt's and a negative prompt's cache entries
		pull = func(ctx context.Context, ins []jobs.Input) (engine.Tensor, func(), error) {
			return a.pullCond(ctx, spec, ins)
		}
	}
	cond, releaseCond, err := pull(ctx, c.Task.Inputs)
	if err != nil {
		return out, nil, false, err
	}
	defer releaseCond()
	meta, err := a.runner.LatentMeta(spec)
	if err != nil {
		return out, nil, false, err
	}
	// Decided before the sampler runs: a relay copies the whole latent into
	// the Store, so it hands off after the last step, never early.
	hint := a.pickHint(jobs.Decode, spec)
	relay := a.handoff(c.Task, hint, meta.Bytes()) == routing.HandoffStore
	p, ref, err := a.begin(c, meta)
	if err != nil {
		return out, nil, false, fmt.Errorf("%w: publish: %v", errTransient, err)
	}
	// Until Done the region stays ours even if the payload is released
	// under us (a cancel after an early handoff), so the sampler's last
	// writes never land in memory handed to another payload.
	defer p.Done()
	report, endProgress := a.board.Start(c.Task.JobID, string(jobs.Denoise), spec.Steps)
	defer endProgress()
	call, ckp, err := a.denoiseCall(ctx, c, cond, p.Buf())
	if err != nil {
		a.release(ref.ID)
		return out, nil, false, err
	}
	if call.Resume != nil {
		out.ResumedFrom = call.Resume.Step
		report(call.Resume.Step, spec.Steps)
	}
	finish := func(err error) error { // what the sampler's end leaves to do for its checkpoints
		if ckp == nil {
			return err
		}
		if !errors.Is(err, engine.ErrStopped) {
			// A checkpoint still being written is waited for, so the stage
			// record counts it, and never outlives the commit that releases
			// it (a late write would be refused: the commit ends the claim).
			fctx, cancel := context.WithTimeout(a.ctx, 4*a.cfg.EtcdTimeout)
			defer cancel()
			ckp.flush(fctx)
			out.Checkpoints = ckp.count()
			return err
		}
		// Stopped at a checkpoint for a preemption or a drain: the task is
		// requeued once the checkpoint is recorded, so the next worker
		// starts from it.
		fctx, cancel := context.WithTimeout(a.ctx, 4*a.cfg.EtcdTimeout)
		defer cancel()
		step, ferr := ckp.flush(fctx)
		out.Checkpoints = ckp.count()
		a.log.Info("denoise stopped at a checkpoint", zap.String("job", c.Task.JobID), zap.Int("step", step), zap.NamedError("write", ferr))
		return err
	}
	if relay {
		call.Progress = report
		call.ChunkDone = func(k int) {
			if err := p.ChunkReady(k); err != nil {
				a.log.Error("chunk ready", zap.Int("chunk", k), zap.Error(err))
			}
		}
		err := finish(a.runner.Denoise(ctx, call))
		if call.Resume != nil && errors.Is(err, engine.ErrBadCheckpoint) {
			err = a.unusableCheckpoint(c, err)
		}
		if err != nil {
			a.release(ref.ID)
			return out, nil, false, err
		}
		o, pub, committed, err := a.relayOutput(ctx, c, ref, hint, staged)
		o.ResumedFrom, o.Checkpoints = out.ResumedFrom, out.Checkpoints
		return o, pub, committed, err
	}
	published = []string{ref.ID}
	resumed := out.ResumedFrom
	if out, err = a.output(c, ref, hint); err != nil {
		return out, published, false, err
	}
	out.ResumedFrom = resumed
	early := a.cfg.EarlyHandoff && meta.Chunks() > 1
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var commitErr chan error // set once the early commit is under way
	chunkDone := func(k int) {
		if err := p.ChunkReady(k); err != nil {
			a.log.Error("chunk ready", zap.Int("chunk", k), zap.Error(err))
			cancel()
			return
		}
		if k == 0 && early {
			commitErr = make(chan error, 1)
			start := time.Now()
			o := out // copied here: finish writes out once the sampler returns
			go func() {
				o.Work = time.Since(c.StartedAt)
				if ckp != nil {
					o.Checkpoints = ckp.count()
				}
				err := a.earlyCommit(ctx, c, o, ref.ID)
				if err == nil {
					handedOff.Store(true)
				} else {
					cancel() // nobody will consume the rest
				}
				a.log.Debug("early handoff", zap.String("job", c.Task.JobID), zap.Duration("commit", time.Since(start)), zap.Error(err))
				commitErr <- err
			}()
		}
	}
	call.Progress = func(step, total int) {
		if commitErr == nil { // after the handoff the job's progress is the decoder's
			report(step, total)
		}
	}
	call.ChunkDone = chunkDone
	if call.Checkpoint != nil {
		offer := call.Checkpoint
		call.Checkpoint = func(ck engine.Checkpoint) {
			if commitErr == nil { // handed off: the stage is committed, nothing resumes it
				offer(ck)
			}
		}
	}
	err = finish(a.runner.Denoise(dctx, call))
	if call.Resume != nil && errors.Is(err, engine.ErrBadCheckpoint) {
		err = a.unusableCheckpoint(c, err)
	}
	if commitErr == nil {
		return out, published, false, err
	}
	// The stage was handed off early: the commit's outcome decides.
	if cerr := <-commitErr; cerr != nil {
		if errors.Is(cerr, jobs.ErrFenced) || errors.Is(cerr, jobs.ErrFinished) {
			return out, published, true, cerr
		}
		// Not committed (refused, or stopped retrying by a cancel or a
		// lost lease): the task is retried or dropped, in a write fenced
		// by the claim, which a commit that did take effect deleted.
		return out, published, false, fmt.Errorf("%w: early commit: %v", errTransient, cerr)
	}
	if err != nil {
		// Committed, but the tail never came: drop the payload so its
		// consumer fails fast and rewinds the job.
		a.release(ref.ID)
		return out, nil, true, err
	}
	return out, nil, true, nil
}

// earlyCommit commits a denoise stage handed off early, as commit does a
// finished stage: while etcd does not answer it keeps the payload (the
// sampler goes on writing its tail meanwhile) and retries. When a retry is
// refused after an attempt got no answer, the payload's record says whether
// that attempt took effect: the commit writes it, and only the consumer's
// commit (which needs the tail) or a cancel deletes it. An error that
// leaves this undecided wraps errMaybeCommitted.
func (a *Agent) earlyCommit(ctx context.Context, c *jobs.Claim, out jobs.Output, payload string) error {
	log := a.log.With(zap.String("job", c.Task.JobID), zap.String("stage", string(c.Task.Stage)), zap.Int("attempt", c.Task.Attempt), zap.Bool("early", true))
	uncertain, err := a.commit(ctx, c, out, false, nil, log)
	if err == nil || !uncertain || !(errors.Is(err, jobs.ErrFenced) || errors.Is(err, jobs.ErrFinished)) {
		return err
	}
	rctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	recorded, rerr := a.store.PayloadRecorded(rctx, a.id, payload)
	switch {
	case rerr != nil:
		return fmt.Errorf("%w: %w (and reading the payload record: %v)", errMaybeCommitted, err, rerr)
	case recorded:
		log.Info("an early commit attempt that got no answer had committed")
		return nil
	}
	return err
}

// input decodes a task's single input reference.
func input(ins []jobs.Input) (jobs.Input, transfer.Ref, error) {
	var ref transfer.Ref
	if len(ins) != 1 {
		return jobs.Input{}, ref, fmt.Errorf("%w: task has %d inputs, want 1", errInputLost, len(ins))
	}
	if err := json.Unmarshal(ins[0].Ref, &ref); err != nil {
		return ins[0], ref, fmt.Errorf("%w: undecodable payload ref %s: %v", errInputLost, ins[0].Payload, err)
	}
	return ins[0], ref, nil
}

// pull fetches a task's input payload from its producer into a buffer of
// this agent's arena; call release when done with the tensor.
func (a *Agent) pull(ctx context.Context, ins []jobs.Input) (t engine.Tensor, release func(), err error) {
	defer addPullTime(ctx, time.Now())
	in, refs, err := a.inputRefs(ctx, ins)
	if err != nil {
		return engine.Tensor{}, nil, err
	}
	meta := refs[0].Meta
	if err := meta.Validate(a.cfg.Transfer.MaxPayloadBytes); err != nil {
		return engine.Tensor{}, nil, fmt.Errorf("%w: payload meta: %v", errInputLost, err)
	}
	dst, release := a.buffer(meta.Bytes())
	if err := a.pullFrom(ctx, in, refs, dst); err != nil {
		release()
		return engine.Tensor{}, nil, err
	}
	return engine.Tensor{Meta: meta, Data: dst}, release, nil
}

// pullFrom pulls input in into dst from the first of refs that answers (a
// Store object's replicas, nearest first).
func (a *Agent) pullFrom(ctx context.Context, in jobs.Input, refs []transfer.Ref, dst []byte) error {
	var err error
	for _, ref := range refs {
		if err = a.xfer.PullInto(ctx, ref, dst); err == nil {
			return nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	return a.pullFailed(ctx, in, err)
}

// buffer returns n bytes for a pull to land in: arena memory when the arena
// has room (transfers write straight into it), else the heap, which every
// transport also accepts.
func (a *Agent) buffer(n int64) ([]byte, func()) {
	b, err := a.xfer.Alloc(n)
	if err != nil {
		a.heapPulls.Add(1)
		a.log.Debug("pull into heap", zap.Int64("bytes", n), zap.Error(err))
		return make([]byte, n), func() {}
	}
	return b.Bytes(), b.Release
}

// decode pulls the latent chunk by chunk and decodes each chunk's frames as
// it lands, so a video's first frames are decoded while the rest is in
// flight; each decoded video frame is published as a preview for clients
// streaming the job.
func (a *Agent) decode(ctx context.Context, c *jobs.Claim) ([]byte, string, error) {
	start := time.Now()
	spec := c.Task.Spec
	in, refs, err := a.inputRefs(ctx, c.Task.Inputs)
	if err != nil {
		return nil, "", err
	}
	fd, closeFd, err := a.newDecoder(spec, c.Task.JobID)
	if err != nil {
		return nil, "", err
	}
	defer closeFd()
	meta := refs[0].Meta
	if err := meta.Validate(a.cfg.Transfer.MaxPayloadBytes); err != nil {
		return nil, "", fmt.Errorf("%w: latent meta: %v", errInputLost, err)
	}
	_, chunkBytes := meta.ChunkRange(0)
	if chunkBytes%int64(fd.FrameBytes()) != 0 {
		return nil, "", fmt.Errorf("agent: latent chunks of %d bytes are not whole %d-byte frames", chunkBytes, fd.FrameBytes())
	}
	framesPerChunk := int(chunkBytes) / fd.FrameBytes()

	dst, release := a.buffer(meta.Bytes())
	defer release()
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A Store object's replicas are tried nearest first until one starts
	// answering; a pull that fails once chunks arrived retries the task.
	var pull *transfer.ChunkPull
	for _, ref := range refs {
		if pull, err = a.xfer.PullChunks(pctx, ref, dst); err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return nil, "", a.pullFailed(ctx, in, err)
	}
	var decodeErr error
	for ch := range decodeOrder(fd, pull.Chunks()) {
		if ch.Index == 0 {
			addPullTime(ctx, start) // to the first chunk: decoding overlaps the rest
		}
		if decodeErr == nil {
			first := ch.Index * framesPerChunk
			if decodeErr = fd.DecodeFrames(ctx, first, ch.Data); decodeErr != nil {
				cancel() // stop the pull; the loop drains what already landed
			} else if spec.Frames > 1 {
				vfirst, n := first, framesPerChunk
				if tv, ok := fd.(videoFrames); ok { // a temporal latent: more video frames than latent ones
					vfirst, n = tv.VideoFrames(first, framesPerChunk)
				}
				a.previewFrames(ctx, c, fd, vfirst, n)
			}
		}
	}
	if decodeErr != nil {
		return nil, "", decodeErr
	}
	if err := pull.Wait(); err != nil {
		return nil, "", a.pullFailed(ctx, in, err)
	}
	return fd.Finish()
}

// videoFrames is a FrameDecoder whose latent frames decode to more video
// frames (a temporal latent, externalDecoder): latent frames [first,
// first+k) to video frames [vfirst, vfirst+n).
type videoFrames interface {
	VideoFrames(first, k int) (vfirst, n int)
}

// previewFrames publishes decoded frames [first, first+n) as previews. They
// are advisory: a failure is logged, never fails the task.
func (a *Agent) previewFrames(ctx context.Context, c *jobs.Claim, fd FrameDecoder, first, n int) {
	for f := first; f < first+n; f++ {
		png, err := fd.FramePreview(f)
		if err == nil {
			if err = a.putPreview(ctx, c, f, png); err == nil {
				markFirstFrame(ctx)
			}
		}
		if err != nil && ctx.Err() == nil {
			a.log.Debug("frame preview", zap.String("job", c.Task.JobID), zap.Int("frame", f), zap.Error(err))
		}
	}
}

// pullFailed classifies a failed pull: a payload its producer no longer has,
// or whose producer left the mesh, is lost (the job restarts); anything else
// is transient (the task retries).
func (a *Agent) pullFailed(ctx context.Context, in jobs.Input, err error) error {
	switch {
	case errors.Is(err, transfer.ErrNotFound):
		err = fmt.Errorf("%w: %s on %s: %w", errInputLost, in.Payload, in.Node, err)
	case ctx.Err() != nil:
		return ctx.Err()
	default:
		if p, ok := a.member.Peer(in.Node); !ok || !p.Registered {
			err = fmt.Errorf("%w: producer %s left the mesh: %v", errInputLost, in.Node, err)
		} else {
			return fmt.Errorf("%w: pull %s from %s: %v", errTransient, in.Payload, in.Node, err)
		}
	}
	if in.Cached {
		// A cache entry no holder serves goes, so that the job's rewind
		// encodes its text again rather than find it.
		a.dropEntry(in.Payload)
	}
	return err
}

// pullVia collects the transports that carried a task's input, for its
// stage record (jobs.StageRecord.Transport).
type pullVia struct {
	mu  sync.Mutex
	got []string // in first-seen order, each once
}

func (v *pullVia) add(transport string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !slices.Contains(v.got, transport) {
		v.got = append(v.got, transport)
	}
}

// String names the transports, "store " first for an input read from the
// Store; "" when nothing was pulled.
func (v *pullVia) String(ins []jobs.Input) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.got) == 0 {
		return ""
	}
	s := strings.Join(v.got, "+")
	if len(ins) > 0 && ins[0].Store {
		s = "store " + s
	}
	return s
}

// pullTime sums the time a task spent pulling its inputs, for its stage
// record (jobs.StageRecord.PullMillis).
type pullTime = atomic.Int64

type pullTimeKey struct{}

func withPullTime(ctx context.Context, p *pullTime) context.Context {
	return context.WithValue(ctx, pullTimeKey{}, p)
}

// addPullTime adds the time since start to ctx's pull time, if it has one.
func addPullTime(ctx context.Context, start time.Time) {
	if p, ok := ctx.Value(pullTimeKey{}).(*pullTime); ok {
		p.Add(int64(time.Since(start)))
	}
}
