package agent

import (
	"slices"
	"sync"
	"time"
)

// slotBook keeps, for one stage this agent works, what its credits
// (routing.Credits) do not: to whom its free slots are promised ahead of
// work, and when its busy slots should free.
//
// A promise is a grant of the free slots to one producer of the stage's
// input (grants.go), made when no dispatcher has work waiting for them:
// that producer pushes its next task here against it, and no other
// producer is promised them until the promise is spent or lapses
// (routing.GrantTTL). One producer per slot is what keeps two pushes off
// one slot. A slot taken by any other task (a dispatcher's hand-on of
// waiting work, which comes first) ends the promise, and its holder is
// told.
//
// When a busy slot frees is estimated from how long this agent's tasks of
// the stage have held a slot, so that a claim pushed to a busy worker is
// kept when it would start soon (routing.QueuePolicy.GiveBack).
type slotBook struct {
	mu    sync.Mutex
	to    string    // the producer the free slots are promised to; "" for none
	until time.Time // when the promise lapses
	mean  time.Duration
	busy  map[uint64]time.Time // slots taken, by token: when each was taken
	next  uint64
}

// slotMeanWeight is the weight of the newest task in mean: an eighth, so
// one odd task moves the estimate little and a change of model within a
// few tasks.
const slotMeanWeight = 8

func newSlotBook() *slotBook { return &slotBook{busy: map[uint64]time.Time{}} }

// promise promises the free slots to to from now for ttl, and returns
// when that lapses.
func (b *slotBook) promise(to string, now time.Time, ttl time.Duration) time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.to, b.until = to, now.Add(ttl)
	return b.until
}

// promised is the producer the free slots are promised to at now, and
// when that lapses; "" when they are not.
func (b *slotBook) promised(now time.Time) (string, time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.to == "" || !now.Before(b.until) {
		return "", time.Time{}
	}
	return b.to, b.until
}

// take records a slot taken at now by a task that from pushed or handed
// on. It ends the promise: revoke is its holder, when another took the
// slot (the holder's grant is void: its push would find the slot busy).
// done is called once the task gives its slot back, learn when it ran to
// its end: a task preempted, drained or failed early would make the mean
// say the stage is short, and workers keep tasks for short stages.
func (b *slotBook) take(from string, now time.Time) (revoke string, done func(end time.Time, learn bool)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.to != "" && now.Before(b.until) && b.to != from {
		revoke = b.to
	}
	b.to = ""
	tok := b.next
	b.next++
	b.busy[tok] = now
	var once sync.Once
	return revoke, func(end time.Time, learn bool) {
		once.Do(func() { b.free(tok, end, learn) })
	}
}

func (b *slotBook) free(tok uint64, end time.Time, learn bool) {
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

// startIn estimates how long from now the k-th task waiting for a slot
// (0: the first) waits: the busy slots free in the order they are due,
// each after mean, and a slot that frees takes the next task. Negative
// when it cannot tell: no task has ended here yet, or no slot is busy
// (the wait is for something else, such as admission).
func (b *slotBook) startIn(k int, now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mean == 0 || len(b.busy) == 0 {
		return -1
	}
	ends := make([]time.Duration, 0, len(b.busy))
	for _, at := range b.busy {
		ends = append(ends, max(0, at.Add(b.mean).Sub(now)))
	}
	slices.Sort(ends)
	n := len(ends)
	return ends[k%n] + time.Duration(k/n)*b.mean
}

// maxRoom bounds the queue credit a stage offers beyond its free slots:
// tasks that start within the hold (room).
const maxRoom = 8

// room is how many tasks beyond queued ones already waiting would start
// within hold from now (startIn): the queue credit gossip offers
// producers when the stage's slots are busy. None while the wait cannot
// be told.
func (b *slotBook) room(queued int, hold time.Duration, now time.Time) int {
	n := 0
	for k := queued; n < maxRoom; k++ {
		if in := b.startIn(k, now); in < 0 || in > hold {
			break
		}
		n++
	}
	return n
}
