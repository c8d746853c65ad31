package jobs

// Tests of claiming and giving back (claim.go): fencing, backoff, reclaim,
// requeue.

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// A worker whose lease expired cannot commit, and its task goes to another.
func TestFencing(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	dead := grant(t, cli)
	stale := claimOne(t, s, Encode, "dead", dead)
	if _, err := cli.Revoke(ctx, dead); err != nil { // what lease expiry does
		t.Fatal(err)
	}
	live := grant(t, cli)
	fresh := claimOne(t, s, Encode, "live", live)
	if fresh.Task.Attempt != 2 {
		t.Fatalf("attempt = %d, want 2", fresh.Task.Attempt)
	}
	if err := s.Commit(ctx, stale, Output{Payloads: payload("stale", "dead")}); !errors.Is(err, ErrFenced) {
		t.Fatalf("stale commit: %v, want ErrFenced", err)
	}
	if err := s.Commit(ctx, fresh, Output{Payloads: payload("fresh", "live")}); err != nil {
		t.Fatal(err)
	}
	// Also fenced after the fresh commit: the claim no longer exists at all.
	if err := s.Commit(ctx, stale, Output{Payloads: payload("stale", "dead")}); !errors.Is(err, ErrFenced) {
		t.Fatalf("stale commit after fresh: %v, want ErrFenced", err)
	}
	got, _ := s.Get(ctx, job.ID)
	if got.Stages[Encode].Node != "live" || got.Stage != Denoise {
		t.Fatalf("job after fencing: %+v", got)
	}
	prs, _ := s.Payloads(ctx)
	if len(prs) != 1 || prs[0].Payload != "fresh" {
		t.Fatalf("payload records: %+v, want only fresh", prs)
	}
	pend, _, _ := s.Pending(ctx, Denoise)
	if len(pend) != 1 {
		t.Fatalf("denoise tasks: %d, want exactly 1", len(pend))
	}
}

func TestPendingOrderAndBackoff(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	for _, c := range []routing.Class{routing.Batch, routing.Standard, routing.Interactive} {
		if _, err := s.Submit(ctx, spec(), Options{Class: c}); err != nil {
			t.Fatal(err)
		}
	}
	pend, _, err := s.Pending(ctx, Encode)
	if err != nil {
		t.Fatal(err)
	}
	var classes []routing.Class
	for _, p := range pend {
		classes = append(classes, p.Class)
	}
	if len(classes) != 3 || classes[0] != routing.Interactive || classes[2] != routing.Batch {
		t.Fatalf("pending classes in order %v", classes)
	}
	lease := grant(t, cli)
	c, err := s.TryClaim(ctx, pend[0], "w", lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Abandon(ctx, c, time.Minute); err != nil {
		t.Fatal(err)
	}
	pend, _, _ = s.Pending(ctx, Encode)
	if len(pend) != 3 || pend[0].NotBefore.Before(time.Now().Add(30*time.Second)) || pend[0].Attempt != 1 {
		t.Fatalf("abandoned task: %+v", pend[0])
	}
}

// A worker that abandons a task after the job was cancelled must not bring
// the deleted task back (it would be claimed and run for nothing, forever).
func TestAbandonAfterCancelKeepsTaskDeleted(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	den := claimAt(t, s, lease, Denoise)
	if _, err := s.Cancel(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.Abandon(ctx, den, time.Millisecond); !errors.Is(err, ErrFenced) {
		t.Fatalf("abandon after cancel: %v, want ErrFenced", err)
	}
	if pend, _, _ := s.Pending(ctx, Denoise); len(pend) != 0 {
		t.Fatalf("cancelled job's task is back: %+v", pend)
	}
	// The stale claim still goes away: Drop releases it.
	if err := s.Drop(ctx, den); err != nil {
		t.Fatal(err)
	}
	if q, r, _, _ := s.Depth(ctx, Denoise); q != 0 || r != 0 {
		t.Fatalf("denoise depth %d/%d after drop", q, r)
	}
}

// A worker whose lease expired with its output finished takes the task back
// under its new lease only while nobody else has claimed it since, commits
// under the new claim as the same attempt, and the old claim stays fenced.
func TestReclaimAfterLostLease(t *testing.T) {
	for _, tc := range []struct {
		name    string
		between func(t *testing.T, s *Store, cli *clientv3.Client, c *Claim) // after the old lease is gone
		want    error
	}{
		{"unclaimed since", func(*testing.T, *Store, *clientv3.Client, *Claim) {}, nil},
		{"claimed by another worker", func(t *testing.T, s *Store, cli *clientv3.Client, c *Claim) {
			claimOne(t, s, Encode, "enc-2", grant(t, cli))
		}, ErrTaken},
		{"claimed and given back", func(t *testing.T, s *Store, cli *clientv3.Client, c *Claim) {
			other := claimOne(t, s, Encode, "enc-2", grant(t, cli))
			if err := s.Abandon(context.Background(), other, 0); err != nil {
				t.Fatal(err)
			}
		}, ErrTaken},
		{"job cancelled", func(t *testing.T, s *Store, cli *clientv3.Client, c *Claim) {
			if _, err := s.Cancel(context.Background(), c.Task.JobID); err != nil {
				t.Fatal(err)
			}
		}, ErrTaken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, cli := newStore(t)
			ctx := context.Background()
			job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard})
			if err != nil {
				t.Fatal(err)
			}
			old := grant(t, cli)
			c := claimOne(t, s, Encode, "enc-1", old)
			if _, err := cli.Revoke(ctx, old); err != nil { // the lease expired
				t.Fatal(err)
			}
			// Under the lease that went, it fails as the lease, not the task.
			if _, err := s.Reclaim(ctx, c, old); !errors.Is(err, rpctypes.ErrLeaseNotFound) {
				t.Fatalf("reclaim under the revoked lease: %v, want lease not found", err)
			}
			tc.between(t, s, cli, c)
			lease := grant(t, cli)
			got, err := s.Reclaim(ctx, c, lease)
			if !errors.Is(err, tc.want) {
				t.Fatalf("reclaim: %v, want %v", err, tc.want)
			}
			if err != nil {
				return
			}
			// A retry of a reclaim whose answer was lost finds its claim.
			if again, err := s.Reclaim(ctx, c, lease); err != nil || again.Rev != got.Rev {
				t.Fatalf("reclaim again: %+v %v, want the claim at %d", again, err, got.Rev)
			}
			// Another worker cannot take it now, nor can the old claim commit.
			if _, err := s.Reclaim(ctx, c, grant(t, cli)); !errors.Is(err, ErrTaken) {
				t.Fatalf("reclaim on another lease: %v, want ErrTaken", err)
			}
			out := Output{Payloads: payload("emb", "enc-1")}
			if err := s.Commit(ctx, c, out); !errors.Is(err, ErrFenced) {
				t.Fatalf("commit under the old claim: %v, want ErrFenced", err)
			}
			if err := s.Commit(ctx, got, out); err != nil {
				t.Fatal(err)
			}
			done, err := s.Get(ctx, job.ID)
			if err != nil {
				t.Fatal(err)
			}
			if st := done.Stages[Encode]; st == nil || st.Attempt != 1 || done.Stage != Denoise {
				t.Fatalf("after the reclaimed commit: %+v", done)
			}
		})
	}
}

// A requeue gives a running task back at once, in its place in the queue,
// with the job's deadline, counted as a requeue and not a failure; it is
// fenced, so a requeued claim can no longer commit.
func TestRequeueKeepsPlaceAndFences(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	deadline := time.Now().Add(time.Minute).UTC().Truncate(time.Millisecond)
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Batch, Deadline: deadline}); err != nil {
		t.Fatal(err)
	}
	den := claimAt(t, s, lease, Denoise)
	if !den.Task.Deadline.Equal(deadline) {
		t.Fatalf("denoise task deadline %v, want the job's %v", den.Task.Deadline, deadline)
	}
	if err := s.Requeue(ctx, den); err != nil {
		t.Fatal(err)
	}
	pend, _, err := s.Pending(ctx, Denoise)
	if err != nil || len(pend) != 1 {
		t.Fatalf("pending after requeue: %+v %v", pend, err)
	}
	if p := pend[0]; p.Key != den.Task.Key || p.Requeues != 1 || !p.NotBefore.IsZero() || !p.EnqueuedAt.Equal(den.Task.EnqueuedAt) {
		t.Fatalf("requeued task %+v: want the same key and enqueue time, one requeue, no backoff", p)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("late", "denoise")}); !errors.Is(err, ErrFenced) {
		t.Fatalf("commit of a requeued claim: %v, want ErrFenced", err)
	}
	if err := s.Requeue(ctx, den); !errors.Is(err, ErrFenced) {
		t.Fatalf("second requeue: %v, want ErrFenced", err)
	}
}
