package routing

import (
	"fmt"
	"sort"
	"time"
)

// Candidate is a queued (or, for Preempt, running) task as the queue policy
// sees it.
type Candidate struct {
	ID       string
	Class    Class
	Enqueued time.Time
	// Deadline is when the request wants its result; zero for none. Within
	// an effective class the earliest deadline goes first.
	Deadline time.Time
	Hint     string // preferred worker node id; "" = anyone
}

// Scheduler is how a queue is ordered.
type Scheduler uint8

// Schedulers.
const (
	// Priority orders by class (lifted by aging), then earliest deadline,
	// then age: the default.
	Priority Scheduler = iota
	// FIFO orders by enqueue time alone, ignoring class and deadline: a
	// baseline to measure Priority against. It never preempts.
	FIFO
)

func (s Scheduler) String() string {
	if s == FIFO {
		return "fifo"
	}
	return "priority"
}

// ParseScheduler reads "priority" (or "") and "fifo".
func ParseScheduler(s string) (Scheduler, error) {
	switch s {
	case "", "priority":
		return Priority, nil
	case "fifo":
		return FIFO, nil
	}
	return 0, fmt.Errorf("routing: unknown scheduler %q (want priority or fifo)", s)
}

// QueuePolicy orders candidates for one worker.
type QueuePolicy struct {
	// Scheduler picks the order: Priority (class, deadline, age) or FIFO.
	Scheduler Scheduler
	// AgingStep: each AgingStep a task waits lifts it one class, so batch work
	// queued long enough competes with fresh interactive work and never starves.
	AgingStep time.Duration
	// StealGrace: a task hinted to another worker is left to that worker this
	// long before others may take it (late binding with a preference).
	StealGrace time.Duration
	// PreemptAfter: an interactive task that has waited this long while
	// every slot of a worker runs batch work makes that worker requeue one
	// batch task (Preempt). Zero turns preemption off.
	PreemptAfter time.Duration
	// Push: a new task's creator claims it for its hinted worker in the
	// same write, when the hint has a free slot, instead of leaving it for
	// the worker to claim. The hinted worker starts it without a claim
	// transaction of its own, and nobody races for it. A pushed task its
	// worker cannot start is given back (GiveBack).
	Push bool
}

// DefaultQueuePolicy lifts a task one class per 30 s of waiting (long next to
// an interactive image, short next to a batch job's patience), lets others
// steal a hinted task after 250 ms (several claim round trips to etcd), and
// preempts batch work for an interactive task kept waiting 2 s (an
// interactive image is a few seconds of denoise; waiting out a batch video
// is not).
func DefaultQueuePolicy() QueuePolicy {
	return QueuePolicy{
		Scheduler:    Priority,
		AgingStep:    30 * time.Second,
		StealGrace:   250 * time.Millisecond,
		PreemptAfter: 2 * time.Second,
		Push:         true, // a handoff is one etcd write, not two
	}
}

// GiveBack decides whether a worker should return a task pushed to it at
// pushed (Push) that it has not started by now, to the queue for others:
// once it has waited StealGrace, as long as another worker of the stage
// has a free slot (otherwise the task would only wait in the queue
// instead, and returning it costs two writes: the give-back, then a
// claim).
func (p QueuePolicy) GiveBack(pushed, now time.Time, otherFree bool) bool {
	return otherFree && !now.Before(pushed.Add(p.StealGrace))
}

// effectiveRank is the class rank minus whole aging steps waited.
func (p QueuePolicy) effectiveRank(c Candidate, now time.Time) float64 {
	rank := float64(c.Class)
	if p.AgingStep > 0 {
		waited := now.Sub(c.Enqueued)
		if waited > 0 {
			rank -= float64(waited / p.AgingStep)
		}
	}
	return rank
}

// before reports whether a is served before b at now, by the policy's
// scheduler, for worker self.
func (p QueuePolicy) before(a, b Candidate, self string, now time.Time) bool {
	if p.Scheduler == FIFO {
		if !a.Enqueued.Equal(b.Enqueued) {
			return a.Enqueued.Before(b.Enqueued)
		}
		return a.ID < b.ID
	}
	ra, rb := p.effectiveRank(a, now), p.effectiveRank(b, now)
	if ra != rb {
		return ra < rb
	}
	// Earliest deadline first; a task with a deadline before one without.
	if da, db := a.Deadline, b.Deadline; !da.Equal(db) {
		switch {
		case da.IsZero():
			return false
		case db.IsZero():
			return true
		}
		return da.Before(db)
	}
	// A worker's own hinted work first among equals: it is why it was hinted.
	ha, hb := a.Hint == self, b.Hint == self
	if ha != hb {
		return ha
	}
	return a.Enqueued.Before(b.Enqueued)
}

// Order returns the candidates worker self may take now, best first: by
// Priority, lowest effective rank (class lifted one step per AgingStep
// waited), then earliest deadline, then the worker's own hinted tasks, then
// oldest; by FIFO, oldest. Tasks hinted to another worker within the steal
// grace are left out; the earliest time one of them becomes eligible is
// returned as retryAt (zero when none is held back), so the caller can sleep
// exactly until then instead of polling.
func (p QueuePolicy) Order(cands []Candidate, self string, now time.Time) (ordered []Candidate, retryAt time.Time) {
	ordered = make([]Candidate, 0, len(cands))
	for _, c := range cands {
		if c.Hint != "" && c.Hint != self {
			if free := c.Enqueued.Add(p.StealGrace); now.Before(free) {
				if retryAt.IsZero() || free.Before(retryAt) {
					retryAt = free
				}
				continue
			}
		}
		ordered = append(ordered, c)
	}
	sort.SliceStable(ordered, func(i, j int) bool { return p.before(ordered[i], ordered[j], self, now) })
	return ordered, retryAt
}

// Preempt decides whether a worker whose every slot is busy should give one
// running task back to the queue for a waiting one: only when every running
// task is batch work, and an interactive task has waited at least
// PreemptAfter and is served before the batch task under this policy (a
// batch task aged up to interactive keeps its slot). The victim is the
// running batch task served last (the least aged: it loses the least
// waiting). It returns "" when nothing is to be preempted, and then wake,
// the next time a waiting interactive task crosses PreemptAfter (zero: none
// will), so the caller sleeps until then rather than polls. FIFO never
// preempts.
func (p QueuePolicy) Preempt(waiting, running []Candidate, self string, now time.Time) (victim string, wake time.Time) {
	if p.Scheduler == FIFO || p.PreemptAfter <= 0 || len(running) == 0 {
		return "", time.Time{}
	}
	var last *Candidate
	for i := range running {
		r := &running[i]
		if r.Class != Batch {
			return "", time.Time{}
		}
		if last == nil || p.before(*last, *r, self, now) {
			last = r
		}
	}
	for _, w := range waiting {
		if w.Class != Interactive {
			continue
		}
		due := w.Enqueued.Add(p.PreemptAfter)
		if now.Before(due) {
			if wake.IsZero() || due.Before(wake) {
				wake = due
			}
			continue
		}
		if p.before(w, *last, self, now) {
			return last.ID, time.Time{}
		}
	}
	return "", wake
}
