package agent

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
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
		fits := a.roomForOutputs()
		pick, full, wake := a.cfg.Queue.Pick(pushedOf(pushed), a.id, now, func(i int) bool { return fits(pushed[i].Task) })
		if pick >= 0 {
			pc := pushed[pick]
			q.Take(pc)
			a.metrics.PushedClaim(st, false)
			if pc.Offered() {
				a.metrics.Offered(st, false)
			}
			a.setBlocked(st, false)
			return pc, nil
		}
		if full {
			// Tasks wait but none fits: say so in gossip (no free credit)
			// and look again as memory frees, which gossip and releases
			// tell, not etcd: within a second. They go to a worker with
			// room after the steal grace (returnPushes).
			a.setBlocked(st, true)
			wake = earliest(wake, time.Now().Add(time.Second))
			wake = earliest(wake, a.returnPushes(st, q))
		}
		var mesh <-chan struct{}
		if !full {
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
