// Package progress carries the live step progress of running stages from
// the worker to whoever asks, peer to peer over libp2p, so that a sampler
// step costs etcd nothing. etcd says which node runs a job's stage (the
// progress key its claim writes); that node's Board says how far it is.
//
// A Board holds this agent's running stages and their latest step; Serve
// answers other agents' questions about it on ProtocolID, each a long poll
// ("the step after N, or wait up to W"); Ask is the client side. Nothing
// here is durable: a node that dies takes its steps with it, and its
// claim's expiry says the rest.
package progress

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// Step is how far one running stage of a job is on this node.
type Step struct {
	Stage string
	Step  int       // steps done, 1-based once the first is done; 0 before
	Total int       // steps in all (0 for a stage without steps)
	At    time.Time // when Step was reached (zero before the first)
	// Run tells runs of the job on this node apart (a retry starts a new
	// one, at step 0): when it started, in Unix nanoseconds.
	Run int64
}

// Cursor is how far an asker has seen a job's steps on a node: step Step
// of run Run. The zero Cursor has seen nothing; a Cursor of another run
// than the node's current one has seen none of its steps.
type Cursor struct {
	Run  int64
	Step int
}

// Board is the running stages of one agent, by job id. The zero value is
// not usable; NewBoard makes one. It is safe for concurrent use.
type Board struct {
	mu     sync.Mutex
	jobs   map[string]*entry
	linger time.Duration
}

// entry is one running stage; changed is closed (and replaced) whenever its
// step moves or the stage ends, which wakes every waiter at once.
type entry struct {
	step    Step
	changed chan struct{}
	ended   bool
}

// NewBoard returns an empty board.
func NewBoard() *Board { return &Board{jobs: map[string]*entry{}, linger: linger} }

// lastRun is the last run id handed out: a run is named by when it
// started (unique across restarts of the process), and ids only grow.
var lastRun atomic.Int64

func newRun() int64 {
	for {
		last, now := lastRun.Load(), time.Now().UnixNano()
		next := max(now, last+1)
		if lastRun.CompareAndSwap(last, next) {
			return next
		}
	}
}

// linger is how long an ended stage stays on the board, so that a
// follower asking after the last step still gets it.
const linger = 10 * time.Second

// Start puts a running stage of job on the board. report records a step
// (it never blocks: a map update under a lock); end marks the stage ended
// and wakes its waiters, and must be called once the stage stops running
// here, whatever the outcome. An ended stage's last step stays on the
// board for a while (linger). A second Start for the same job replaces the
// first (a new attempt on this node).
func (b *Board) Start(job, stage string, total int) (report func(step, total int), end func()) {
	e := &entry{step: Step{Stage: stage, Total: total, Run: newRun()}, changed: make(chan struct{})}
	b.mu.Lock()
	if old := b.jobs[job]; old != nil && !old.ended {
		old.ended = true
		close(old.changed)
	}
	b.jobs[job] = e
	b.mu.Unlock()
	report = func(step, total int) {
		b.mu.Lock()
		defer b.mu.Unlock()
		if e.ended {
			return
		}
		e.step.Step, e.step.Total, e.step.At = step, total, time.Now()
		close(e.changed)
		e.changed = make(chan struct{})
	}
	end = func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		if e.ended {
			return
		}
		e.ended = true
		close(e.changed)
		time.AfterFunc(b.linger, func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			if b.jobs[job] == e {
				delete(b.jobs, job)
			}
		})
	}
	return report, end
}

// Next waits until the job's step passes after (at once when after is of
// another run: all of this one is new to the asker), its stage ends here,
// or ctx is done, and returns the step as it then is. more is false when
// nothing past after will come from this node: no stage of the job runs
// here, or it ended at or before after.
func (b *Board) Next(ctx context.Context, job string, after Cursor) (st Step, more bool) {
	b.mu.Lock()
	e := b.jobs[job]
	b.mu.Unlock()
	if e == nil {
		return Step{}, false
	}
	for {
		b.mu.Lock()
		st, ended, ch := e.step, e.ended, e.changed
		b.mu.Unlock()
		switch {
		case st.Run != after.Run:
			return st, !ended || st.Step > 0
		case st.Step > after.Step:
			return st, true
		case ended:
			return st, false
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return st, true
		}
	}
}
