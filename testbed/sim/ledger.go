package sim

import "time"

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
	listed                  bool // in its stage's waitingD
}

// submitters names the ledger of the submits' tasks.
const submitters = "submitters"

// newLedgers is a stage's ledgers: one per producer (the stage before's
// workers, named as they are), then the submitters'; the central
// dispatcher's one.
func newLedgers(producers []string, central bool) []*ledger {
	if central {
		return []*ledger{{name: "dispatcher"}}
	}
	ls := make([]*ledger, 0, len(producers)+1)
	for i, p := range producers {
		ls = append(ls, &ledger{idx: int32(i), name: p})
	}
	return append(ls, &ledger{idx: int32(len(producers)), name: submitters})
}

// ledgerOf is the ledger task t of st waits in.
func (s *sim) ledgerOf(st *stage, t *task) *ledger {
	if s.central() || t.producer < 0 || st.i == 0 {
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

// ledgerChanged follows whether tasks wait in ledger l of st (mesh): when
// they start to, gossip shows its dispatcher waiting a GossipDelay later
// (waitingSeen).
func (s *sim) ledgerChanged(st *stage, l *ledger) {
	on := l.q.queued > 0
	if s.central() || on == l.on {
		return
	}
	now := s.clk.now
	l.on = on
	if !on {
		l.offAt = now
		return
	}
	l.onAt, l.progressAt = now, now
	if !l.listed {
		l.listed = true
		st.waitingD = append(st.waitingD, l.idx)
	}
	s.clk.at(now+s.cfg.GossipDelay, event{kind: evWaitingSeen, stage: int8(st.i)})
}

// visibleWaiting is the dispatchers gossip shows with tasks of st waiting
// now: those whose tasks waited a GossipDelay ago (the ledger's last
// change of state told when), in s.waitNames, less those that declined a
// grant of wk's (nil: none) since gossip showed them anew
// (SlotBook.Declined). It drops from st.waitingD the ledgers gossip no
// longer shows.
func (s *sim) visibleWaiting(st *stage, wk *worker) []string {
	t := s.clk.now - s.cfg.GossipDelay
	names, keep := s.waitNames[:0], st.waitingD[:0]
	for _, d := range st.waitingD {
		l := st.ledgers[d]
		if !l.on && l.offAt <= t {
			l.listed = false
			continue
		}
		keep = append(keep, d)
		if l.onAt > t {
			continue
		}
		if wk != nil && wk.book.Declined(l.name, s.epoch.Add(l.onAt+s.cfg.GossipDelay)) {
			continue
		}
		names = append(names, l.name)
	}
	st.waitingD, s.waitNames = keep, names
	return names
}
