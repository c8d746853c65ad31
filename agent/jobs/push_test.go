package jobs

import (
	"context"
	"maps"
	"strings"
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/etcdembed"

	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// A pushed claim: the submit (or a commit) claims the new task for the
// named worker in its own transaction. The worker's view offers it once
// (Pushed, then Take), the task is never pending for others, and the
// worker runs and commits it as if it had claimed it: fenced by the claim
// the push made, which lives on the worker's lease.
func TestPushedClaims(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	enc, den := runQueue(t, s, Encode), runQueue(t, s, Denoise)
	encLease, denLease := grant(t, cli), grant(t, cli)

	job, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-1", Lease: encLease}})
	if err != nil {
		t.Fatal(err)
	}
	within(t, "push seen", func() bool { return len(enc.Pushed("enc-1", encLease)) == 1 })
	if p := enc.Pending(); len(p) != 0 {
		t.Fatalf("a pushed task is pending for others: %+v", p)
	}
	if n := len(enc.Pushed("enc-2", encLease)) + len(enc.Pushed("enc-1", denLease)); n != 0 {
		t.Fatalf("%d pushed claims offered to another node or lease", n)
	}
	c := enc.Pushed("enc-1", encLease)[0]
	if !c.Pushed || c.Task.JobID != job.ID || c.Task.Attempt != 1 || c.Task.Hint != "enc-1" || c.Lease != encLease {
		t.Fatalf("pushed claim %+v", c)
	}
	enc.Take(c)
	if n := len(enc.Pushed("enc-1", encLease)); n != 0 {
		t.Fatalf("a taken claim is offered again (%d)", n)
	}
	// Someone else's claim attempt on the pushed task loses.
	if _, err := s.TryClaim(ctx, c.Task, "enc-2", grant(t, cli)); err != ErrTaken {
		t.Fatalf("claim of a pushed task: %v, want ErrTaken", err)
	}
	// The worker commits on the pushed claim, pushing denoise on.
	if err := s.Commit(ctx, c, Output{Payloads: payload("cond", "enc-1"), Hint: "den-1", Push: &Push{Node: "den-1", Lease: denLease}}); err != nil {
		t.Fatal(err)
	}
	within(t, "denoise push seen", func() bool { return len(den.Pushed("den-1", denLease)) == 1 })
	within(t, "encode claim gone", func() bool { _, r := enc.Depth(); return r == 0 })
	dc := den.Pushed("den-1", denLease)[0]
	j, err := s.Get(ctx, job.ID)
	if err != nil || j.Progress == nil || j.Progress.Stage != Denoise || j.Progress.Node != "den-1" {
		t.Fatalf("progress after the push: %+v %v", j.Progress, err)
	}
	// The pushed worker gives it back (it has no slot), taking it out of
	// its inbox as the agent does: the task waits for its dispatcher, its
	// claim gone, and a give-back is not a failed attempt.
	if err := s.Requeue(ctx, dc); err != nil {
		t.Fatal(err)
	}
	den.Take(dc)
	within(t, "given back", func() bool { return len(den.Pending()) == 1 && len(den.Pushed("den-1", denLease)) == 0 })
	back := den.Pending()[0]
	if back.Requeues != 1 || back.Attempt != 1 {
		t.Fatalf("given-back task: attempt %d, requeues %d", back.Attempt, back.Requeues)
	}
	c2, err := s.TryClaim(ctx, back, "den-2", grant(t, cli))
	if err != nil || c2.Task.Attempt != 2 {
		t.Fatalf("claim after the give-back: %+v %v", c2, err)
	}
}

// A push to a worker whose lease has ended (it died after the producer
// chose it) must not fail the submit or the commit: the task is queued
// for anyone instead.
func TestPushToEndedLease(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	enc := runQueue(t, s, Encode)
	dead := grant(t, cli)
	if _, err := cli.Revoke(ctx, dead); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Standard, Push: &Push{Node: "gone", Lease: dead}}); err != nil {
		t.Fatalf("submit pushing to an ended lease: %v", err)
	}
	within(t, "queued", func() bool { return len(enc.Pending()) == 1 })
	c, err := s.TryClaim(ctx, enc.Pending()[0], "enc-1", grant(t, cli))
	if err != nil {
		t.Fatal(err)
	}
	den := runQueue(t, s, Denoise)
	if err := s.Commit(ctx, c, Output{Payloads: payload("cond", "enc-1"), Hint: "gone", Push: &Push{Node: "gone", Lease: dead}}); err != nil {
		t.Fatalf("commit pushing to an ended lease: %v", err)
	}
	within(t, "denoise queued", func() bool { return len(den.Pending()) == 1 })
	if resp, err := cli.Get(ctx, s.claimPrefix(Denoise), clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || resp.Count != 0 {
		t.Fatalf("denoise claims %v %v, want none", resp.Count, err)
	}
}

// Cancelling a job whose first task is pushed to a worker that has not
// started it deletes the claim with the task: nobody else would, and it
// would live as long as the worker's lease.
func TestCancelDropsPushedClaim(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	enc := runQueue(t, s, Encode)
	lease := grant(t, cli)
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard, Push: &Push{Node: "enc-1", Lease: lease}})
	if err != nil {
		t.Fatal(err)
	}
	within(t, "push seen", func() bool { return len(enc.Pushed("enc-1", lease)) == 1 })
	if _, err := s.Cancel(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
	within(t, "claim gone from the view", func() bool { _, r := enc.Depth(); return r == 0 })
	// The claim went with the cancel; the cancel's marker beside it goes
	// once the holder's inbox has seen it, which may be a moment after its
	// view lost the claim.
	within(t, "no claim key left", func() bool {
		resp, err := cli.Get(ctx, s.claimPrefix(Encode), clientv3.WithPrefix(), clientv3.WithCountOnly())
		return err == nil && resp.Count == 0
	})
}

// A pushed claim its worker has not started is handed over to another
// worker in one transaction: the view offers it to that worker alone, with
// a fencing token of its own and without the tickets issued to the first,
// so the first worker's copy can no longer write; a hand-over to a lease
// that ended is refused with nothing changed.
func TestHandOver(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	enc := runQueue(t, s, Encode)
	l1, l2 := grant(t, cli), grant(t, cli)
	if _, err := s.Submit(ctx, spec(), Options{Push: &Push{Node: "enc-1", Lease: l1}}); err != nil {
		t.Fatal(err)
	}
	within(t, "push seen", func() bool { return len(enc.Pushed("enc-1", l1)) == 1 })
	c := enc.Pushed("enc-1", l1)[0]
	if err := s.HandOver(ctx, c, &Push{Node: "enc-2", Lease: l2}); err != nil {
		t.Fatal(err)
	}
	enc.Take(c) // as the agent does once its hand-over lands
	within(t, "hand-over seen", func() bool { return len(enc.Pushed("enc-2", l2)) == 1 })
	if n := len(enc.Pushed("enc-1", l1)); n != 0 || len(enc.Pending()) != 0 {
		t.Fatalf("after the hand-over: %d offered to enc-1, %d pending", n, len(enc.Pending()))
	}
	c2 := enc.Pushed("enc-2", l2)[0]
	if c2.Rev == c.Rev || c2.Task.Hint != "enc-2" || c2.Task.Attempt != c.Task.Attempt || c2.Task.Requeues != 0 || enc.HeldBy("enc-1") != 0 || enc.HeldBy("enc-2") != 1 {
		t.Fatalf("handed-over claim %+v (token %d, was %d)", c2, c2.Rev, c.Rev)
	}
	if err := s.Requeue(ctx, c); err != ErrFenced {
		t.Fatalf("the first worker's give-back after the hand-over: %v, want ErrFenced", err)
	}
	if err := s.HandOver(ctx, c, &Push{Node: "enc-3", Lease: l2}); err != ErrFenced {
		t.Fatalf("a second hand-over of the first worker's copy: %v, want ErrFenced", err)
	}
	gone := grant(t, cli)
	if _, err := cli.Revoke(ctx, gone); err != nil {
		t.Fatal(err)
	}
	if err := s.HandOver(ctx, c2, &Push{Node: "enc-3", Lease: gone}); !cache.LeaseGone(err) {
		t.Fatalf("a hand-over to an ended lease: %v, want the lease not found", err)
	}
	// A denoise task pushed with a ticket for its input: the ticket names
	// den-1, so den-2 gets the task without it.
	den := runQueue(t, s, Denoise)
	d1, d2 := grant(t, cli), grant(t, cli)
	in := payload("cond", "enc-2")
	in[0].Ticket = []byte("issued-to-den-1")
	if err := s.Commit(ctx, c2, Output{Payloads: in, Push: &Push{Node: "den-1", Lease: d1}}); err != nil {
		t.Fatalf("the new holder's commit: %v", err)
	}
	within(t, "denoise push seen", func() bool { return len(den.Pushed("den-1", d1)) == 1 })
	dc := den.Pushed("den-1", d1)[0]
	if string(dc.Task.Inputs[0].Ticket) != "issued-to-den-1" {
		t.Fatalf("pushed input %+v, want its ticket", dc.Task.Inputs[0])
	}
	if err := s.HandOver(ctx, dc, &Push{Node: "den-2", Lease: d2}); err != nil {
		t.Fatal(err)
	}
	within(t, "denoise hand-over seen", func() bool { return len(den.Pushed("den-2", d2)) == 1 })
	if got := den.Pushed("den-2", d2)[0].Task.Inputs; len(got) != 1 || got[0].Payload != "cond" || len(got[0].Ticket) != 0 {
		t.Fatalf("handed-over inputs %+v, want cond without a ticket", got)
	}
}

// A claim pushed by the transaction that writes the job record (a submit,
// a commit) carries the record, at the claim's revision: its worker
// commits with one transaction and no read of the record. A dispatcher's
// later hand-on carries none, and the commit reads it.
func TestPushedClaimCarriesTheJobRecord(t *testing.T) {
	ctx := context.Background()
	srv, err := etcdembed.Start(ctx, etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	var mu sync.Mutex
	calls := map[string]int{}
	cli := srv.Client(func(method string, _, _ any, _ error) {
		mu.Lock()
		calls[method[strings.LastIndex(method, "/")+1:]]++
		mu.Unlock()
	})
	t.Cleanup(func() { cli.Close() })
	cfg := DefaultConfig()
	cfg.Logger = zaptest.NewLogger(t)
	s, err := NewStore(cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	enc, den := runQueue(t, s, Encode), runQueue(t, s, Denoise)
	encLease, denLease := grant(t, cli), grant(t, cli)
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-1", Lease: encLease}}); err != nil {
		t.Fatal(err)
	}
	within(t, "push seen", func() bool { return len(enc.Pushed("enc-1", encLease)) == 1 })
	c := enc.Pushed("enc-1", encLease)[0]
	if c.job == nil || c.jobRev != c.Rev {
		t.Fatalf("the pushed claim carries record %q at revision %d, want the record at the claim's revision %d", c.job, c.jobRev, c.Rev)
	}
	count := func(do func()) map[string]int {
		mu.Lock()
		clear(calls)
		mu.Unlock()
		do()
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(calls)
	}
	got := count(func() {
		if err := s.Commit(ctx, c, Output{Payloads: payload("cond", "enc-1")}); err != nil {
			t.Fatal(err)
		}
	})
	if got["Range"] != 0 || got["Txn"] != 1 {
		t.Fatalf("a commit on a claim pushed with its record made %v, want one Txn and no Range", got)
	}
	// The denoise task waits (no push): its dispatcher hands it on later,
	// and that claim carries no record.
	waiting := den.Pending()
	if len(waiting) != 1 {
		t.Fatalf("%d denoise tasks wait, want 1", len(waiting))
	}
	if _, err := s.Assign(ctx, waiting[0], &Push{Node: "den-1", Lease: denLease}); err != nil {
		t.Fatal(err)
	}
	within(t, "hand-on seen", func() bool { return len(den.Pushed("den-1", denLease)) == 1 })
	dc := den.Pushed("den-1", denLease)[0]
	if dc.job != nil {
		t.Fatalf("a hand-on's claim carries a record: %q", dc.job)
	}
	got = count(func() {
		if err := s.Commit(ctx, dc, Output{Payloads: payload("latent", "den-1")}); err != nil {
			t.Fatal(err)
		}
	})
	if got["Range"] != 1 || got["Txn"] != 1 {
		t.Fatalf("a commit on a handed-on claim made %v, want one Range and one Txn", got)
	}
}
