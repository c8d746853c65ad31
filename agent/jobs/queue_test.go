package jobs

import (
	"context"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// runQueue starts a view of stage and waits for its first read.
func runQueue(t *testing.T, s *Store, stage Stage) *Queue {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	q := s.NewQueue(stage)
	var wg sync.WaitGroup
	wg.Go(func() { q.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	within(t, "first read", func() bool { return q.Synced() })
	return q
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

func waitChanged(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("view did not change: %s", what)
	}
}

// TestQueueFollowsClaimsAndLeases: the view sees a new task, its claim, the
// claim going with the worker's lease (the task claimable again), and a
// commit deleting it, all from its watches.
func TestQueueFollowsClaimsAndLeases(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	q := runQueue(t, s, Encode)
	if n, r := q.Depth(); n != 0 || r != 0 {
		t.Fatalf("empty queue: %d queued, %d running", n, r)
	}

	ch := q.Changed()
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Standard}); err != nil {
		t.Fatal(err)
	}
	waitChanged(t, ch, "submit")
	within(t, "task seen", func() bool { return len(q.Pending()) == 1 })

	lease := grant(t, cli)
	c, err := s.TryClaim(ctx, q.Pending()[0], "enc-1", lease)
	if err != nil {
		t.Fatal(err)
	}
	within(t, "claim seen", func() bool { n, r := q.Depth(); return n == 0 && r == 1 && q.Claimed(c.Task.ID) })
	if len(q.Pending()) != 0 {
		t.Fatalf("claimed task still pending")
	}
	// The lease goes (a dead worker): the task is claimable again, and a
	// claim from the view's copy (the claim rewrote the task) succeeds.
	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	within(t, "claim gone", func() bool { return len(q.Pending()) == 1 })
	lease2 := grant(t, cli)
	c2, err := s.TryClaim(ctx, q.Pending()[0], "enc-2", lease2)
	if err != nil {
		t.Fatalf("claim after lease expiry: %v", err)
	}
	if c2.Task.Attempt != 2 {
		t.Fatalf("attempt %d, want 2", c2.Task.Attempt)
	}
	if err := s.Commit(ctx, c2, Output{Payloads: payload("p", "enc-2")}); err != nil {
		t.Fatal(err)
	}
	within(t, "commit seen", func() bool { n, r := q.Depth(); return n == 0 && r == 0 })
	if q.Loads() != 1 {
		t.Fatalf("%d loads, want 1: the view follows its watches", q.Loads())
	}
}

// lossyWatcher passes watches through until lose is called: from then on
// their events are dropped (history the view never sees), and compact
// ends them with the compaction response etcd (or etcdguard, for a
// replaced etcd) gives.
type lossyWatcher struct {
	clientv3.Watcher
	mu      sync.Mutex
	lost    bool
	compact chan struct{}
}

func (w *lossyWatcher) lose() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.lost = true
}

func (w *lossyWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.mu.Lock()
	compact := w.compact
	w.mu.Unlock()
	inner := w.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for {
			select {
			case r, ok := <-inner:
				if !ok {
					return
				}
				w.mu.Lock()
				lost := w.lost
				w.mu.Unlock()
				if lost {
					continue
				}
				select {
				case out <- r:
				case <-ctx.Done():
					return
				}
			case <-compact:
				select {
				case out <- clientv3.WatchResponse{CompactRevision: 1, Canceled: true}:
				case <-ctx.Done():
				}
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// TestQueueResyncsAfterCompaction: a view whose watch lost history and is
// told so (a compaction response) reads the queue again and misses nothing.
func TestQueueResyncsAfterCompaction(t *testing.T) {
	s, cli := newStore(t)
	lw := &lossyWatcher{Watcher: cli.Watcher, compact: make(chan struct{})}
	cli.Watcher = lw
	ctx := context.Background()
	q := runQueue(t, s, Encode)
	var jobs []Job
	for range 3 {
		j, err := s.Submit(ctx, spec(), Options{Class: routing.Batch})
		if err != nil {
			t.Fatal(err)
		}
		jobs = append(jobs, j)
	}
	within(t, "three tasks", func() bool { return len(q.Pending()) == 3 })

	lw.lose() // from here the view's watches miss what happens
	if _, err := s.Cancel(ctx, jobs[0].ID); err != nil {
		t.Fatal(err)
	}
	lease := grant(t, cli)
	pend, _, err := s.Pending(ctx, Encode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.TryClaim(ctx, pend[0], "enc-1", lease); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Batch}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if n, r := q.Depth(); n != 3 || r != 0 {
		t.Fatalf("view saw events it was meant to miss: %d queued, %d running", n, r)
	}
	lw.mu.Lock()
	lw.lost = false
	close(lw.compact)
	lw.compact = make(chan struct{})
	lw.mu.Unlock()
	within(t, "resync", func() bool { n, r := q.Depth(); return n == 2 && r == 1 })
	if q.Loads() != 2 {
		t.Fatalf("%d loads, want 2", q.Loads())
	}
}
