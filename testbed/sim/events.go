package sim

import (
	"container/heap"
	"time"
)

type evKind uint8

const (
	evArrive      evKind = iota // a job arrives at an agent's API (or the dispatcher)
	evEnqueue                   // its first task is in the queue (mesh: the submit txn landed)
	evWake                      // mesh: a stage's waiting workers wake from their watch
	evClaimed                   // mesh: a worker's claim landed, or it took a pushed one / central: a GPU got its assignment
	evDone                      // a stage's compute finished; the commit (or report) starts
	evCommitted                 // mesh: the commit landed / central: the dispatcher took the report
	evDispatch                  // central: the dispatcher assigns queued tasks to free GPUs
	evTick                      // each simulated second: per-agent background etcd traffic
	evGiveBack                  // mesh: a pushed claim's worker looks whether to give it back
	evRequeued                  // mesh: a pushed claim's give-back landed
	evGrantEnds                 // mesh: a free worker's promise of its slot runs out
	evWaitingSeen               // mesh: gossip shows a dispatcher with work waiting
	evWaitingGone               // mesh: gossip shows a dispatcher with none waiting
	evAssigned                  // mesh: a dispatcher's hand-on against queue credit landed in a busy worker's inbox
	evDeclined                  // mesh: a dispatcher's decline of a grant for work waiting reached its worker
	evOffered                   // mesh: a pushed claim's offer reached its worker, ahead of its write
	evPreemptDue                // a queued interactive denoise task has waited PreemptAfter
	evHandedOn                  // mesh: a dispatcher's hand-on of a due task to a worker that gives way landed
	evStopped                   // a preempted task stopped at its step's end, checkpointed
	evStealAsked                // Config.Steal: an idle worker's request for a claim reached its peer
	evStolen                    // Config.Steal: the peer's hand-over of a claim to it landed
)

// event is one scheduled happening. seq breaks ties in scheduling order, so
// a run is deterministic.
type event struct {
	at     time.Duration
	seq    uint64
	kind   evKind
	stage  int8
	worker int32
	task   *task
	run    uint32 // evDone, evStopped: the task's run they end (task.run)
	thief  int32  // evStealAsked, evStolen: the idle worker asking
	disp   int32  // evDeclined: the declining dispatcher's ledger
}

// eventQueue is a min-heap on (at, seq).
type eventQueue []event

func (q eventQueue) Len() int { return len(q) }
func (q eventQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q eventQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *eventQueue) Push(x any)   { *q = append(*q, x.(event)) }
func (q *eventQueue) Pop() any {
	old := *q
	n := len(old)
	e := old[n-1]
	old[n-1] = event{}
	*q = old[:n-1]
	return e
}

// clock owns simulated time and the event queue.
type clock struct {
	now    time.Duration
	seq    uint64
	events eventQueue
	count  uint64 // events handled
}

func (c *clock) at(t time.Duration, e event) {
	if t < c.now {
		t = c.now
	}
	e.at = t
	c.seq++
	e.seq = c.seq
	heap.Push(&c.events, e)
}

func (c *clock) next() (event, bool) {
	if len(c.events) == 0 {
		return event{}, false
	}
	e := heap.Pop(&c.events).(event)
	c.now = e.at
	c.count++
	return e, true
}
