package routing

import (
	"slices"
	"sync"
	"time"
)

// SlotBook keeps, for one stage a worker works, what its credits
// (Credits) do not: to whom its free slots are promised, and when its busy
// slots should free. It is safe for concurrent use.
//
// A free slot has one owner at a time (GrantFreed and GrantIdle decide
// who: the dispatcher of the task that just ended, a dispatcher with work
// waiting, or a producer ahead of work), for a while (Promise): one party
// per slot is what keeps two tasks off one slot. A slot taken by a task
// from anyone but its owner ends the promise, and the owner is to be told
// (Take).
//
// When a busy slot frees is estimated from how long the worker's tasks of
// the stage have held a slot, so that a claim pushed to a busy worker is
// kept when it would start soon (QueuePolicy.GiveBack), and a short stage
// offers queue credit (Room).
type SlotBook struct {
	mu    sync.Mutex
	owner SlotGrant // whom the free slots are promised to; To "" for none
	until time.Time // when the promise lapses
	mean  time.Duration
	busy  map[uint64]time.Time // slots taken, by token: when each was taken
	next  uint64
	// declined: the dispatchers that declined a grant of these slots made
	// for work waiting (Declines), and when; pruned of those a minute old
	// at most once a minute (after prunedAt).
	declined map[string]time.Time
	prunedAt time.Time
}

// slotMeanWeight is the weight of the newest task in mean: an eighth, so
// one odd task moves the estimate little and a change of model within a
// few tasks.
const slotMeanWeight = 8

// NewSlotBook returns a book with no promise and no history.
func NewSlotBook() *SlotBook {
	return &SlotBook{busy: map[uint64]time.Time{}, declined: map[string]time.Time{}}
}

// Promise promises the free slots to g.To from now for g.TTL, and
// returns when that lapses.
func (b *SlotBook) Promise(g SlotGrant, now time.Time) time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.owner, b.until = g, now.Add(g.TTL)
	return b.until
}

// Promised is the grant the free slots are promised by at now, and when
// it lapses; the zero SlotGrant when they are not promised.
func (b *SlotBook) Promised(now time.Time) (SlotGrant, time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.owner.To == "" || !now.Before(b.until) {
		return SlotGrant{}, time.Time{}
	}
	return b.owner, b.until
}

// Decline records that from declined a grant of these slots made for work
// waiting there (Declines) at now, and ends the promise of the free slots
// to it, if they were so promised; it reports whether they were.
func (b *SlotBook) Decline(from string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.Sub(b.prunedAt) > time.Minute {
		b.prunedAt = now
		for d, at := range b.declined {
			if now.Sub(at) > time.Minute {
				delete(b.declined, d) // gossip has long shown it anew, or it left
			}
		}
	}
	b.declined[from] = now
	if b.owner.To != from || !b.owner.Waiting || !now.Before(b.until) {
		return false
	}
	b.owner = SlotGrant{}
	return true
}

// Declined reports whether dispatcher d declined a grant of these slots
// after since, when gossip last showed d anew: it is left out of the
// dispatchers with work waiting until gossip shows it again.
func (b *SlotBook) Declined(d string, since time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	at, ok := b.declined[d]
	return ok && at.After(since)
}

// Take records a slot taken at now by a task that from pushed or handed
// on. It ends the promise: revoke is its holder, when another took the
// slot (the holder's grant is void: its push would find the slot busy).
// done is called once the task gives its slot back, learn when it ran to
// its end: a task preempted, drained or failed early would make the mean
// say the stage is short, and workers keep tasks for short stages.
func (b *SlotBook) Take(from string, now time.Time) (revoke string, done func(end time.Time, learn bool)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if to := b.owner.To; to != "" && now.Before(b.until) && to != from {
		revoke = to
	}
	b.owner = SlotGrant{}
	tok := b.next
	b.next++
	b.busy[tok] = now
	var once sync.Once
	return revoke, func(end time.Time, learn bool) {
		once.Do(func() { b.free(tok, end, learn) })
	}
}

func (b *SlotBook) free(tok uint64, end time.Time, learn bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	held := end.Sub(b.busy[tok])
	delete(b.busy, tok)
	switch {
	case !learn:
	case b.mean == 0:
		b.mean = held
	default:
		b.mean += (held - b.mean) / slotMeanWeight
	}
}

// StartIn estimates how long from now the k-th task waiting for a slot
// (0: the first) waits: the busy slots free in the order they are due,
// each after mean, and a slot that frees takes the next task. Negative
// when it cannot tell: no task has ended here yet, or no slot is busy
// (the wait is for something else, such as admission).
func (b *SlotBook) StartIn(k int, now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return startIn(b.dueLocked(now), k, b.mean)
}

// MaxRoom bounds the queue credit a stage offers beyond its free slots:
// tasks that start within the hold (room).
const MaxRoom = 8

// Room is how many tasks beyond queued ones already waiting would start
// within hold from now (StartIn): the queue credit gossip offers
// producers when the stage's slots are busy. None while the wait cannot
// be told.
func (b *SlotBook) Room(queued int, hold time.Duration, now time.Time) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	due := b.dueLocked(now)
	n := 0
	for k := queued; n < MaxRoom; k++ {
		if in := startIn(due, k, b.mean); in < 0 || in > hold {
			break
		}
		n++
	}
	return n
}

// dueLocked is how long from now each busy slot should free, soonest
// first; nil when that cannot be told (no mean yet).
func (b *SlotBook) dueLocked(now time.Time) []time.Duration {
	if b.mean == 0 {
		return nil
	}
	due := make([]time.Duration, 0, len(b.busy))
	for _, at := range b.busy {
		due = append(due, max(0, at.Add(b.mean).Sub(now)))
	}
	slices.Sort(due)
	return due
}

// startIn is the k-th waiting task's wait when the busy slots free at due
// and each task then holds one mean; -1 with no slot due.
func startIn(due []time.Duration, k int, mean time.Duration) time.Duration {
	n := len(due)
	if n == 0 {
		return -1
	}
	return due[k%n] + time.Duration(k/n)*mean
}
