package routing

import (
	"errors"
	"sync"
)

// ErrNoCredit is returned by TryAcquire when every slot is taken.
var ErrNoCredit = errors.New("routing: no credit")

// Credits is one agent's ledger of work slots for one stage: a worker pulls
// a task only while it holds a credit, and returns it when the task is done.
// It is safe for concurrent use.
type Credits struct {
	// mu guards the fields below.
	mu    sync.Mutex
	total int
	used  int
	freed chan struct{} // closed and replaced whenever a credit comes back
}

// NewCredits returns a ledger of n slots.
func NewCredits(n int) *Credits {
	return &Credits{total: n, freed: make(chan struct{})}
}

// TryAcquire takes a credit or returns ErrNoCredit.
func (c *Credits) TryAcquire() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.used >= c.total {
		return ErrNoCredit
	}
	c.used++
	return nil
}

// Release returns a credit taken by TryAcquire.
func (c *Credits) Release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.used == 0 {
		panic("routing: credit released twice")
	}
	c.used--
	close(c.freed)
	c.freed = make(chan struct{})
}

// Free is the number of credits available now.
func (c *Credits) Free() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total - c.used
}

// InUse is the number of credits held.
func (c *Credits) InUse() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.used
}

// Total is the ledger's size.
func (c *Credits) Total() int { return c.total }

// Freed returns a channel closed the next time a credit is released, so a
// waiting worker sleeps instead of polling.
func (c *Credits) Freed() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.freed
}
