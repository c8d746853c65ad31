package sim

import (
	"time"

	"github.com/latentmesh/latentmesh/routing"
)

// Preemption: an interactive denoise task that has waited
// QueuePolicy.PreemptAfter with no GPU free for it makes one that runs
// batch work stop its task at the end of the step it is in; the task is
// checkpointed there and goes back to the queue, dated, to resume later
// from the checkpoint. Who stops is routing's choice in both designs
// (QueuePolicy.Victims): a mesh worker stops its own task for a claim its
// dispatcher handed it (QueuePolicy.Preempt, agent.preemptLoop and
// agent.assignTarget); the central dispatcher, which sees every GPU,
// stops the victim itself.

// preempts reports whether st's batch work gives way: denoise, under a
// policy that preempts (agent.go starts the preemption loop for these).
func (s *sim) preempts(st *stage) bool {
	q := s.cfg.Queue
	return st.i == 1 && q.PreemptAfter > 0 && q.Scheduler != routing.FIFO
}

// watchDue has queued task t looked at when it comes due for preemption
// (preemptDue): interactive denoise work, waiting unclaimed.
func (s *sim) watchDue(t *task) {
	if t.job.class == routing.Interactive && s.preempts(s.st[t.stage]) {
		s.clk.at(t.enq+s.cfg.Queue.PreemptAfter, event{kind: evPreemptDue, task: t})
	}
}

// preemptRecheck is how soon a due task that found no worker to give way
// is looked at again: the mesh's dispatcher looks when gossip changes.
const preemptRecheck = 500 * time.Millisecond

// preemptDue is queued interactive task t due for preemption. With a
// worker free and taking work, that worker's wake takes it (Order puts it
// first). Otherwise, on the mesh, its dispatcher hands it to a worker that
// gossip shows running batch work (agent.assignTarget: NodeMeta.Yields),
// one claim txn, and that worker gives way (preemptCheck); centrally, the
// dispatcher stops routing's victim.
func (s *sim) preemptDue(t *task) {
	st := s.st[t.stage]
	if t.claimed || t.gone {
		return
	}
	now := s.clk.now
	again := func() { s.clk.at(now+preemptRecheck, event{kind: evPreemptDue, task: t}) }
	if len(st.waiting) > 0 {
		again() // the wake hands it on; looked at again should it not
		return
	}
	if s.central() {
		if !s.centralPreempt(st, t) {
			again()
		}
		return
	}
	w := s.yielding(st)
	if w < 0 {
		again()
		return
	}
	t.claimed, t.pushTo, t.pushedAt, t.hint = true, w, now, w
	s.unqueue(st, t)
	s.etcd.write(now, 1) // jobs.Store.Assign: the claim for w
	s.claimTxns++
	s.handOns++
	s.clk.at(now+s.cfg.NetDelay+s.etcd.writeLat(now), event{kind: evHandedOn, task: t})
}

// yielding is a worker of st that gossip shows running batch work (since
// a GossipDelay ago) and not already stopping: a uniform sample, as
// pickHint's; -1 for none found.
func (s *sim) yielding(st *stage) int32 {
	for try := 0; try < 64; try++ {
		w := st.workers[s.rng.IntN(len(st.workers))]
		if s.canPreempt(st, w) && w.busySince <= s.clk.now-s.cfg.GossipDelay {
			return w.idx
		}
	}
	return -1
}

// handedOn is a dispatcher's claim of due task t for a worker that gives
// way landing: its worker's inbox has it (the claim key; the task key's
// rewrite reaches the dispatcher's ledger), and the worker looks at once
// whether to give way.
func (s *sim) handedOn(t *task) {
	st := s.st[t.stage]
	t.handedOn = true
	s.handOverLanded(st, t)
	s.lookAt(st, st.workers[t.pushTo], s.clk.now)
}

// canPreempt reports whether worker wk could give way for interactive
// work (agent.batchOnly): it runs batch work and is not stopping already.
func (s *sim) canPreempt(st *stage, wk *worker) bool {
	return s.preempts(st) && wk.running != nil && !wk.stopping && wk.running.job.class == routing.Batch
}

// preemptCheck is busy worker wk, running batch work, asking routing
// whether to give way for the claims pushed to it
// (QueuePolicy.Preempt, agent.preemptLoop), and stopping its task if so.
// It reports whether it did; otherwise it looks again when the answer
// may change by the clock.
func (s *sim) preemptCheck(st *stage, wk *worker) bool {
	if !s.canPreempt(st, wk) {
		return false
	}
	now := s.epoch.Add(s.clk.now)
	s.inbox = s.inboxOf(st, wk, s.inbox[:0])
	s.due = s.due[:0]
	for _, h := range s.inbox {
		s.due = append(s.due, h.Candidate)
	}
	name := st.names[wk.idx]
	run := wk.running.candidate("running", name, s.epoch)
	run.Node = name
	victim, wake := s.cfg.Queue.Preempt(s.due, []routing.Candidate{run}, name, now)
	if victim == "" {
		if !wake.IsZero() {
			s.lookAt(st, wk, wake.Sub(s.epoch))
		}
		return false
	}
	return s.stop(st, wk)
}

// centralPreempt is the central dispatcher stopping, for due task t, the
// batch task routing names among every GPU's (QueuePolicy.Victims): one
// decision of its time. It reports whether it stopped one.
func (s *sim) centralPreempt(st *stage, t *task) bool {
	now := s.epoch.Add(s.clk.now)
	s.due = s.due[:0]
	for _, wk := range st.workers {
		if r := wk.running; r != nil && !wk.stopping {
			c := r.candidate(indexID(int(wk.idx)), "", s.epoch)
			c.Node = c.ID
			s.due = append(s.due, c)
		}
	}
	victims, _ := s.cfg.Queue.Victims([]routing.Candidate{t.candidate("due", "", s.epoch)}, s.due, now)
	s.decide()
	if len(victims) == 0 {
		return false
	}
	return s.stop(st, st.workers[idIndex(victims[0].ID)])
}

// stop tells worker wk's task to give way: the engine stops at the end of
// the denoise step it is in (stopped). A task whose run ends first is not
// stopped: its slot frees then anyway. It reports whether it stops.
func (s *sim) stop(st *stage, wk *worker) bool {
	t, now := wk.running, s.clk.now
	at := now
	if now > t.runStart {
		step := st.compute / time.Duration(max(1, s.model.Steps))
		at = t.runStart + ((now-t.runStart)/step+1)*step
	}
	if at >= t.runEnd {
		return false
	}
	wk.stopping = true
	s.clk.at(at, event{kind: evStopped, stage: int8(st.i), worker: wk.idx, task: t, run: t.run})
	return true
}

// stopped is preempted task t stopping on worker w: it wrote its
// checkpoint (one Store record) and goes back to its queue, dated
// (jobs.Store.Yield, fenced by its claim: one write), with the compute it
// has left; its slot is free for the interactive work it gave way to.
func (s *sim) stopped(st *stage, w int32, t *task) {
	now := s.clk.now
	wk := st.workers[w]
	s.computed(t.runStart, now)
	if !t.fromPush || t.byDispatcher() {
		s.stoppedClaimed++
	}
	t.left = t.runEnd - now
	t.run++ // its end is not coming
	t.avail = now
	t.preempted, t.preemptedAt = true, now
	t.fromPush, t.pushed, t.handedOn, t.assigned = false, false, false, false
	wk.freeAt, wk.running, wk.stopping = now, nil, false
	s.release(wk, false)
	s.preemptions++
	s.etcd.write(now, 2)
	s.setFree(st, +1)
	s.addWaiting(st, w)
	if s.central() {
		t.claimed = false
		s.requeueTask(st, t)
		s.requestDispatch()
		return
	}
	t.pushTo = w // the claim it gives back is w's (requeued lets it go)
	s.clk.at(now+s.etcd.writeLat(now), event{kind: evRequeued, stage: int8(st.i), task: t})
	s.requestWake(st, now)
}

// computed adds a run's compute from begin to end, within the arrival
// window, to the GPU time used.
func (s *sim) computed(begin, end time.Duration) {
	if lo, hi := max(begin, 0), min(end, s.cfg.Duration); hi > lo {
		s.busy += hi - lo
	}
}
