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

// Inbox is a watch-fed view of the claims pushed to one node on one
// stage's tasks (by the task's creator, its dispatcher, or a worker
// handing it over), which the node starts without a transaction of its
// own. It reads its claim keys once, then follows one watch of their
// prefix from that read's revision. Every key under it is this node's, and
// the watch takes puts only: a job costs the inbox one event (its claim
// pushed), whatever the size of the mesh; nobody watches a whole stage.
// The claims' deletions are the node's own doing (its commit, a give-back,
// a hand-over) or its lease's end, which it knows of, or a cancel, which
// puts a marker beside the claim (<task>/cancel, on the node's lease; the
// inbox deletes it once seen). A watch that breaks resumes after the last
// revision seen; one answered with a compaction (etcd compacted the gap,
// or etcdguard saw etcd replaced) reads the claims again. Run owns the
// view's goroutine; the other methods may be called from any goroutine.
type Inbox struct {
	s     *Store
	stage Stage
	node  string

	// mu guards the fields below.
	mu      sync.Mutex
	claims  map[string]claimInfo // pushed claims not taken yet, by task id
	synced  bool                 // the claims have been read at least once
	changed changes              // every change
	// gone holds the channels of TaskGone waiters, by task id.
	gone map[string][]chan struct{}
	// taken are the pushed claims the worker has taken (Take), by task id,
	// until it is done with them (Done): a read of the claims after a
	// compaction must not offer them again.
	taken map[string]takenClaim
	// done are the tasks the worker was done with (Done) within the last
	// OfferTTL, and doneOrder the same in the order they were done: an
	// offer of one that arrives after its write's event, and after its
	// run, is not started again.
	done      map[string]bool
	doneOrder []doneTask
}

// takenClaim is a claim the worker took: its revision, and the offer it
// came from while no write has settled it (offer.go; rev is 0 until then).
type takenClaim struct {
	rev   int64
	offer *offer
}

// doneTask is a task the worker was done with at at.
type doneTask struct {
	id string
	at time.Time
}

// cancelSuffix marks a cancel marker's key: <inbox>/<task>/cancel.
const cancelSuffix = "/cancel"

// claimInfo is what the view knows of a claim key.
type claimInfo struct {
	rev   int64            // ModRevision: the claim's fencing token
	lease clientv3.LeaseID // the claim holder's lease
	rec   claimRecord
	// offer is set while the claim is only offered (Offered): rev is 0
	// until the write that confirms it arrives.
	offer *offer
}

// NewInbox returns an empty view of node's claims on stage's tasks; Run
// fills and follows it.
func (s *Store) NewInbox(stage Stage, node string) *Inbox {
	return &Inbox{s: s, stage: stage, node: node, claims: map[string]claimInfo{}, gone: map[string][]chan struct{}{},
		taken: map[string]takenClaim{}, done: map[string]bool{}}
}

// Stage is the stage the view follows.
func (q *Inbox) Stage() Stage { return q.stage }

// Changed returns a channel closed at the view's next change. Take it before
// reading the view, so that a change in between is not missed.
func (q *Inbox) Changed() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.changed.wait()
}

// Synced reports whether the view has read the claims at least once.
func (q *Inbox) Synced() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.synced
}

// Pushed returns the claims pushed to this node on lease (Push) that its
// worker has not taken yet, each ready to run: the worker starts one by
// calling Take, and gives one back with Store.Requeue or Store.HandOver
// (taking it first; not one still Offered, which is not in etcd yet).
// Their StartedAt is when they were pushed; ClaimedAt is now. Claims on
// another lease went with it (a read after a compaction forgets them).
func (q *Inbox) Pushed(lease clientv3.LeaseID) []*Claim {
	now := q.s.cfg.Now()
	q.mu.Lock()
	defer q.mu.Unlock()
	var out []*Claim
	for _, c := range q.claims {
		if c.lease != lease || lease == 0 {
			continue
		}
		t := *c.rec.Of
		t.Key, t.Rev = c.rec.TaskKey, c.rev // written by the claim's transaction
		cl := &Claim{Task: t, Node: q.node, Lease: lease, Rev: c.rev, StartedAt: c.rec.StartedAt, ClaimedAt: now, Pushed: true, offer: c.offer}
		if len(c.rec.Record) > 0 {
			cl.job, cl.jobRev = c.rec.Record, c.rev // the job record, written with the claim
		}
		out = append(out, cl)
	}
	return out
}

// Oldest is, over the claims pushed to this node on lease that its worker
// has not taken (and that are in etcd: not only offered), the earliest
// claim (StartedAt) and the earliest enqueue of their tasks; n counts
// them. A worker that gives back only claims that waited so long asks no
// more while none has.
func (q *Inbox) Oldest(lease clientv3.LeaseID) (claimed, enqueued time.Time, n int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, c := range q.claims {
		if c.lease != lease || lease == 0 || c.offer != nil {
			continue
		}
		if n == 0 || c.rec.StartedAt.Before(claimed) {
			claimed = c.rec.StartedAt
		}
		if e := c.rec.Of.EnqueuedAt; n == 0 || e.Before(enqueued) {
			enqueued = e
		}
		n++
	}
	return claimed, enqueued, n
}

// Waiting counts the claims pushed to this node on lease that its worker
// has not taken: tasks queued here for a slot.
func (q *Inbox) Waiting(lease clientv3.LeaseID) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for _, c := range q.claims {
		if c.lease == lease && lease != 0 {
			n++
		}
	}
	return n
}

// TaskGone returns a channel closed when task id's job is cancelled (its
// claim's cancel marker arrives), or when a read of the claims after a
// compaction finds its claim gone. A worker running the task learns of a
// cancel from it, with no watch of its own. stop forgets the waiter.
func (q *Inbox) TaskGone(id string) (gone <-chan struct{}, stop func()) {
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
func (q *Inbox) goneLocked(id string) {
	for _, ch := range q.gone[id] {
		close(ch)
	}
	delete(q.gone, id)
}

// Take marks pushed claim c as started (or given back), so Pushed no
// longer returns it. Only the stage's worker loop takes claims, so one is
// taken once. A newer claim on the same task stays: a claim given back
// can be pushed here again, and its put seen, before the give-back's
// caller takes the old one.
func (q *Inbox) Take(c *Claim) {
	q.mu.Lock()
	defer q.mu.Unlock()
	rev := c.Revision() // an offer's, if the write confirmed it already
	if cur, ok := q.claims[c.Task.ID]; ok && cur.rev <= rev {
		delete(q.claims, c.Task.ID)
	}
	tc := takenClaim{rev: rev}
	if c.offer != nil && c.offer.pending() {
		tc.offer = c.offer // the write's event settles it
	}
	q.taken[c.Task.ID] = tc
}

// Done forgets claim c, which the worker took and is done with (unless
// a newer claim on its task was taken since: a task requeued and pushed
// here again can start before the first run's end is recorded).
func (q *Inbox) Done(c *Claim) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if tc, ok := q.taken[c.Task.ID]; ok && tc.rev == c.Revision() {
		delete(q.taken, c.Task.ID)
	}
	now := q.s.cfg.Now()
	for len(q.doneOrder) > 0 && now.Sub(q.doneOrder[0].at) > q.s.cfg.OfferTTL {
		delete(q.done, q.doneOrder[0].id)
		q.doneOrder = q.doneOrder[1:]
	}
	q.done[c.Task.ID] = true
	q.doneOrder = append(q.doneOrder, doneTask{c.Task.ID, now})
}

// Run reads the claims and follows them until ctx is done.
func (q *Inbox) Run(ctx context.Context) {
	log := q.s.log.With(zap.String("inbox", string(q.stage)))
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		rev, err := q.load(ctx)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("reading this node's claims failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
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
// claims again.
func (q *Inbox) follow(ctx context.Context, rev int64, log *zap.Logger) {
	next := rev + 1
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := q.s.cli.Watch(wctx, q.s.inboxPrefix(q.stage, q.node), clientv3.WithPrefix(), clientv3.WithRev(next), clientv3.WithFilterDelete())
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
				log.Info("inbox watch compacted; reading the claims again", zap.Int64("compacted", wr.CompactRevision))
				resync = true
				break events
			case wr.Canceled || wr.Err() != nil:
				break events
			}
			for _, key := range q.apply(wr.Events) {
				q.dropMarker(ctx, key, log)
			}
			if wr.Header.Revision > 0 {
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

// apply updates the view with watch events (puts), and returns the cancel
// markers among them, to delete.
func (q *Inbox) apply(evs []*clientv3.Event) (markers []string) {
	if len(evs) == 0 {
		return nil
	}
	prefix := q.s.inboxPrefix(q.stage, q.node)
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, ev := range evs {
		if ev.Type == clientv3.EventTypeDelete {
			continue // the watch filters them; a read after a compaction sees what is left
		}
		id := strings.TrimPrefix(string(ev.Kv.Key), prefix)
		if task, ok := strings.CutSuffix(id, cancelSuffix); ok {
			delete(q.claims, task)
			q.goneLocked(task)
			markers = append(markers, string(ev.Kv.Key))
			continue
		}
		q.putLocked(id, ev.Kv)
	}
	q.changed.notify()
	return markers
}

// putLocked takes the claim at kv, on task id, into the view if it is a
// pushed claim the worker has not taken; it settles the offer of it the
// view holds, if any.
func (q *Inbox) putLocked(id string, kv *mvccpb.KeyValue) {
	c := q.decodeClaim(kv)
	if q.confirmLocked(id, c, kv.Value) {
		return // the offer the worker runs, confirmed
	}
	if tc, ok := q.taken[id]; !c.rec.Pushed || c.rec.Of == nil || (ok && tc.rev == c.rev) {
		return // the worker's own claim, or one it took
	}
	q.claims[id] = c
}

// dropMarker deletes a cancel marker the inbox has seen.
func (q *Inbox) dropMarker(ctx context.Context, key string, log *zap.Logger) {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := q.s.cli.Delete(dctx, key); err != nil {
		log.Debug("cancel marker left until the lease ends", zap.String("key", key), zap.Error(err))
	}
}

// decodeClaim reads a claim key. One the view cannot read still counts as
// held: only its details are unknown.
func (q *Inbox) decodeClaim(kv *mvccpb.KeyValue) claimInfo {
	c := claimInfo{rev: kv.ModRevision, lease: clientv3.LeaseID(kv.Lease)}
	if err := json.Unmarshal(kv.Value, &c.rec); err != nil {
		q.s.log.Warn("undecodable claim", zap.ByteString("key", kv.Key), zap.Error(err))
		c.rec = claimRecord{}
	}
	return c
}

// load reads this node's claims at one revision and replaces the view
// with them.
func (q *Inbox) load(ctx context.Context) (int64, error) {
	prefix := q.s.inboxPrefix(q.stage, q.node)
	resp, err := q.s.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("jobs: read %s claims of %s: %w", q.stage, q.node, err)
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	present := map[string]bool{}
	offered := q.claims
	q.claims = map[string]claimInfo{}
	for id, c := range offered {
		if c.offer != nil {
			q.claims[id] = c // not written yet, or written after this read: its event settles it
		}
	}
	for _, kv := range resp.Kvs {
		id := strings.TrimPrefix(string(kv.Key), prefix)
		if task, ok := strings.CutSuffix(id, cancelSuffix); ok {
			q.goneLocked(task) // cancelled in the history the view missed
			continue
		}
		present[id] = true
		q.putLocked(id, kv)
	}
	for id := range q.gone {
		if tc := q.taken[id]; !present[id] && tc.offer == nil {
			q.goneLocked(id) // deleted in the history the view missed
		}
	}
	q.synced = true
	q.changed.notify()
	return resp.Header.Revision, nil
}

// readQueue reads every task of stage, at one revision, in pages of
// Config.QueuePage: what Pending and Adopt's sweep go by.
func (s *Store) readQueue(ctx context.Context, stage Stage) (tasks []Task, rev int64, err error) {
	return s.readTasks(ctx, s.taskPrefix(stage), 0)
}

// readTasks reads every task under prefix at revision rev (0: the
// current one), in pages of Config.QueuePage, and returns the revision
// read.
func (s *Store) readTasks(ctx context.Context, prefix string, rev int64) (tasks []Task, _ int64, err error) {
	end := clientv3.GetPrefixRangeEnd(prefix)
	from := prefix
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(s.cfg.QueuePage), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := s.cli.Get(ctx, from, opts...)
		if err != nil {
			return nil, 0, fmt.Errorf("jobs: read tasks %s: %w", prefix, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision // the later pages are read at the first one's revision
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
			return tasks, rev, nil
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
