package sim

import (
	"slices"
	"time"
)

// Dispatchers' ledgers (agent/dispatch.go, jobs.Fed): a task that no
// worker was pushed waits in its dispatcher's ledger, the producer that
// created it (a worker of the stage before), or, for a submit, the agent
// that took it (one ledger, submitters, stands for those: the simulator
// does not model which agent a client reaches). Each dispatcher orders
// its own waiting tasks (routing.QueuePolicy.Order) and hands them on
// against the credit its ledger holds (grants.go). Gossip shows a
// dispatcher with work waiting a GossipDelay late (NodeMeta.Waiting).
// The central dispatcher's queue is one ledger.

// ledger is one dispatcher's waiting tasks of one stage.
type ledger struct {
	idx  int32  // its index in the stage's ledgers (and granted)
	name string // the dispatcher's name, as grants name it
	q    stageQueue
	// on: tasks wait in it, since onAt (or none since offAt); gossip shows
	// it a GossipDelay late. progressAt is when it last handed a task on,
	// or tasks started to wait (agent.dispatchLoop's progress).
	on                      bool
	onAt, offAt, progressAt time.Duration
	listed                  bool          // in its stage's waitingD
	credited                bool          // in its stage's credited
	visPos                  int32         // its index in its stage's visible, -1 when gossip does not show it waiting
	shownAt                 time.Duration // when gossip last showed a change of it (waitingSeen, waitingGone)
}

// submitters names the ledger of the submits' tasks.
const submitters = "submitters"

// newLedgers is a stage's ledgers: one per producer (the stage before's
// workers, named as they are), then the submitters'; the central
// dispatcher's one.
func newLedgers(producers []string, central bool) []*ledger {
	if central {
		return []*ledger{{name: "dispatcher", visPos: -1}}
	}
	ls := make([]*ledger, 0, len(producers)+1)
	for i, p := range producers {
		ls = append(ls, &ledger{idx: int32(i), name: p, visPos: -1})
	}
	return append(ls, &ledger{idx: int32(len(producers)), name: submitters, visPos: -1})
}

// ledgerOf is the ledger task t of st waits in.
func (s *sim) ledgerOf(st *stage, t *task) *ledger {
	if s.central() || t.producer < 0 {
		return st.ledgers[len(st.ledgers)-1]
	}
	return st.ledgers[t.producer]
}

// ledgerNamed is the ledger of st whose dispatcher a grant names.
func (s *sim) ledgerNamed(st *stage, name string) *ledger {
	if name == submitters {
		return st.ledgers[len(st.ledgers)-1]
	}
	return st.ledgers[nameIndex(name)]
}

// enqueueTask puts task t of st in its dispatcher's ledger.
func (s *sim) enqueueTask(st *stage, t *task) {
	l := s.ledgerOf(st, t)
	l.q.push(t)
	st.queued++
	s.ledgerChanged(st, l)
}

// requeueTask puts task t of st back in its dispatcher's ledger, in its
// old place (stageQueue.requeue).
func (s *sim) requeueTask(st *stage, t *task) {
	l := s.ledgerOf(st, t)
	l.q.requeue(t)
	st.queued++
	s.ledgerChanged(st, l)
}

// unqueue counts waiting task t of st handed on (claimed).
func (s *sim) unqueue(st *stage, t *task) {
	l := s.ledgerOf(st, t)
	l.q.queued--
	st.queued--
	s.ledgerChanged(st, l)
}

// ledgerChanged follows whether tasks wait in ledger l of st (mesh):
// gossip shows the change a GossipDelay later (waitingSeen, waitingGone).
func (s *sim) ledgerChanged(st *stage, l *ledger) {
	on := l.q.queued > 0
	if s.central() || on == l.on {
		return
	}
	now := s.clk.now
	l.on = on
	if !on {
		l.offAt = now
		s.clk.at(now+s.cfg.GossipDelay, event{kind: evWaitingGone, stage: int8(st.i), disp: l.idx})
		return
	}
	l.onAt, l.progressAt = now, now
	if !l.listed {
		l.listed = true
		st.waitingD = append(st.waitingD, l.idx)
	}
	if len(st.granted[l.idx]) > 0 {
		s.creditedLedger(st, l) // credits it holds may go to its waiting work
	}
	s.clk.at(now+s.cfg.GossipDelay, event{kind: evWaitingSeen, stage: int8(st.i), disp: l.idx})
}

// creditedLedger has handOn look at ledger l of st: it holds credit while
// its work waits.
func (s *sim) creditedLedger(st *stage, l *ledger) {
	if !l.credited {
		l.credited = true
		st.credited = append(st.credited, l.idx)
	}
	s.requestWake(st, s.clk.now+s.cfg.NetDelay) // once the grant's message arrives
}

// waitingSeen is gossip showing ledger d's dispatcher with work waiting,
// unless it changed since: it is in st.visible, and the free workers whose
// slot has no owner grant it to the dispatchers so shown (the agent's
// worker loop wakes on gossip and calls grantIdle; a slot with an owner
// keeps it until the promise lapses).
func (s *sim) waitingSeen(st *stage, d int32) {
	l := st.ledgers[d]
	if !l.on || l.onAt+s.cfg.GossipDelay > s.clk.now {
		return
	}
	l.shownAt = s.clk.now
	if l.visPos < 0 {
		l.visPos = int32(len(st.visible))
		st.visible, st.visibleIdx = append(st.visible, l.name), append(st.visibleIdx, d)
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

// waitingGone is gossip showing ledger d's dispatcher with no work
// waiting, unless it changed since: it leaves st.visible.
func (s *sim) waitingGone(st *stage, d int32) {
	l := st.ledgers[d]
	if l.on || l.offAt+s.cfg.GossipDelay > s.clk.now || l.visPos < 0 {
		return
	}
	l.shownAt = s.clk.now
	p, last := l.visPos, len(st.visible)-1
	st.visible[p], st.visibleIdx[p] = st.visible[last], st.visibleIdx[last]
	st.ledgers[st.visibleIdx[p]].visPos = p
	st.visible, st.visibleIdx = st.visible[:last], st.visibleIdx[:last]
	l.visPos = -1
}

// visibleWaiting is the dispatchers gossip shows with tasks of st waiting
// (st.visible), as worker wk (nil: none) grants among them, fed being the
// producer of the task that just ended (-1: none): a uniform sample, less
// those that declined wk's grants since gossip showed them anew
// (SlotBook.Declined), and fed's when gossip shows it (routing.GrantTo's
// first choice): routing's choice among them is its choice among all.
func (s *sim) visibleWaiting(st *stage, wk *worker, fed int32) []string {
	if wk == nil || !wk.declines && len(st.visible) <= waitingSample {
		return st.visible
	}
	names := s.waitNames[:0]
	add := func(d int32) {
		l := st.ledgers[d]
		if wk.book.Declined(l.name, s.epoch.Add(s.lastShown(l))) || slices.Contains(names, l.name) {
			return
		}
		names = append(names, l.name)
	}
	if fed >= 0 && st.i > 0 && st.ledgers[fed].visPos >= 0 {
		add(fed)
	}
	if len(st.visible) <= waitingSample {
		for _, d := range st.visibleIdx {
			add(d)
		}
	} else {
		for range 2 * waitingSample {
			if len(names) >= waitingSample {
				break
			}
			add(st.visibleIdx[s.rng.IntN(len(st.visibleIdx))])
		}
	}
	s.waitNames = names
	return names
}

// lastShown is when gossip last brought news of ledger l's dispatcher
// (the agent's Peer.MetaAt): the latest of its changes a GossipDelay old.
// A grant it declined before then may go to it again.
func (s *sim) lastShown(l *ledger) time.Duration {
	now, last := s.clk.now, l.shownAt
	for _, at := range [2]time.Duration{l.onAt + s.cfg.GossipDelay, l.offAt + s.cfg.GossipDelay} {
		if at <= now && at > last {
			last = at
		}
	}
	return last
}

// waitingSample is how many of the dispatchers gossip shows waiting a
// worker's grant chooses among (visibleWaiting).
const waitingSample = 8
