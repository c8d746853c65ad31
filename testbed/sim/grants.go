package sim

import (
	"strconv"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/routing"
)

// Credit grants, as the agent makes them (agent/grants.go): who owns a
// worker's free slot is routing's decision (GrantFreed when a task ends,
// GrantIdle when the slot has no owner or a dispatcher's work starts to
// wait, GrantQueue when a task starts), made here on what the worker
// would know: its slot (free, promised, its queue credit), the producers of
// the stage before, and the dispatchers gossip shows with work waiting, a
// GossipDelay late. The waiting tasks of all dispatchers are one ordered
// queue here, so they are one grantee, dispatchers: a slot granted to them
// is handed the queue's first choice (wake), and queue credit granted to
// them the next ones (assignQueued). A producer's ledger (granted) holds
// the credits granted to it ahead of work and those its pushed tasks gave
// back (GrantFreed's Returned: its ledger sees the task gone at the
// commit, creditReturned), and it pushes against them (pushTarget).

// dispatchers is the one grantee that stands for every dispatcher with
// work waiting.
const dispatchers = "dispatchers"

var waitingDispatchers = []string{dispatchers}

// grantWait and gossipSettled are the agent's (agent/dispatch.go): a
// dispatcher whose waiting tasks went nowhere for grantWait hands them to
// workers gossip shows free too, when that has stood still for
// gossipSettled.
const (
	grantWait     = 250 * time.Millisecond
	gossipSettled = time.Second
)

// slotView is what worker wk of st knows when it grants its slot
// (routing.SlotView): fed is the producer of the task that just ended
// (-1: none, or a submit).
func (s *sim) slotView(st *stage, wk *worker, fed int32) routing.SlotView {
	tnow := s.epoch.Add(s.clk.now)
	var v routing.SlotView
	if !wk.busy && !wk.held && len(wk.pushed) == 0 {
		v.Free = 1 // a claim in its inbox takes the slot next (agent.slots)
	}
	v.Owner, _ = wk.book.Promised(tnow)
	if s.waitingInGossip(st) {
		v.Waiting = waitingDispatchers
		if !wk.held {
			v.Queue = wk.book.Room(len(wk.pushed), s.cfg.Queue.HoldFor, tnow)
		}
	}
	v.Admit = -1
	if s.admits(st) && !s.cfg.Admission.Off {
		v.Admit = max(0, int(wk.quota)-s.mine(wk)-len(wk.pushed))
	}
	if st.i > 0 {
		v.Producers = s.st[st.i-1].names
		if fed >= 0 {
			v.Fed = v.Producers[fed]
		}
	}
	return v
}

// grantSlot is free worker w of st giving its slot an owner unless it has
// one (routing.GrantIdle): its worker's loop finding nothing to start, the
// promise lapsing, or gossip showing work waiting.
func (s *sim) grantSlot(st *stage, w int32, fed int32) {
	wk := st.workers[w]
	v := s.slotView(st, wk, fed)
	g := routing.GrantIdle(v, s.rng)
	s.applyGrant(st, wk, g)
	if g.To == "" && v.Owner.To == "" && !wk.unowned {
		// Nobody to grant its slot to (a first stage, nobody waiting):
		// gossip showing work waiting changes that (waitingSeen).
		wk.unowned = true
		st.unowned = append(st.unowned, w)
	}
}

// grantFreed is worker w's slot freed by task t (routing.GrantFreed): a
// task from its inbox (pushed, or handed on) gives its producer, its
// dispatcher, the credit back by that producer's own ledger.
func (s *sim) grantFreed(st *stage, w int32, t *task) {
	wk := st.workers[w]
	d := ""
	if t.fromPush && t.producer >= 0 {
		d = s.st[st.i-1].names[t.producer]
	}
	s.applyGrant(st, wk, routing.GrantFreed(s.slotView(st, wk, t.producer), d, s.rng))
}

// grantQueue is busy worker wk, starting task t, granting its queue
// credit to the dispatchers with work waiting (routing.GrantQueue), which
// hand it their next tasks.
func (s *sim) grantQueue(st *stage, wk *worker, t *task) {
	if !s.waitingInGossip(st) {
		return
	}
	if g := routing.GrantQueue(s.slotView(st, wk, t.producer), s.rng); g.To == dispatchers {
		s.grantMsgs++
		s.assignQueued(st, wk, g.Free)
	}
}

// applyGrant makes worker wk's grant g of its slot (none for a zero g):
// the promise in wk's book, and the grantee's part, until the promise
// lapses, when wk looks again (evGrantEnds).
func (s *sim) applyGrant(st *stage, wk *worker, g routing.SlotGrant) {
	if g.To == "" {
		return
	}
	if !g.Returned {
		s.grantMsgs++
	}
	until := wk.book.Promise(g, s.epoch.Add(s.clk.now)).Sub(s.epoch)
	switch {
	case g.To == dispatchers:
		if !wk.toDisp {
			wk.toDisp = true
			st.toDisp = append(st.toDisp, wk.idx)
		}
		s.requestWake(st, s.clk.now+s.cfg.NetDelay) // the grant's message; they hand it a task
	case g.Returned:
		// The producer's ledger gives itself the credit once it sees the
		// task gone (creditReturned).
	default:
		s.credit(st, wk, nameIndex(g.To), until)
	}
	s.clk.at(until, event{kind: evGrantEnds, stage: int8(st.i), worker: wk.idx})
}

// grantedTo is the waiting workers of st whose free slot is promised to
// the dispatchers at tnow, in s.grantedW; it drops the rest from st.toDisp.
func (s *sim) grantedTo(st *stage, tnow time.Time) []int32 {
	granted, keep := s.grantedW[:0], st.toDisp[:0]
	for _, w := range st.toDisp {
		wk := st.workers[w]
		if g, _ := wk.book.Promised(tnow); g.To != dispatchers {
			wk.toDisp = false
			continue
		}
		keep = append(keep, w)
		if wk.waitPos >= 0 && len(wk.pushed) == 0 {
			granted = append(granted, w)
		}
	}
	st.toDisp = keep
	s.grantedW = granted
	return granted
}

// credit puts a credit of worker wk's slot in producer p's ledger until
// until.
func (s *sim) credit(st *stage, wk *worker, p int32, until time.Duration) {
	wk.grantTo, wk.grantUntil = p, until
	if l := st.granted[p]; len(l) == cap(l) && len(l) >= 16 {
		st.granted[p] = s.validGrants(st, p, l[:0], l) // drop the stale before the list grows
	}
	st.granted[p] = append(st.granted[p], wk.idx)
}

// creditReturned is the commit of task t, run on w from its inbox, seen
// by its producer's ledger (jobs.Fed; agent.creditReturned): the producer
// has w's credit back for routing.ReturnTTL, while w's slot is still
// promised to it.
func (s *sim) creditReturned(st *stage, w int32, t *task) {
	if !t.fromPush || t.producer < 0 {
		return
	}
	wk := st.workers[w]
	if g, _ := wk.book.Promised(s.epoch.Add(s.clk.now)); g.Returned && g.To == s.st[st.i-1].names[t.producer] {
		s.credit(st, wk, t.producer, s.clk.now+routing.ReturnTTL)
	}
}

// grantEnds is worker w's promise of its slot lapsing: free and admitted,
// it gives the slot another owner.
func (s *sim) grantEnds(st *stage, w int32) {
	wk := st.workers[w]
	if wk.waitPos < 0 {
		return
	}
	if g, _ := wk.book.Promised(s.epoch.Add(s.clk.now)); g.To == "" {
		s.grantSlot(st, w, -1)
	}
}

// validGrants appends to dst the workers of list whose credit p's ledger
// holds.
func (s *sim) validGrants(st *stage, p int32, dst, list []int32) []int32 {
	for _, w := range list {
		if wk := st.workers[w]; wk.grantTo == p && wk.grantUntil > s.clk.now {
			dst = append(dst, w)
		}
	}
	return dst
}

// takeGrant spends producer p's newest credit from a worker of st
// (routing.Grants.Take), which it holds until the worker's revoke reaches
// it; -1 for none.
func (s *sim) takeGrant(st *stage, p int32) int32 {
	if p < 0 || st.granted == nil {
		return -1
	}
	l := st.granted[p]
	for len(l) > 0 {
		w := l[len(l)-1]
		l = l[:len(l)-1]
		if wk := st.workers[w]; wk.grantTo == p && wk.grantUntil > s.clk.now {
			wk.grantTo = -1 // spent
			st.granted[p] = l
			return w
		}
	}
	st.granted[p] = l
	return -1
}

// pushTarget is the worker of st that producer p (a worker of the stage
// before) pushes its new task to (agent.pushTarget): one whose credit its
// ledger holds, else pickHint's.
func (s *sim) pushTarget(st *stage, p int32) int32 {
	if w := s.takeGrant(st, p); w >= 0 {
		return w
	}
	return s.pickHint(st)
}

// queueChanged follows whether tasks of st wait (mesh): when they start
// to, gossip shows their dispatchers waiting a GossipDelay later
// (waitingSeen).
func (s *sim) queueChanged(st *stage) {
	on := st.q.queued > 0
	if s.central() || on == st.qOn {
		return
	}
	now := s.clk.now
	st.qOn = on
	if !on {
		st.qOffAt = now
		return
	}
	st.qOnAt, st.progressAt = now, now
	s.clk.at(now+s.cfg.GossipDelay, event{kind: evWaitingSeen, stage: int8(st.i)})
}

// waitingInGossip reports whether gossip shows st's dispatchers with
// work waiting: whether tasks waited a GossipDelay ago (the queue's last
// change of state told when).
func (s *sim) waitingInGossip(st *stage) bool {
	t := s.clk.now - s.cfg.GossipDelay
	if st.qOn {
		return st.qOnAt <= t
	}
	return st.qOnAt <= t && st.qOffAt > t
}

// waitingSeen is gossip showing st's dispatchers with work waiting: the
// free workers whose slot has no owner grant it to them (the agent's
// worker loop wakes on gossip and calls grantIdle; a slot with an owner
// keeps it until the promise lapses).
func (s *sim) waitingSeen(st *stage) {
	if !s.waitingInGossip(st) {
		return
	}
	s.ready = append(s.ready[:0], st.unowned...)
	st.unowned = st.unowned[:0]
	for _, w := range s.ready {
		wk := st.workers[w]
		wk.unowned = false
		if wk.waitPos >= 0 {
			s.grantSlot(st, w, -1)
		}
	}
}

// assignQueued is the dispatchers handing busy worker wk, against its
// queue credit, their next n waiting tasks (agent.dispatch): each one
// claim txn, after the grant's message, landing in wk's inbox.
func (s *sim) assignQueued(st *stage, wk *worker, n int) {
	now := s.clk.now
	s.cands, s.tasks = st.q.scan(min(s.cfg.ScanPerClass, n), s.epoch, s.cands, s.tasks)
	ordered, _ := s.cfg.Queue.Order(s.cands, "", s.epoch.Add(now))
	for _, c := range ordered[:min(n, len(ordered))] {
		t := s.tasks[idIndex(c.ID)]
		t.claimed, t.pushTo = true, wk.idx
		st.q.queued--
		s.etcd.write(now, 1) // jobs.Store.Assign: the claim for wk
		s.claimTxns++
		s.assigns++
		s.clk.at(now+s.cfg.NetDelay+s.etcd.writeLat(now), event{kind: evAssigned, task: t})
	}
	st.progressAt = now
	s.queueChanged(st)
}

// assigned is a dispatcher's hand-on of t against queue credit landing:
// the claim is in its worker's inbox, started when its slot frees.
func (s *sim) assigned(t *task) {
	t.assigned, t.pushedAt = true, s.clk.now
	s.handOverLanded(s.st[t.stage], t)
}

// nameIndex is the index of a worker in its stage from its name
// ("denoise-12").
func nameIndex(name string) int32 {
	n, err := strconv.Atoi(name[strings.LastIndexByte(name, '-')+1:])
	if err != nil {
		panic("sim: worker name " + name)
	}
	return int32(n)
}
