package routing

import (
	"sort"
	"time"
)

// Candidate is a queued task as the queue policy sees it.
type Candidate struct {
	ID       string
	Class    Class
	Enqueued time.Time
	Hint     string // preferred worker node id; "" = anyone
}

// QueuePolicy orders candidates for one worker.
type QueuePolicy struct {
	// AgingStep: each AgingStep a task waits lifts it one class, so batch work
	// queued long enough competes with fresh interactive work and never starves.
	AgingStep time.Duration
	// StealGrace: a task hinted to another worker is left to that worker this
	// long before others may take it (late binding with a preference).
	StealGrace time.Duration
}

// DefaultQueuePolicy lifts a task one class per 30 s of waiting (long next to
// an interactive image, short next to a batch job's patience) and lets others
// steal a hinted task after 250 ms (several claim round trips to etcd).
func DefaultQueuePolicy() QueuePolicy {
	return QueuePolicy{AgingStep: 30 * time.Second, StealGrace: 250 * time.Millisecond}
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

// Order returns the candidates worker self may take now, best first: lowest
// effective rank, then oldest. Tasks hinted to another worker within the
// steal grace are left out; the earliest time one of them becomes eligible is
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
	sort.SliceStable(ordered, func(i, j int) bool {
		ri, rj := p.effectiveRank(ordered[i], now), p.effectiveRank(ordered[j], now)
		if ri != rj {
			return ri < rj
		}
		// A worker's own hinted work first among equals: it is why it was hinted.
		hi, hj := ordered[i].Hint == self, ordered[j].Hint == self
		if hi != hj {
			return hi
		}
		return ordered[i].Enqueued.Before(ordered[j].Enqueued)
	})
	return ordered, retryAt
}
