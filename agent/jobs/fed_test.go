package jobs

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// runFed runs node's ledger of stage until the test ends.
func runFed(t *testing.T, s *Store, stage Stage, node string) *Fed {
	return runFedConsumed(t, s, stage, node, nil)
}

// runFedConsumed is runFed with a consumed hook (NewFed).
func runFedConsumed(t *testing.T, s *Store, stage Stage, node string, consumed func(string)) *Fed {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f := s.NewFed(ctx, stage, node, consumed)
	var wg sync.WaitGroup
	wg.Go(f.Run)
	t.Cleanup(func() { cancel(); wg.Wait() })
	within(t, "the ledger's first read", func() bool { _, ok := f.Count(); return ok })
	return f
}

func fedCount(f *Fed) int { n, _ := f.Count(); return n }

// A producer's ledger counts the task its commit created downstream until
// that task's stage commits, and a requeue (the task written again) does
// not end it; a ledger started later (a restarted producer) finds the task
// by reading the queue; a key a commit with no answer may have written is
// counted only if etcd has it.
func TestFedCountsOutputsUntilDone(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	if _, err := s.Submit(ctx, spec(), Options{}); err != nil {
		t.Fatal(err)
	}
	enc := claimOne(t, s, Encode, "enc", lease)
	f := runFed(t, s, Denoise, "enc")
	if err := s.Commit(ctx, enc, Output{Payloads: payload("cond", "enc")}); err != nil {
		t.Fatal(err)
	}
	if enc.Next.Key == "" {
		t.Fatal("the commit reported no next key")
	}
	f.add(Task{Key: enc.Next.Key}, enc.CommitRev, "")
	if n := fedCount(f); n != 1 || f.Seen() < enc.CommitRev {
		t.Fatalf("after the commit: %d fed at revision %d, want 1 at %d or later", n, f.Seen(), enc.CommitRev)
	}
	later := runFed(t, s, Denoise, "enc")
	other := runFed(t, s, Denoise, "someone-else")
	if n, m := fedCount(later), fedCount(other); n != 1 || m != 0 {
		t.Fatalf("ledgers read from etcd: the producer's %d, another node's %d; want 1 and 0", n, m)
	}
	f.add(Task{Key: s.cfg.Prefix + "/queues/denoise/tasks/never-written"}, 0, "")
	within(t, "a key never written dropped", func() bool { return fedCount(f) == 1 })
	alive := func(string, int64) bool { return true }
	if w := f.Waiting(ctx, alive); len(w) != 1 || w[0].Key != enc.Next.Key {
		t.Fatalf("waiting before any claim: %+v, want the task", w)
	}

	den := claimOne(t, s, Denoise, "den", lease)
	if err := s.Requeue(ctx, den); err != nil {
		t.Fatal(err)
	}
	within(t, "the give-back seen: the task waits", func() bool { return len(f.Waiting(ctx, alive)) == 1 })
	den = claimOne(t, s, Denoise, "den", lease)
	within(t, "the claim seen: nothing waits", func() bool { return len(f.Waiting(ctx, alive)) == 0 })
	if n := fedCount(f); n != 1 {
		t.Fatalf("after a requeue: %d fed, want the task still counted", n)
	}
	if w := f.Waiting(ctx, func(string, int64) bool { return false }); len(w) != 1 {
		t.Fatalf("waiting once its holder is gone: %d tasks, want 1", len(w))
	}
	changed := f.Changed()
	if err := s.Commit(ctx, den, Output{Payloads: payload("latent", "den")}); err != nil {
		t.Fatal(err)
	}
	<-changed
	within(t, "the decoded task gone from both ledgers", func() bool { return fedCount(f) == 0 && fedCount(later) == 0 })
	if f.Seen() < den.CommitRev {
		t.Fatalf("ledger seen at %d, before the deletion it counted (%d)", f.Seen(), den.CommitRev)
	}
}

// commitStage claims the pending task of st, as a node named st, and
// commits it with one output.
func commitStage(t *testing.T, s *Store, st Stage, lease clientv3.LeaseID) *Claim {
	t.Helper()
	c := claimOne(t, s, st, string(st), lease)
	if err := s.Commit(context.Background(), c, Output{Payloads: payload("out-"+string(st), string(st))}); err != nil {
		t.Fatal(err)
	}
	return c
}

// A watch whose history etcd compacted away asks etcd whether the task is
// still there.
func TestFedAfterCompaction(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	if _, err := s.Submit(ctx, spec(), Options{}); err != nil {
		t.Fatal(err)
	}
	enc := commitStage(t, s, Encode, lease)
	den := commitStage(t, s, Denoise, lease)
	resp, err := cli.Put(ctx, s.cfg.Prefix+"/compact-here", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	f := runFed(t, s, Denoise, string(Encode))
	f.add(Task{Key: enc.Next.Key}, enc.CommitRev, "") // its deletion is in the compacted history
	within(t, "the task found gone", func() bool { return fedCount(f) == 0 })
	if f.Seen() < den.CommitRev {
		t.Fatalf("seen %d, before the deletion at %d", f.Seen(), den.CommitRev)
	}
}

// twoEncodes submits two jobs and returns their encode tasks, with the
// ledger of the denoise tasks node "enc" feeds (its consumed hook, NewFed).
func twoEncodes(t *testing.T, consumed func(string)) (*Store, clientv3.LeaseID, *Fed, []Task) {
	t.Helper()
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	for range 2 {
		if _, err := s.Submit(ctx, spec(), Options{}); err != nil {
			t.Fatal(err)
		}
	}
	f := runFedConsumed(t, s, Denoise, "enc", consumed)
	pend, _, err := s.Pending(ctx, Encode)
	if err != nil || len(pend) != 2 {
		t.Fatalf("pending encodes %d %v", len(pend), err)
	}
	return s, lease, f, pend
}

// A task a commit created is counted once its creator's ledger watch sees
// it or the commit's answer says so (Created), whichever comes first, and
// once only; a commit refused creates nothing; a task whose stage was
// done before its creation's answer reached the ledger is not counted
// after it, nor is one a ledger read since shows gone.
func TestFedCountsCreatedTasksOnce(t *testing.T) {
	s, lease, f, pend := twoEncodes(t, nil)
	ctx := context.Background()
	enc, err := s.TryClaim(ctx, pend[0], "enc", lease)
	if err != nil {
		t.Fatal(err)
	}
	out := Output{Payloads: payload("cond", "enc"), Next: s.NextTask(enc)}
	if err := s.Commit(ctx, enc, out); err != nil {
		t.Fatal(err)
	}
	if enc.Next.Key != out.Next.Key || !f.own(enc.Next.Key) {
		t.Fatalf("commit wrote %q, fixed %q; want it under enc's prefix", enc.Next.Key, out.Next.Key)
	}
	within(t, "the watch counts the task", func() bool { return fedCount(f) == 1 })
	f.Created(enc.Next)
	if n := fedCount(f); n != 1 {
		t.Fatalf("after the commit's answer too: %d fed, want 1", n)
	}
	// A commit refused (its claim requeued) creates nothing.
	other, err := s.TryClaim(ctx, pend[1], "enc", lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Requeue(ctx, other); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, other, Output{Payloads: payload("cond2", "enc"), Next: s.NextTask(other)}); err == nil {
		t.Fatal("a requeued claim committed")
	}
	// The first task's stage is done before its creation's answer comes.
	den := claimAtKey(t, s, enc.Next.Key, lease)
	if err := s.Commit(ctx, den, Output{Payloads: payload("latent", "den")}); err != nil {
		t.Fatal(err)
	}
	within(t, "the task's end seen", func() bool { return fedCount(f) == 0 })
	f.Created(enc.Next)
	if n := fedCount(f); n != 0 || f.Seen() < den.CommitRev {
		t.Fatalf("a task that ended, answered late: %d fed (want 0), seen %d (want %d or later)", n, f.Seen(), den.CommitRev)
	}
	// A ledger whose read came after the task's end does not count it.
	later := runFed(t, s, Denoise, "enc")
	later.Created(enc.Next)
	if n := fedCount(later); n != 0 {
		t.Fatalf("a ledger read after the task's end counts %d", n)
	}
}

// claimAtKey claims the denoise task at key.
func claimAtKey(t *testing.T, s *Store, key string, lease clientv3.LeaseID) *Claim {
	t.Helper()
	pend, _, err := s.Pending(context.Background(), Denoise)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pend {
		if p.Key == key {
			c, err := s.TryClaim(context.Background(), p, "den", lease)
			if err != nil {
				t.Fatal(err)
			}
			return c
		}
	}
	t.Fatalf("no pending task at %s", key)
	return nil
}

// A task pushed to a worker returns that worker's credit to its producer
// when it is gone (the worker committed it), once; one not pushed returns
// none.
func TestFedReturnsPushedCredit(t *testing.T) {
	var mu sync.Mutex
	var returned []string
	s, lease, f, pend := twoEncodes(t, func(w string) { mu.Lock(); returned = append(returned, w); mu.Unlock() })
	ctx := context.Background()
	den := runQueue(t, s, Denoise)
	for i, pushedTo := range []string{"den-a", ""} {
		c, err := s.TryClaim(ctx, pend[i], "enc", lease)
		if err != nil {
			t.Fatal(err)
		}
		out := Output{Payloads: payload(fmt.Sprintf("cond%d", i), "enc"), Next: s.NextTask(c)}
		if pushedTo != "" {
			out.Push = &Push{Node: pushedTo, Lease: lease}
		}
		if err := s.Commit(ctx, c, out); err != nil {
			t.Fatal(err)
		}
		f.Created(c.Next)
		var dc *Claim
		if pushedTo != "" {
			within(t, "the push seen", func() bool { return len(den.Pushed(pushedTo, lease)) == 1 })
			dc = den.Pushed(pushedTo, lease)[0]
			den.Take(dc)
		} else {
			dc = claimAtKey(t, s, c.Next.Key, lease)
		}
		if err := s.Commit(ctx, dc, Output{Payloads: payload(fmt.Sprintf("latent%d", i), "den")}); err != nil {
			t.Fatal(err)
		}
	}
	within(t, "both tasks gone", func() bool { return fedCount(f) == 0 })
	mu.Lock()
	defer mu.Unlock()
	if len(returned) != 1 || returned[0] != "den-a" {
		t.Fatalf("credits returned to %q, want one to den-a", returned)
	}
}

// countingWatcher counts the watches asked for, by key.
type countingWatcher struct {
	clientv3.Watcher
	mu   sync.Mutex
	keys []string
}

func (w *countingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.mu.Lock()
	w.keys = append(w.keys, key)
	w.mu.Unlock()
	return w.Watcher.Watch(ctx, key, opts...)
}

// A dispatcher's ledger makes its watches once, one per class of the
// tasks its node creates, and none per task: five tasks created and done
// cost it no watch.
func TestFedWatchesItsPrefixesOnly(t *testing.T) {
	s, cli := newStore(t)
	w := &countingWatcher{Watcher: cli.Watcher}
	cli.Watcher = w
	ctx := context.Background()
	lease := grant(t, cli)
	f := runFed(t, s, Denoise, "enc")
	for i := range 5 {
		if _, err := s.Submit(ctx, spec(), Options{}); err != nil {
			t.Fatal(err)
		}
		c := claimOne(t, s, Encode, "enc", lease)
		if err := s.Commit(ctx, c, Output{Payloads: payload(fmt.Sprintf("cond%d", i), "enc"), Next: s.NextTask(c)}); err != nil {
			t.Fatal(err)
		}
		f.Created(c.Next)
		den := claimAtKey(t, s, c.Next.Key, lease)
		if err := s.Commit(ctx, den, Output{Payloads: payload(fmt.Sprintf("latent%d", i), "den")}); err != nil {
			t.Fatal(err)
		}
	}
	within(t, "every task gone", func() bool { return fedCount(f) == 0 })
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.keys) != len(routing.Classes()) {
		t.Fatalf("the ledger asked for %d watches, want %d (one per class): %q", len(w.keys), len(routing.Classes()), w.keys)
	}
	for _, k := range w.keys {
		if !strings.HasSuffix(k, "/enc/") {
			t.Fatalf("a watch of %q, want only enc's prefixes", k)
		}
	}
}

// A worker that still has another of this ledger's tasks pushed to it
// starts that one in the slot the first leaves: the first's end returns no
// credit (a credit returned then sent a third task to a busy worker), the
// second's does.
func TestFedReturnsNoCreditWhileAnotherIsQueued(t *testing.T) {
	var mu sync.Mutex
	var returned []string
	s, lease, f, pend := twoEncodes(t, func(w string) { mu.Lock(); returned = append(returned, w); mu.Unlock() })
	ctx := context.Background()
	den := runQueue(t, s, Denoise)
	for i := range pend {
		c, err := s.TryClaim(ctx, pend[i], "enc", lease)
		if err != nil {
			t.Fatal(err)
		}
		out := Output{Payloads: payload(fmt.Sprintf("cond%d", i), "enc"), Next: s.NextTask(c), Push: &Push{Node: "den-a", Lease: lease}}
		if err := s.Commit(ctx, c, out); err != nil {
			t.Fatal(err)
		}
		f.Created(c.Next)
	}
	within(t, "both pushes seen", func() bool { return len(den.Pushed("den-a", lease)) == 2 })
	for i, dc := range den.Pushed("den-a", lease) {
		den.Take(dc)
		if err := s.Commit(ctx, dc, Output{Payloads: payload(fmt.Sprintf("latent%d", i), "den")}); err != nil {
			t.Fatal(err)
		}
	}
	// The ledger takes the deletions in order, so a credit the first
	// returned would come before the second's.
	within(t, "both gone, a credit back", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return fedCount(f) == 0 && len(returned) > 0
	})
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(returned, []string{"den-a"}) {
		t.Fatalf("credits returned to %q, want one to den-a, for the second task", returned)
	}
}
