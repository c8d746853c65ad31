package sim

import (
	"strconv"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/routing"
)

// Credit grants, as the agent makes them (agent/grants.go): who owns a
// worker's free slot is routing's decision (GrantFreed when a task ends,
// GrantIdle when the slot has no owner, GrantQueue when a task starts),
// made here on what the worker would know: its slot (free, promised, its
// queue credit), the producers of the stage before, and
// the dispatchers gossip shows with work waiting, a GossipDelay late
// (ledger.go). A grant puts a credit in its holder's ledger (granted): a
// dispatcher with tasks waiting hands its first choice on against it
// (handOn, assignQueued), a producer pushes its next task against it
// (pushTarget). A pushed or handed-on task's slot goes back to its
// dispatcher by that dispatcher's own ledger once it sees the commit
// (GrantFreed's Returned, creditReturned).

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
	if v.Waiting = s.visibleWaiting(st, wk, fed); len(v.Waiting) > 0 {
		if !wk.held {
			v.Queue = wk.book.Room(len(wk.pushed), s.cfg.Queue.HoldFor, tnow)
		}
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
// credit to a dispatcher with work waiting (routing.GrantQueue), which
// hands it its next tasks.
func (s *sim) grantQueue(st *stage, wk *worker, t *task) {
	g := routing.GrantQueue(s.slotView(st, wk, t.producer), s.rng)
	if g.To == "" {
		return
	}
	if l := s.deliver(st, wk, g); l != nil {
		s.assignQueued(st, wk, l, g.Free)
	}
}

// applyGrant makes worker wk's grant g of its slot (none for a zero g):
// the promise in wk's book, and the credit in the grantee's ledger, until
// the promise lapses, when wk looks again (evGrantEnds).
func (s *sim) applyGrant(st *stage, wk *worker, g routing.SlotGrant) {
	if g.To == "" {
		return
	}
	until := wk.book.Promise(g, s.epoch.Add(s.clk.now)).Sub(s.epoch)
	s.clk.at(until, event{kind: evGrantEnds, stage: int8(st.i), worker: wk.idx})
	if g.Returned {
		return // the dispatcher's own ledger's, once it sees the task gone (creditReturned)
	}
	if l := s.deliver(st, wk, g); l != nil {
		s.credit(st, wk, l, until)
	}
}

// deliver is worker wk's grant g sent to its grantee (one message): the
// grantee's ledger, or nil when it declines the grant (routing.Declines:
// made for work waiting, its work went meanwhile), whose decline reaches
// wk a round trip later (declined).
func (s *sim) deliver(st *stage, wk *worker, g routing.SlotGrant) *ledger {
	s.grantMsgs++
	l := s.ledgerNamed(st, g.To)
	if !routing.Declines(g.Waiting, l.on) {
		return l
	}
	s.grantMsgs++
	s.clk.at(s.clk.now+2*s.cfg.NetDelay, event{kind: evDeclined, stage: int8(st.i), worker: wk.idx, disp: l.idx})
	return nil
}

// declined is dispatcher d's decline of worker w's grant reaching w
// (SlotBook.Decline): d is left out until gossip shows it anew, and a free
// slot promised to it, w admitted, goes to another.
func (s *sim) declined(st *stage, w, d int32) {
	wk := st.workers[w]
	wk.declines = true
	if wk.book.Decline(st.ledgers[d].name, s.epoch.Add(s.clk.now)) && wk.waitPos >= 0 {
		s.grantSlot(st, w, -1)
	}
}

// credit puts a credit of worker wk's slot in ledger l's holder's table
// until until; a dispatcher with tasks waiting hands one on against it
// once the grant's message arrives.
func (s *sim) credit(st *stage, wk *worker, l *ledger, until time.Duration) {
	p := l.idx
	wk.grantTo, wk.grantUntil = p, until
	if list := st.granted[p]; len(list) == cap(list) && len(list) >= 16 {
		st.granted[p] = s.validGrants(st, p, list[:0], list) // drop the stale before the list grows
	}
	st.granted[p] = append(st.granted[p], wk.idx)
	if l.on {
		s.creditedLedger(st, l)
	}
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
		s.credit(st, wk, st.ledgers[t.producer], s.clk.now+routing.ReturnTTL)
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

// holds reports whether ledger p holds worker wk's credit now.
func (s *sim) holds(p int32, wk *worker) bool { return wk.grantTo == p && wk.grantUntil > s.clk.now }

// validGrants appends to dst the workers of list whose credit p's ledger
// holds.
func (s *sim) validGrants(st *stage, p int32, dst, list []int32) []int32 {
	for _, w := range list {
		if s.holds(p, st.workers[w]) {
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
		if wk := st.workers[w]; s.holds(p, wk) {
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
// ledger holds, else pickHint's; none while tasks of st wait in its
// ledger.
func (s *sim) pushTarget(st *stage, p int32) int32 {
	if st.ledgers[p].on {
		return -1 // its tasks of st wait: the new one takes its place among them
	}
	if w := s.takeGrant(st, p); w >= 0 {
		return w
	}
	return s.pickHint(st)
}

// assignQueued is the dispatcher of ledger l handing busy worker wk,
// against its queue credit, its next n waiting tasks (agent.dispatch):
// each one claim txn, after the grant's message, landing in wk's inbox.
// With none waiting, the credit is its next push's.
func (s *sim) assignQueued(st *stage, wk *worker, l *ledger, n int) {
	now := s.clk.now
	if l.q.queued == 0 {
		s.credit(st, wk, l, now+routing.WaitingTTL)
		return
	}
	s.cands, s.tasks = l.q.scan(min(s.cfg.ScanPerClass, n), s.epoch, s.cands, s.tasks)
	ordered, _ := s.cfg.Queue.Order(s.cands, l.name, s.epoch.Add(now))
	for _, c := range ordered[:min(n, len(ordered))] {
		t := s.tasks[idIndex(c.ID)]
		t.claimed, t.pushTo = true, wk.idx
		s.unqueue(st, t)
		s.etcd.write(now, 1) // jobs.Store.Assign: the claim for wk
		s.claimTxns++
		s.assigns++
		s.clk.at(now+s.cfg.NetDelay+s.etcd.writeLat(now), event{kind: evAssigned, task: t})
	}
	l.progressAt = now
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
