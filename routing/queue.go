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
	// Node is, for a running task (Preempt), the worker running it.
	Node string
	// Preempted is when the task was last given back for interactive work
	// (Preempt); zero if never.
	Preempted time.Time
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
	// batch work runs makes one worker that runs only batch work requeue
	// one batch task (Preempt). Zero turns preemption off.
	PreemptAfter time.Duration
	// PreemptGrace: a slot freed by a preemption is counted as on its way
	// to the interactive task it was freed for this long (the freeing
	// worker's claim of it), so no second worker gives way for the same
	// task meanwhile.
	PreemptGrace time.Duration
	// HoldFor: a worker keeps a task pushed to it that it cannot start
	// yet when it expects to start it within HoldFor (GiveBack): a short
	// stage's next slot frees sooner than the task would reach another.
	HoldFor time.Duration
	// Push: a new task's creator claims it for its hinted worker in the
	// same write, when the hint has a free slot, instead of leaving it for
	// the worker to claim. The hinted worker starts it without a claim
	// transaction of its own, and nobody races for it. A pushed task its
	// worker cannot start is given back (GiveBack).
	Push bool
	// Offer: with Push, the claim is also sent to its worker over libp2p
	// as the write goes, and the worker starts the task before the write
	// answers; its fenced writes wait for the write (agent/jobs, offer.go).
	// A handoff then waits for one message, not for a raft write and its
	// watch event.
	Offer bool
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
		PreemptGrace: time.Second, // a claim takes milliseconds; a second is ample on a loaded etcd
		HoldFor:      time.Second, // a give-back's writes and grant take about as long under load
		Push:         true,        // a handoff is one etcd write, not two
		Offer:        true,        // and starts before that write answers
	}
}

// GiveBack decides whether a worker should return a task pushed to it at
// pushed (Push) that it has not started by now, and expects to start in
// startIn (negative: it cannot tell): once it has waited StealGrace, as
// long as another worker of the stage could run it (others), unless it
// starts within HoldFor. The worker hands it over to one with a free
// slot when there is one; otherwise it goes back to the queue, where the
// first worker to free a slot takes it, rather than wait for this one.
// (Keeping it until another is free cost a 10-GPU pool 29 to 69 ms of
// dispatch per job in the simulator: a claim looks again only every
// second.) A stage's only worker keeps it. A short wait is kept: going
// back costs two etcd writes and a read (the give-back, the hand-on, its
// commit's read of the job record), and a grant's round trip.
func (p QueuePolicy) GiveBack(pushed, now time.Time, others bool, startIn time.Duration) bool {
	return others && !now.Before(pushed.Add(p.StealGrace)) && (startIn < 0 || startIn > p.HoldFor)
}

// Stranded decides whether a worker should return interactive task c,
// pushed to it, that it can neither start (no free slot) nor make room for
// (its slots run work other than batch, so it has no batch task to give
// way): once c is due for preemption (waited PreemptAfter), only the
// stage's preemption can serve it, and that matches queued tasks (Preempt),
// not claimed ones. It returns the time to ask again (zero: never).
func (p QueuePolicy) Stranded(c Candidate, now time.Time, canPreempt bool) (back bool, at time.Time) {
	if p.Scheduler == FIFO || p.PreemptAfter <= 0 || c.Class != Interactive || canPreempt {
		return false, time.Time{}
	}
	due := c.Enqueued.Add(p.PreemptAfter)
	if now.Before(due) {
		return false, due
	}
	return true, time.Time{}
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
		if free, back := p.leftToHint(c, self, now); back {
			retryAt = earliest(retryAt, free)
			continue
		}
		ordered = append(ordered, c)
	}
	sort.SliceStable(ordered, func(i, j int) bool { return p.before(ordered[i], ordered[j], self, now) })
	return ordered, retryAt
}

// Preempt decides whether worker self should give one of its running tasks
// back for interactive work kept waiting:
//
//   - queued are tasks waiting for a slot (any class): the agent passes the
//     claims pushed to it, which a dispatcher with interactive work past
//     its time sends to a worker running batch work; the interactive ones
//     that have waited PreemptAfter are due, most urgent first;
//   - a due task is already served by a slot freed for it: one per queued
//     task preempted within PreemptGrace (its worker is taking the due
//     task), so only the rest need a slot;
//   - running are the running tasks, each with its worker (Node);
//     the victims are the batch tasks of workers that run nothing but batch
//     work, served last first (the least aged loses the least);
//   - the k-th due task that still needs a slot takes the k-th victim, if it
//     is served before it under this policy (a batch task aged up to
//     interactive keeps its slot).
//
// self gives way only when its own task is matched: one due task costs one
// batch task, not one per worker that sees it. It returns "" when self has
// nothing to give, and then wake, the next time the answer may change by
// the clock alone (a waiting task comes due, a freed slot's grace ends;
// zero: never), so the caller sleeps until then rather than polls. FIFO
// never preempts.
func (p QueuePolicy) Preempt(queued, running []Candidate, self string, now time.Time) (victim string, wake time.Time) {
	matched, wake := p.Victims(queued, running, now)
	for _, v := range matched {
		if v.Node == self {
			return v.ID, time.Time{}
		}
	}
	return "", wake
}

// Victims is Preempt for the whole stage: the running tasks that give way
// for the due tasks in queued, the k-th for the k-th due task that still
// needs a slot, as every worker ranks them (a central dispatcher, which
// sees every worker, stops them itself; a mesh worker stops its own,
// Preempt), and wake as Preempt's.
func (p QueuePolicy) Victims(queued, running []Candidate, now time.Time) (matched []Candidate, wake time.Time) {
	if p.Scheduler == FIFO || p.PreemptAfter <= 0 {
		return nil, time.Time{}
	}
	later := func(t time.Time) {
		if t.After(now) && (wake.IsZero() || t.Before(wake)) {
			wake = t
		}
	}
	var due []Candidate
	freed := 0
	for _, q := range queued {
		if !q.Preempted.IsZero() && now.Before(q.Preempted.Add(p.PreemptGrace)) {
			freed++
			later(q.Preempted.Add(p.PreemptGrace))
		}
		if q.Class != Interactive {
			continue
		}
		if at := q.Enqueued.Add(p.PreemptAfter); now.Before(at) {
			later(at)
			continue
		}
		due = append(due, q)
	}
	if len(due) <= freed {
		return nil, wake
	}
	// Every worker must rank alike: no worker's own hints count here.
	before := func(a, b Candidate) bool { return p.before(a, b, "", now) }
	sort.Slice(due, func(i, j int) bool {
		if before(due[i], due[j]) != before(due[j], due[i]) {
			return before(due[i], due[j])
		}
		return due[i].ID < due[j].ID
	})
	due = due[freed:]

	// Workers that run anything but batch work keep their slots.
	mixed := map[string]bool{}
	for _, r := range running {
		if r.Class != Batch {
			mixed[r.Node] = true
		}
	}
	var victims []Candidate
	for _, r := range running {
		if !mixed[r.Node] {
			victims = append(victims, r)
		}
	}
	sort.Slice(victims, func(i, j int) bool {
		if before(victims[i], victims[j]) != before(victims[j], victims[i]) {
			return before(victims[j], victims[i])
		}
		return victims[i].ID < victims[j].ID
	})
	for k := 0; k < len(due) && k < len(victims); k++ {
		if !before(due[k], victims[k]) {
			break // served after this victim, so after every later one too
		}
		matched = append(matched, victims[k])
	}
	return matched, wake
}
