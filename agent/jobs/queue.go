package jobs

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Queue is a watch-fed view of one stage's queue: every task of the stage
// and which of them are claimed. It reads the queue once (in pages), then
// follows one watch of the stage's prefix, which holds both its tasks and
// its claims, from that read's revision, so a worker scans memory instead
// of ranging over etcd, and an idle agent sends etcd nothing. One watch
// delivers a transaction's changes together and in revision order, so the
// view is always the queue as it was at some revision: a commit that
// deletes a task and its claim never shows the task as unclaimed in
// between. A watch that breaks resumes after the last revision seen; one
// answered with a compaction (etcd compacted the gap, or etcdguard saw etcd
// replaced) reads the queue again.
//
// The view may lag etcd: a claim made from it carries the task's
// ModRevision as seen, so a stale view costs a refused claim (ErrTaken),
// never a double one. Run owns the view's goroutine; the other methods may
// be called from any goroutine.
type Queue struct {
	s     *Store
	stage Stage

	// mu guards the fields below.
	mu      sync.Mutex
	tasks   map[string]Task      // by task id
	claimed map[string]claimInfo // by task id, the tasks with a claim key
	synced  bool                 // the view has been read at least once
	seen    int64                // the view holds every change of the queue up to this etcd revision
	changed chan struct{}        // closed (and replaced) on every change
	loads   int                  // full reads of the queue, for tests and status
	// pushedTo indexes the pushed claims by the node they were pushed to
	// (node -> task ids), so a worker's look at its own costs no scan.
	pushedTo map[string]map[string]bool
	// heldBy counts the claims held by each node (claimRecord.Node).
	heldBy map[string]int
	// gone holds the channels of TaskGone waiters, by task id.
	gone map[string][]chan struct{}
	// pushWake holds, per node, a channel closed at the next change of the
	// claims pushed to it (PushChanged).
	pushWake map[string]chan struct{}
	// taken are the pushed claims a worker has taken (Take), by task id,
	// with the claim's revision, until their claim keys go.
	taken map[string]int64
}

// claimInfo is what the view knows of a claim key.
type claimInfo struct {
	rev   int64            // ModRevision: the claim's fencing token
	lease clientv3.LeaseID // the claim holder's lease
	rec   claimRecord
}

// NewQueue returns an empty view of stage's queue; Run fills and follows it.
func (s *Store) NewQueue(stage Stage) *Queue {
	return &Queue{s: s, stage: stage, tasks: map[string]Task{}, claimed: map[string]claimInfo{}, pushedTo: map[string]map[string]bool{}, heldBy: map[string]int{}, gone: map[string][]chan struct{}{}, pushWake: map[string]chan struct{}{}, taken: map[string]int64{}, changed: make(chan struct{})}
}

// Stage is the stage the view follows.
func (q *Queue) Stage() Stage { return q.stage }

// Changed returns a channel closed at the view's next change. Take it before
// reading the view, so that a change in between is not missed.
func (q *Queue) Changed() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.changed
}

// Synced reports whether the view has read the queue at least once.
func (q *Queue) Synced() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.synced
}

// Pending returns the unclaimed tasks, in no particular order (routing
// orders them).
func (q *Queue) Pending() []Task {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]Task, 0, len(q.tasks)-min(len(q.tasks), len(q.claimed)))
	for id, t := range q.tasks {
		if _, ok := q.claimed[id]; !ok {
			out = append(out, t)
		}
	}
	return out
}

// Held is a claimed task and the node its claim names (for a pushed
// claim, the view cannot tell whether that worker has started it).
type Held struct {
	Task Task
	Node string
}

// Running returns the stage's claimed tasks with their holders, in no
// particular order (routing.QueuePolicy.Preempt matches them with waiting
// work).
func (q *Queue) Running() []Held {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := make([]Held, 0, len(q.claimed))
	for id, c := range q.claimed {
		if t, ok := q.tasks[id]; ok {
			out = append(out, Held{Task: t, Node: c.rec.Node})
		}
	}
	return out
}

// Pushed returns the claims pushed to node on lease (Push) that no worker
// has taken yet, each ready to run: the worker starts one by calling Take,
// and gives one back with Store.Requeue. Their StartedAt is when they were
// pushed; ClaimedAt is now.
func (q *Queue) Pushed(node string, lease clientv3.LeaseID) []*Claim {
	now := q.s.cfg.Now()
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []*Claim
	for id := range q.pushedTo[node] {
		c := q.claimed[id]
		if rev, ok := q.taken[id]; c.lease != lease || lease == 0 || (ok && rev == c.rev) {
			continue
		}
		t, ok := q.tasks[id]
		if !ok {
			continue // a claim left by a task deleted in another transaction: not runnable
		}
		out = append(out, &Claim{Task: t, Node: node, Lease: lease, Rev: c.rev, StartedAt: c.rec.StartedAt, ClaimedAt: now, Pushed: true})
	}
	return out
}

// PushChanged returns a channel closed when a claim is pushed to node or
// one pushed to it goes: a worker busy with every slot sleeps on it rather
// than on every change of the queue.
func (q *Queue) PushChanged(node string) <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	ch, ok := q.pushWake[node]
	if !ok {
		ch = make(chan struct{})
		q.pushWake[node] = ch
	}
	return ch
}

// pushChangedLocked wakes the waiters of PushChanged(node).
func (q *Queue) pushChangedLocked(node string) {
	if ch, ok := q.pushWake[node]; ok {
		close(ch)
		delete(q.pushWake, node)
	}
}

// TaskGone returns a channel closed when the view sees task id leave the
// queue: its stage committed (or failed, rewound), or its job was
// cancelled or deleted, which deletes the task even while it runs. A
// worker running the task learns of a cancel from it, with no watch of
// its own. stop forgets the waiter.
func (q *Queue) TaskGone(id string) (gone <-chan struct{}, stop func()) {
	ch := make(chan struct{})
	q.mu.Lock()
	defer q.mu.Unlock()
	q.gone[id] = append(q.gone[id], ch)
	return ch, func() {
		q.mu.Lock()
		defer q.mu.Unlock()
		ws := q.gone[id]
		for i, w := range ws {
			if w == ch {
				ws = append(ws[:i], ws[i+1:]...)
				break
			}
		}
		if len(ws) == 0 {
			delete(q.gone, id)
		} else {
			q.gone[id] = ws
		}
	}
}

// goneLocked tells the TaskGone waiters of task id.
func (q *Queue) goneLocked(id string) {
	for _, ch := range q.gone[id] {
		close(ch)
	}
	delete(q.gone, id)
}

// HeldBy counts the claims node holds on the stage's tasks: those it runs
// and those pushed to it that it has yet to start.
func (q *Queue) HeldBy(node string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.heldBy[node]
}

// Take marks pushed claim c as started, so Pushed no longer returns it.
// Only the stage's worker loop takes claims, so one is taken once.
func (q *Queue) Take(c *Claim) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.taken[c.Task.ID] = c.Rev
}

// Seen is the etcd revision up to which the view holds every change to the
// stage's tasks and claims: a task written at a revision at or below it is
// in the view. After a compaction or replaced etcd it starts again from the
// new read's revision.
func (q *Queue) Seen() int64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.seen
}

// saw records that the watch delivered everything up to rev, and tells
// waiters.
func (q *Queue) saw(rev int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if rev > q.seen {
		q.seen = rev
		q.notifyLocked()
	}
}

// Claimed reports whether the view has seen a claim on task id.
func (q *Queue) Claimed(id string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	_, ok := q.claimed[id]
	return ok
}

// Depth counts the tasks queued (unclaimed) and running (claimed).
func (q *Queue) Depth() (queued, running int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for id := range q.tasks {
		if _, ok := q.claimed[id]; ok {
			running++
		}
	}
	return len(q.tasks) - running, running
}

// Loads counts the view's full reads of the queue (one at start, one per
// compaction or replaced etcd).
func (q *Queue) Loads() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.loads
}

func (q *Queue) notifyLocked() {
	close(q.changed)
	q.changed = make(chan struct{})
}

// Run reads the queue and follows it until ctx is done.
func (q *Queue) Run(ctx context.Context) {
	log := q.s.log.With(zap.String("queue", string(q.stage)))
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		rev, err := q.load(ctx)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("queue read failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
			}
			sleepCtx(ctx, backoff)
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		backoff = 50 * time.Millisecond
		q.follow(ctx, rev, log)
	}
}

// follow applies watch events from rev+1 until ctx ends or the history it
// needs is gone (compacted, or etcd replaced): then the caller reads the
// queue again.
func (q *Queue) follow(ctx context.Context, rev int64, log *zap.Logger) {
	next := rev + 1
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := q.s.cli.Watch(wctx, q.s.queuePrefix(q.stage), clientv3.WithPrefix(), clientv3.WithRev(next))
		resync := false
	events:
		for {
			var wr clientv3.WatchResponse
			var ok bool
			select {
			case wr, ok = <-wch:
			case <-ctx.Done():
			}
			switch {
			case !ok:
				break events // closed: leader lost, or ctx done
			case wr.CompactRevision > 0:
				log.Info("queue watch compacted; reading the queue again", zap.Int64("compacted", wr.CompactRevision))
				resync = true
				break events
			case wr.Canceled || wr.Err() != nil:
				break events
			}
			q.apply(wr.Events)
			if wr.Header.Revision > 0 {
				q.saw(wr.Header.Revision)
				next = max(next, wr.Header.Revision+1)
			}
		}
		cancel()
		if resync {
			return
		}
		sleepCtx(ctx, 200*time.Millisecond) // a broken watch (leader loss): resume shortly
	}
}

// apply updates the view with watch events.
func (q *Queue) apply(evs []*clientv3.Event) {
	if len(evs) == 0 {
		return
	}
	claims := q.s.claimPrefix(q.stage)
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, ev := range evs {
		key := string(ev.Kv.Key)
		if id, ok := strings.CutPrefix(key, claims); ok {
			q.unclaimLocked(id)
			if ev.Type != clientv3.EventTypeDelete {
				q.claimLocked(id, q.decodeClaim(ev.Kv))
			}
			continue
		}
		if ev.Type == clientv3.EventTypeDelete {
			q.deleteKeyLocked(key)
			continue
		}
		if t, ok := q.decode(ev.Kv.Key, ev.Kv.Value, ev.Kv.ModRevision); ok {
			if old, ok := q.tasks[t.ID]; !ok || old.Rev < t.Rev {
				q.tasks[t.ID] = t
			}
		}
	}
	q.notifyLocked()
}

// claimLocked records claim c on task id.
func (q *Queue) claimLocked(id string, c claimInfo) {
	q.claimed[id] = c
	q.heldBy[c.rec.Node]++
	if c.rec.Pushed {
		if q.pushedTo[c.rec.Node] == nil {
			q.pushedTo[c.rec.Node] = map[string]bool{}
		}
		q.pushedTo[c.rec.Node][id] = true
		q.pushChangedLocked(c.rec.Node)
	}
}

// unclaimLocked forgets the claim on task id, if any.
func (q *Queue) unclaimLocked(id string) {
	c, ok := q.claimed[id]
	if !ok {
		return
	}
	delete(q.claimed, id)
	delete(q.taken, id)
	if q.heldBy[c.rec.Node]--; q.heldBy[c.rec.Node] <= 0 {
		delete(q.heldBy, c.rec.Node)
	}
	if set := q.pushedTo[c.rec.Node]; set != nil {
		delete(set, id)
		if len(set) == 0 {
			delete(q.pushedTo, c.rec.Node)
		}
		q.pushChangedLocked(c.rec.Node)
	}
}

// deleteKeyLocked drops the task stored at key (a task's id is the key's
// suffix after its enqueue time).
func (q *Queue) deleteKeyLocked(key string) {
	if i := strings.LastIndexByte(key, '-'); i >= 0 {
		if t, ok := q.tasks[key[i+1:]]; ok && t.Key == key {
			delete(q.tasks, t.ID)
			q.goneLocked(t.ID)
		}
	}
}

// decodeClaim reads a claim key. One the view cannot read still marks
// its task claimed: only its holder's details are unknown.
func (q *Queue) decodeClaim(kv *mvccpb.KeyValue) claimInfo {
	c := claimInfo{rev: kv.ModRevision, lease: clientv3.LeaseID(kv.Lease)}
	if err := json.Unmarshal(kv.Value, &c.rec); err != nil {
		q.s.log.Warn("undecodable claim", zap.ByteString("key", kv.Key), zap.Error(err))
	}
	return c
}

func (q *Queue) decode(key, val []byte, rev int64) (Task, bool) {
	var t Task
	if err := json.Unmarshal(val, &t); err != nil || t.ID == "" {
		q.s.log.Warn("skipping undecodable task", zap.ByteString("key", key), zap.Error(err))
		return Task{}, false
	}
	t.Key, t.Rev = string(key), rev
	return t, true
}

// load reads the whole queue at one revision and replaces the view with it.
func (q *Queue) load(ctx context.Context) (int64, error) {
	tasks, claims, rev, err := q.s.readQueue(ctx, q.stage)
	if err != nil {
		return 0, err
	}
	byID := make(map[string]Task, len(tasks))
	for _, t := range tasks {
		byID[t.ID] = t
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	taken := q.taken
	q.claimed, q.pushedTo, q.heldBy, q.taken = map[string]claimInfo{}, map[string]map[string]bool{}, map[string]int{}, map[string]int64{}
	for _, kv := range claims {
		id, c := strings.TrimPrefix(string(kv.Key), q.s.claimPrefix(q.stage)), q.decodeClaim(kv)
		q.claimLocked(id, c)
		if rev, ok := taken[id]; ok && rev == c.rev {
			q.taken[id] = rev // still claimed: still taken
		}
	}
	for node := range q.pushWake {
		q.pushChangedLocked(node) // the pushes may have changed: look again
	}
	for id := range q.gone {
		if _, ok := byID[id]; !ok {
			q.goneLocked(id) // deleted in the history the view missed
		}
	}
	q.tasks, q.synced = byID, true
	q.seen = rev // a new read (after a compaction or a replaced etcd) starts over
	q.loads++
	q.notifyLocked()
	return rev, nil
}

// readQueue reads every task of stage and every claim key, all at one
// revision, the tasks in pages of Config.QueuePage.
func (s *Store) readQueue(ctx context.Context, stage Stage) (tasks []Task, claims []*mvccpb.KeyValue, rev int64, err error) {
	prefix := s.taskPrefix(stage)
	end := clientv3.GetPrefixRangeEnd(prefix)
	cresp, err := s.cli.Get(ctx, s.claimPrefix(stage), clientv3.WithPrefix())
	if err != nil {
		return nil, nil, 0, fmt.Errorf("jobs: read %s claims: %w", stage, err)
	}
	rev, claims = cresp.Header.Revision, cresp.Kvs
	from := prefix
	for {
		resp, err := s.cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithRev(rev),
			clientv3.WithLimit(s.cfg.QueuePage), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if err != nil {
			return nil, nil, 0, fmt.Errorf("jobs: read %s queue: %w", stage, err)
		}
		for _, kv := range resp.Kvs {
			var t Task
			if err := json.Unmarshal(kv.Value, &t); err != nil || t.ID == "" {
				s.log.Warn("skipping undecodable task", zap.ByteString("key", kv.Key), zap.Error(err))
				continue
			}
			t.Key, t.Rev = string(kv.Key), kv.ModRevision
			tasks = append(tasks, t)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return tasks, claims, rev, nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}
