package agent

import (
	"context"
	"errors"
	"fmt"
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

// Running a claimed task to its end: execute takes the claim, runs its
// stage (run), and writes the outcome (commit, or a retry, a rewind or a
// failure), watching for a cancel or a lost claim meanwhile (watchCancel).

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
	// An offered claim's start is said once its write confirms it, with
	// the claim's revision (watchCancel); a withdrawn one never started.
	fedRev, taken := a.fedSeen(st), c // c is replaced by a reclaim below
	started := func() {
		log.Debug("task started", zap.Int64("claim_rev", taken.Revision()), zap.Bool("pushed", taken.Pushed), zap.Bool("offered", taken.Offered()), zap.Int64("fed_rev", fedRev))
	}
	if !c.Offered() {
		started()
	}
	a.recent.note(c.Task.JobID)
	defer a.untrack(c)
	defer a.inboxes[st].Done(c)
	var handedOff handoffFlag // set once an early handoff committed the stage
	var ran atomic.Bool       // set once run returned: no work is left to stop
	ctx, stop := a.watchCancel(c, &handedOff, &ran, started)
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
	withdrawn := func() bool {
		if !c.Withdrawn() {
			return false
		}
		// Started from an offer that no write confirmed: etcd holds no
		// such claim (or another one, which the inbox offers as any), so
		// there is nothing to record.
		log.Info("offered claim withdrawn; output discarded")
		a.metrics.Offered(st, true)
		release()
		return true
	}
	if withdrawn() {
		return
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
		if err != nil && withdrawn() {
			return
		}
		lost := errors.Is(err, jobs.ErrFenced) || (ctx.Err() != nil && a.member.Lease() != c.Lease)
		// (An offer no write has confirmed is no claim to take back: its
		// task may not exist.)
		if err != nil && lost && a.ctx.Err() == nil && c.Revision() != 0 {
			// The claim went with the lease while the finished output
			// waited for etcd (an etcd majority frozen and thawed expires
			// leases as it resumes; only the claim's lease or its holder
			// deletes a claim): take the task back if nobody has since,
			// and commit it.
			if c2 := a.reclaim(c, log); c2 != nil {
				ctx2, stop2 := a.watchCancel(c2, &handedOff, &ran, nil)
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
	if err := c.Settle(ctx); err != nil {
		return false, err // an offer no write confirmed (or the task stopped first)
	}
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

		if err == nil {
			a.dropPreviewsLater(c)
		}
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
// the job record), so the task leaving the queue costs no read. For an
// offered claim it also ends when the offer is withdrawn, and calls
// confirmed (if not nil) once the write confirms it.
func (a *Agent) watchCancel(c *jobs.Claim, handedOff *handoffFlag, ran *atomic.Bool, confirmed func()) (ctx context.Context, stop func()) {
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
	if settled := c.Settled(); settled != nil {
		// An offered claim: a withdrawn offer stops the task; a confirmed
		// one is a claim like any (confirmed says so).
		wg.Go(func() {
			select {
			case <-settled:
			case <-ctx.Done():
				select {
				case <-settled: // confirmed before the task ended
				default:
					return
				}
			}
			if c.Withdrawn() {
				a.log.Info("offered claim withdrawn; stopping its task", zap.String("job", c.Task.JobID))
				cancel()
			} else if confirmed != nil {
				confirmed()
			}
		})
	}
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

// previewLinger is how long a committed video's frame previews outlive the
// commit that ended its job: a client streaming them (StreamFrames) reads
// the last one after that commit, which deleted it at once before (a
// 4-frame test stream missed its last frame two runs in ten).
const previewLinger = 5 * time.Second

// dropPreviewsLater deletes the frame previews of c's job previewLinger
// after c's decode committed, if c made any (a video). An agent that
// closes first leaves them to their TTL.
func (a *Agent) dropPreviewsLater(c *jobs.Claim) {
	if _, last := c.Task.Stage.Next(); !last || c.Task.Spec.Frames <= 1 {
		return
	}
	id := c.Task.JobID
	a.wg.Go(func() {
		select {
		case <-time.After(previewLinger):
		case <-a.ctx.Done():
			return
		}
		ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
		defer cancel()
		if err := a.store.DropPreviews(ctx, id); err != nil {
			a.log.Debug("frame previews left to their TTL", zap.String("job", id), zap.Error(err))
		}
	})
}
