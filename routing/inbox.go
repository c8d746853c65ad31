package routing

import (
	"slices"
	"time"
)

// A worker's turn over the claims pushed to it (its inbox): which one it
// starts when a slot is free (Pick), and, when it cannot start them, which
// it gives back and when it looks again (Returns). The agent's worker loop
// (agent/worker.go, push.go) and the simulator's workers (testbed/sim)
// both take their turns by these two, so the decisions the simulator's
// figures rest on are the agent's own code, not a model of it.

// Pushed is a claim pushed to a worker that the worker has not started.
type Pushed struct {
	Candidate
	// At is when the claim was made for the worker.
	At time.Time
	// NotBefore: the task may not start before then (a retry's backoff).
	NotBefore time.Time
	// Offered: the claim came ahead of its write (QueuePolicy.Offer),
	// which has not confirmed it yet. The worker may start it, but it is
	// nothing to give back: nothing in etcd says it is the worker's.
	Offered bool
}

// LookAgain is how soon a worker that keeps a pushed claim past its steal
// grace looks again whether to give it back (a peer that joins, or a
// slot clock that moves, can change the answer; neither wakes it).
const LookAgain = time.Second

// Pick chooses the claim that worker self starts with a free slot: the
// first, in the policy's order (Order), that may start now (NotBefore)
// and whose output has room (fits; nil: all have). pick is its index in
// pushed, -1 for none; full reports that some could start but none has
// room, so the worker says it is blocked rather than free; wake is when a
// claim held back by the clock becomes eligible (zero: none is).
func (p QueuePolicy) Pick(pushed []Pushed, self string, now time.Time, fits func(i int) bool) (pick int, full bool, wake time.Time) {
	pick = -1
	for i := range pushed {
		h := &pushed[i]
		if h.NotBefore.After(now) {
			wake = earliest(wake, h.NotBefore)
			continue
		}
		if at, back := p.leftToHint(h.Candidate, self, now); back {
			wake = earliest(wake, at)
			continue
		}
		if fits != nil && !fits(i) {
			full = true
			continue
		}
		// The first of equals wins, as Order's stable sort has it.
		if pick < 0 || p.before(h.Candidate, pushed[pick].Candidate, self, now) {
			pick = i
		}
	}
	return pick, full && pick < 0, wake
}

// Return is a pushed claim a worker gives back (Returns).
type Return struct {
	Index int // in the pushed claims
	// Stranded: interactive work the worker can neither start nor make
	// room for (Stranded), for its dispatcher to bring to a worker that
	// gives way. Otherwise the worker has no slot for it soon (GiveBack).
	Stranded bool
}

// Returns is the look over the claims pushed to a worker that it cannot
// start now (no free slot, or admission holds its stage back): which it
// gives back to their dispatchers, and next, when to look again by the
// clock alone (zero: nothing waits for it). They would start in the order
// they came, so the k-th oldest is asked about the worker's k-th next
// slot (SlotBook.StartIn). others says the stage has a live worker
// besides this one; canPreempt that this worker runs only batch work it
// could give way with (Stranded).
func (p QueuePolicy) Returns(pushed []Pushed, now time.Time, others, canPreempt bool, book *SlotBook) (back []Return, next time.Time) {
	byPush := func(x, y Pushed) int { return x.At.Compare(y.At) }
	var order []int // nil: pushed is in push order already (the simulator's)
	if !slices.IsSortedFunc(pushed, byPush) {
		order = make([]int, len(pushed))
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(x, y int) int { return byPush(pushed[x], pushed[y]) })
	}
	for k := range pushed {
		i := k
		if order != nil {
			i = order[k]
		}
		h := &pushed[i]
		if h.Offered {
			continue // not written yet: its write's event brings the worker back
		}
		stranded, at := p.Stranded(h.Candidate, now, canPreempt)
		if stranded {
			back = append(back, Return{Index: i, Stranded: true})
			continue
		}
		next = earliest(next, at)
		if due := h.At.Add(p.StealGrace); due.After(now) {
			next = earliest(next, due) // within the grace: nothing to ask yet
			continue
		}
		if p.GiveBack(h.At, now, others, book.StartIn(k, now)) {
			back = append(back, Return{Index: i})
			continue
		}
		// Due, but this is the stage's only worker, or a slot frees soon.
		next = earliest(next, now.Add(LookAgain))
	}
	return back, next
}

// Spare chooses the claim pushed to worker self that it hands to an idle
// peer of its stage asking for work (a steal: a proposal the agent does
// not make yet; `latentmesh-dev sim --steal` measures it): the one it
// would start last in the policy's order, among those written (an offered
// claim is nothing etcd says is its to hand over). A worker that is not
// busy keeps the claim it would start now. -1: none to spare.
func (p QueuePolicy) Spare(pushed []Pushed, self string, now time.Time, busy bool) int {
	spare, n := -1, 0
	for i := range pushed {
		h := &pushed[i]
		if h.Offered {
			continue
		}
		n++
		if spare < 0 || !p.before(h.Candidate, pushed[spare].Candidate, self, now) {
			spare = i // the later of equals: the first of them starts first
		}
	}
	if !busy && n < 2 {
		return -1
	}
	return spare
}

// leftToHint reports whether candidate c is left to the worker it is hinted
// to, within the steal grace, and when that ends: worker self may not
// take it before.
func (p QueuePolicy) leftToHint(c Candidate, self string, now time.Time) (time.Time, bool) {
	if c.Hint == "" || c.Hint == self {
		return time.Time{}, false
	}
	free := c.Enqueued.Add(p.StealGrace)
	return free, now.Before(free)
}

// earliest is the earlier of two times, zero meaning none.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}
