package sim

import (
	"math"
	"sort"
	"strconv"
	"time"

	"github.com/latentmesh/latentmesh/routing"
)

// job is one simulated generation.
type job struct {
	id        int
	class     routing.Class
	arrive    time.Duration
	queueing  time.Duration // summed over stages: task available until claimed
	overhead  time.Duration // summed over stages: the control plane's part of it
	completed int
}

// task is one stage of a job in a queue.
type task struct {
	job      *job
	stage    int
	enq      time.Duration // in the queue (visible to workers) from here
	avail    time.Duration // could have run from here: the previous stage's compute ended
	hint     int32         // worker index in the stage, -1 = none
	claimed  bool          // claimed (mesh) or assigned (central)
	gone     bool          // committed: its key is deleted
	reported bool          // central: the dispatcher has taken in its report

	// Pushed claims (mesh with Queue.Push).
	pushTo   int32         // the worker its creator pushed its claim to, -1 = none
	pushedAt time.Duration // when the creator wrote it (the claim's StartedAt)
	pushed   bool          // the pushed claim waits: neither started nor given back
	fromPush bool          // started from a pushed claim
	// Offered claims (Queue.Offer): the claim reached its worker by its
	// writer's message, ahead of the write; confirmAt is when the write's
	// event reaches the worker's inbox, before which its worker's fenced
	// writes (its commit) wait. offered: its task is its worker's
	// already, and the write's landing only counts its events.
	offered   bool
	confirmAt time.Duration
	// next is the next stage's task, made at this one's end when its
	// commit offers it (the write creates it later).
	next *task
	// What this task's worker picks for the next stage's task: the hint
	// (agent: pickHint in run) and the push target (pushTarget in commit).
	nextHint, nextPush int32
	doneAt             time.Duration // its compute ended; its commit began
	// producer is the previous stage's worker that created it (-1: a
	// submit): the producer its worker grants its slot to when the task
	// ends (affinity, agent.grantFreed).
	producer int32
	// inFIFO: it is in its stage queue's FIFO (stageQueue), claimed or
	// not.
	inFIFO bool

	// Preemption (denoise). run counts its starts, so that the end of a
	// run that was stopped is told from the end of a later one; runStart
	// and runEnd bound its compute in the current run; left is the
	// compute still to do when it starts again (0: the stage's whole),
	// resumed from the checkpoint it stopped at. preemptedAt is when it
	// was last stopped (preempted: ever), which routing counts
	// (Candidate.Preempted). handedOn: its claim was a dispatcher's
	// hand-on to a worker that gives way, not its creator's push;
	// assigned: a dispatcher's hand-on against queue credit (assignQueued).
	run              uint32
	runStart, runEnd time.Duration
	left             time.Duration
	preempted        bool
	preemptedAt      time.Duration
	handedOn         bool
	assigned         bool
}

// byDispatcher reports whether t's claim in its worker's inbox was a
// dispatcher's hand-on, not written with the record by its creator: its
// producer checks the claim before it issues a ticket, and its commit
// reads the job record first.
func (t *task) byDispatcher() bool { return t.handedOn || t.assigned }

// candidate is t as routing sees it (scan names the tasks it lists by
// index, inboxOf the claims by place).
func (t *task) candidate(id, hint string, epoch time.Time) routing.Candidate {
	c := routing.Candidate{ID: id, Class: t.job.class, Enqueued: epoch.Add(t.enq), Hint: hint}
	if t.preempted {
		c.Preempted = epoch.Add(t.preemptedAt)
	}
	return c
}

// stageQueue is a stage's task keys in etcd's key order: class, then
// enqueue time. Enqueue times rise within a class (no retries are
// modelled; a pushed claim given back keeps its key and goes back in its
// place, insert), so one FIFO per class is that order. A pushed task is
// claimed from its creation, so it joins the FIFO only when given back. A
// task leaves it when its key is deleted (commit); a claimed task's key
// stays in etcd, but no view offers it again, so it leaves the FIFO's head
// too.
type stageQueue struct {
	byClass [3][]*task
	head    [3]int
	queued  int // unclaimed tasks
}

func (q *stageQueue) push(t *task) {
	c := t.job.class
	q.byClass[c] = append(q.byClass[c], t)
	t.inFIFO = true
	q.queued++
}

// requeue puts back a task given back to the queue (a pushed claim
// returned, a preempted task): its key, and so its place in key order (its
// enqueue time), is kept. One claimed from the queue may still be there,
// behind the head, where it is offered again; else it is inserted (it is
// at least a steal grace old, so near the tail of a long queue).
func (q *stageQueue) requeue(t *task) {
	if !t.inFIFO {
		q.insert(t)
		return
	}
	q.queued++
}

// insert puts t in its place in key order (its enqueue time), behind the
// head.
func (q *stageQueue) insert(t *task) {
	c := t.job.class
	s, h := q.byClass[c], q.head[c]
	i := h + sort.Search(len(s)-h, func(k int) bool { return s[h+k].enq > t.enq })
	s = append(s, nil)
	copy(s[i+1:], s[i:])
	s[i] = t
	q.byClass[c] = s
	t.inFIFO = true
	q.queued++
}

// compact drops claimed or deleted tasks at the head.
func (q *stageQueue) compact(c int) {
	s, h := q.byClass[c], q.head[c]
	for h < len(s) && (s[h].gone || s[h].claimed) {
		s[h].inFIFO = false
		s[h] = nil
		h++
	}
	if h > 1024 && h > len(s)/2 {
		n := copy(s, s[h:])
		clear(s[n:])
		s, h = s[:n], 0
	}
	q.byClass[c], q.head[c] = s, h
}

// scan is what the dispatchers' ledgers offer: the unclaimed tasks, here
// the oldest perClass of each class (Config.ScanPerClass), in key order
// (a task given back or stopped keeps its place). A dispatcher leaves
// hints out of its order (the worker one names matters only among that
// worker's own claims), so none is given.
func (q *stageQueue) scan(perClass int, epoch time.Time, cands []routing.Candidate, tasks []*task) ([]routing.Candidate, []*task) {
	cands, tasks = cands[:0], tasks[:0]
	add := func(t *task) {
		cands = append(cands, t.candidate(indexID(len(tasks)), "", epoch))
		tasks = append(tasks, t)
	}
	for c := range q.byClass {
		q.compact(c)
		s := q.byClass[c]
		for i, n := q.head[c], 0; i < len(s) && n < perClass; i++ {
			if t := s[i]; !t.gone && !t.claimed {
				add(t)
				n++
			}
		}
	}
	return cands, tasks
}

var indexIDs = func() []string {
	s := make([]string, 4096)
	for i := range s {
		s[i] = strconv.Itoa(i)
	}
	return s
}()

func indexID(i int) string {
	if i < len(indexIDs) {
		return indexIDs[i]
	}
	return strconv.Itoa(i)
}

func idIndex(id string) int {
	n, err := strconv.Atoi(id)
	if err != nil {
		panic("sim: candidate id " + id) // only indexID makes them
	}
	return n
}

// histogram keeps durations in buckets 1% wide, so percentiles of millions
// of jobs take little memory and no sort.
type histogram struct {
	counts map[int]uint64
	n      uint64
}

const histBase = 1.01

func bucketOf(d time.Duration) int {
	if d < time.Microsecond {
		return -1
	}
	return int(math.Log(float64(d)/float64(time.Microsecond)) / math.Log(histBase))
}

func (h *histogram) add(d time.Duration) {
	if h.counts == nil {
		h.counts = map[int]uint64{}
	}
	h.counts[bucketOf(d)]++
	h.n++
}

// quantile is the upper edge of the bucket holding quantile q.
func (h *histogram) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	lo, hi := math.MaxInt, math.MinInt
	for b := range h.counts {
		lo, hi = min(lo, b), max(hi, b)
	}
	want := uint64(math.Ceil(q * float64(h.n)))
	var seen uint64
	for b := lo; b <= hi; b++ {
		seen += h.counts[b]
		if seen >= want {
			if b < 0 {
				return 0
			}
			return time.Duration(float64(time.Microsecond) * math.Pow(histBase, float64(b+1)))
		}
	}
	return time.Duration(float64(time.Microsecond) * math.Pow(histBase, float64(hi+1)))
}
