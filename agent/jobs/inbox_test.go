package jobs

import (
	"context"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// runInbox starts node's inbox of stage and waits for its first read.
func runInbox(t *testing.T, s *Store, stage Stage, node string) *Inbox {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	q := s.NewInbox(stage, node)
	var wg sync.WaitGroup
	wg.Go(func() { q.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	within(t, "first read", func() bool { return q.Synced() })
	return q
}

// pending reads stage's waiting tasks from etcd.
func pending(t *testing.T, s *Store, stage Stage) []Task {
	t.Helper()
	ts, _, err := s.Pending(context.Background(), stage)
	if err != nil {
		t.Fatal(err)
	}
	return ts
}

// within retries cond for up to 10 s.
func within(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10 s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// An inbox sees the claims pushed to its node and no other node's, each
// with its task; a cancel reaches the holder's inbox by a marker, which
// the inbox deletes once seen; a claim on a lease that ended is forgotten
// when the worker asks on its new one, and its task waits again.
func TestInboxSeesOnlyItsNode(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	mine, other := runInbox(t, s, Encode, "enc-1"), runInbox(t, s, Encode, "enc-2")
	lease, otherLease := grant(t, cli), grant(t, cli)
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-2", Lease: otherLease}}); err != nil {
		t.Fatal(err)
	}
	within(t, "the other's push", func() bool { return other.Waiting(otherLease) == 1 })
	cancelled, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-1", Lease: lease}})
	if err != nil {
		t.Fatal(err)
	}
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-1", Lease: lease}})
	if err != nil {
		t.Fatal(err)
	}
	within(t, "this node's pushes", func() bool { return len(mine.Pushed(lease)) == 2 })
	if mine.Waiting(lease) != 2 || other.Waiting(otherLease) != 1 || len(other.Pushed(lease)) != 0 {
		t.Fatalf("waiting %d and %d, want 2 and 1", mine.Waiting(lease), other.Waiting(otherLease))
	}
	var c *Claim
	for _, p := range mine.Pushed(lease) {
		if p.Task.JobID == cancelled.ID {
			c = p
		}
	}
	if c == nil || c.Task.Key == "" || c.Task.Holder != "enc-1" || c.Rev == 0 || c.Task.Rev != c.Rev {
		t.Fatalf("pushed claim %+v", c)
	}
	gone, stop := mine.TaskGone(c.Task.ID)
	defer stop()
	if _, err := s.Cancel(ctx, cancelled.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the cancel did not reach the holder's inbox")
	}
	if n := mine.Waiting(lease); n != 1 {
		t.Fatalf("after the cancel: %d waiting, want 1", n)
	}
	within(t, "the cancel marker deleted", func() bool {
		resp, err := cli.Get(ctx, s.inboxPrefix(Encode, "enc-1"), clientv3.WithPrefix(), clientv3.WithCountOnly())
		return err == nil && resp.Count == 1 // the other job's claim
	})
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	if n := len(mine.Pushed(grant(t, cli))); n != 0 {
		t.Fatalf("%d claims offered on a new lease, want none", n)
	}
	// The task waits again: its holder's claim is gone.
	if p := pending(t, s, Encode); len(p) != 1 || p[0].JobID != job.ID {
		t.Fatalf("waiting after the lease ended: %+v", p)
	}
}

// stageView gives a test the stage as a whole: the inboxes of the nodes
// it names (started on first use) and etcd's reads of what waits and runs.
type stageView struct {
	t     *testing.T
	s     *Store
	stage Stage
	mu    sync.Mutex
	boxes map[string]*Inbox
}

func runQueue(t *testing.T, s *Store, stage Stage) *stageView {
	return &stageView{t: t, s: s, stage: stage, boxes: map[string]*Inbox{}}
}

func (v *stageView) inbox(node string) *Inbox {
	v.mu.Lock()
	q, ok := v.boxes[node]
	v.mu.Unlock()
	if !ok {
		q = runInbox(v.t, v.s, v.stage, node)
		v.mu.Lock()
		v.boxes[node] = q
		v.mu.Unlock()
	}
	return q
}

func (v *stageView) Pushed(node string, lease clientv3.LeaseID) []*Claim {
	return v.inbox(node).Pushed(lease)
}

func (v *stageView) Take(c *Claim) { v.inbox(c.Node).Take(c) }

func (v *stageView) Pending() []Task { return pending(v.t, v.s, v.stage) }

func (v *stageView) Depth() (queued, running int) {
	q, r, _, err := v.s.Depth(context.Background(), v.stage)
	if err != nil {
		v.t.Fatal(err)
	}
	return int(q), int(r)
}

// HeldBy counts node's claim keys of the stage in etcd.
func (v *stageView) HeldBy(node string) int {
	resp, err := v.s.cli.Get(context.Background(), v.s.inboxPrefix(v.stage, node), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		v.t.Fatal(err)
	}
	return int(resp.Count)
}

// A claim given back and pushed to the same node again before the worker
// that gave it back marks the first one taken stays in the inbox: the
// worker starts it. (Under load the new claim's put reached the inbox
// first, and taking the old claim dropped it: the task sat claimed by a
// worker that never saw it, with the job unfinished.)
func TestInboxKeepsAClaimPushedAgainBeforeTheOldIsTaken(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	q := runInbox(t, s, Encode, "enc-1")
	lease := grant(t, cli)
	to := &Push{Node: "enc-1", Lease: lease}
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: to}); err != nil {
		t.Fatal(err)
	}
	within(t, "the push", func() bool { return len(q.Pushed(lease)) == 1 })
	first := q.Pushed(lease)[0]
	if err := s.Requeue(ctx, first); err != nil {
		t.Fatal(err)
	}
	waiting := pending(t, s, Encode)
	if len(waiting) != 1 || waiting[0].Back != "enc-1" {
		t.Fatalf("after the give-back: %+v, want one task, given back by enc-1", waiting)
	}
	again, err := s.Assign(ctx, waiting[0], to)
	if err != nil {
		t.Fatal(err)
	}
	if again.Task.Back != "" {
		t.Fatalf("a claimed task names %q as having given it back", again.Task.Back)
	}
	within(t, "the second push", func() bool {
		p := q.Pushed(lease)
		return len(p) == 1 && p[0].Rev == again.Rev
	})
	q.Take(first) // the give-back's caller, late
	p := q.Pushed(lease)
	if len(p) != 1 || p[0].Rev != again.Rev {
		t.Fatalf("after taking the given-back claim: %d offered, want the second push (rev %d)", len(p), again.Rev)
	}
	q.Take(p[0])
	q.Done(first)                          // the first claim's end, recorded after the second started
	if _, err := q.load(ctx); err != nil { // as after a compaction
		t.Fatal(err)
	}
	if n := len(q.Pushed(lease)); n != 0 {
		t.Fatalf("a read after the first claim's end offers %d claims, want none: the second is running", n)
	}
}
