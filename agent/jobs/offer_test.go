package jobs

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// offers collects the claims a Store offers (Config.Offer).
type offers struct {
	mu   sync.Mutex
	list []Offer
}

func (o *offers) add(x Offer) { o.mu.Lock(); o.list = append(o.list, x); o.mu.Unlock() }

func (o *offers) last(t *testing.T) Offer {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.list) == 0 {
		t.Fatal("no claim offered")
	}
	return o.list[len(o.list)-1]
}

// offeringStore is newStore whose pushes are offered to got.
func offeringStore(t *testing.T) (*Store, *clientv3.Client, *offers) {
	t.Helper()
	s, cli := newStore(t)
	got := &offers{}
	s.cfg.Offer = got.add
	return s, cli, got
}

// shortCtx is a context that ends soon: for writes that must wait.
func shortCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

// An offered claim starts before its write answers: the worker takes it
// from its inbox with no revision, and every fenced write waits. The
// write's event (here a read of the claims) confirms it: the claim is then
// fenced by the key's revision like any pushed claim, is not offered again,
// and commits.
func TestOfferedClaimConfirmedByItsWrite(t *testing.T) {
	s, cli, got := offeringStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	q := s.NewInbox(Encode, "enc-1") // not running: its reads are this test's
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Interactive, Push: &Push{Node: "enc-1", Lease: lease}})
	if err != nil {
		t.Fatal(err)
	}
	o := got.last(t)
	if o.Stage != Encode || o.Node != "enc-1" {
		t.Fatalf("offer %+v", o)
	}
	if err := q.Offered(o.Key, o.Value); err != nil {
		t.Fatal(err)
	}
	ps := q.Pushed(lease)
	if len(ps) != 1 || !ps[0].Offered() || ps[0].Task.JobID != job.ID || ps[0].Revision() != 0 {
		t.Fatalf("offered claims %+v", ps)
	}
	if _, _, n := q.Oldest(lease); n != 0 {
		t.Fatalf("an offered claim counts among those to give back (%d)", n)
	}
	c := ps[0]
	q.Take(c)
	if err := s.Drop(shortCtx(t), c); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a fenced write on an unsettled offer: %v, want it to wait", err)
	}
	if _, err := q.load(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Settle(ctx); err != nil || c.Withdrawn() || c.Revision() == 0 {
		t.Fatalf("after the write's event: settle %v, withdrawn %v, fence %d", err, c.Withdrawn(), c.Revision())
	}
	if n := len(q.Pushed(lease)); n != 0 {
		t.Fatalf("a confirmed offer the worker runs is offered again (%d)", n)
	}
	if err := s.Commit(ctx, c, Output{Payloads: payload("cond", "enc-1")}); err != nil {
		t.Fatalf("commit on a confirmed offer: %v", err)
	}
	q.Done(c)
	if len(q.taken) != 0 {
		t.Fatalf("left behind: taken %v", q.taken)
	}
}

// An offer not yet taken is confirmed in place: the inbox then offers the
// claim as written, with its revision.
func TestOfferConfirmedBeforeItsTaken(t *testing.T) {
	s, cli, got := offeringStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	q := s.NewInbox(Encode, "enc-1")
	if _, err := s.Submit(ctx, spec(), Options{Push: &Push{Node: "enc-1", Lease: lease}}); err != nil {
		t.Fatal(err)
	}
	o := got.last(t)
	if err := q.Offered(o.Key, o.Value); err != nil {
		t.Fatal(err)
	}
	stale := q.Pushed(lease)[0] // read before the write's event
	if _, err := q.load(ctx); err != nil {
		t.Fatal(err)
	}
	ps := q.Pushed(lease)
	if len(ps) != 1 || ps[0].Offered() || ps[0].Rev == 0 {
		t.Fatalf("after the write's event: %+v", ps)
	}
	// Taken from a read made before the event, the claim is the one
	// written all the same, and it is not offered again.
	q.Take(stale)
	if err := stale.Settle(ctx); err != nil || stale.Revision() != ps[0].Rev {
		t.Fatalf("the offer read before its event: %v, fence %d, want %d", err, stale.Revision(), ps[0].Rev)
	}
	if n := len(q.Pushed(lease)); n != 0 {
		t.Fatalf("the claim is offered again after its offer was taken (%d)", n)
	}
}

// An offer that no write confirms is refused when its time runs out: its
// fenced writes fail with ErrFenced and write nothing; a claim written
// with other bytes than offered refuses the offer, and is offered as any
// pushed claim.
func TestOfferRefused(t *testing.T) {
	s, cli, got := offeringStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	q := s.NewInbox(Denoise, "den-1")

	// Never written: a push whose transaction never went.
	ghost := Task{ID: newID(), JobID: newID(), Stage: Denoise, EnqueuedAt: time.Now()}
	ghost.Key = s.taskKey(&ghost)
	s.pushOps(&ghost, &Push{Node: "den-1", Lease: lease}, time.Now(), "")
	o := got.last(t)
	if err := q.Offered(o.Key, o.Value); err != nil {
		t.Fatal(err)
	}
	c := q.Pushed(lease)[0]
	q.Take(c)
	q.expire(ghost.ID, c.offer)
	if !c.Withdrawn() {
		t.Fatal("an offer past its time is not withdrawn")
	}
	if err := s.Drop(ctx, c); !errors.Is(err, ErrFenced) {
		t.Fatalf("drop of a withdrawn offer: %v, want ErrFenced", err)
	}
	if err := s.Commit(ctx, c, Output{Payloads: payload("lat", "den-1")}); !errors.Is(err, ErrFenced) {
		t.Fatalf("commit of a withdrawn offer: %v, want ErrFenced", err)
	}
	if resp, err := cli.Get(ctx, s.cfg.Prefix+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || resp.Count != 0 {
		t.Fatalf("a withdrawn offer wrote %d keys (%v)", resp.Count, err)
	}
	q.Done(c)

	// Written with other bytes (a transaction built again): the offer is
	// refused and the claim written waits in the inbox.
	other := Task{ID: newID(), JobID: newID(), Stage: Denoise, EnqueuedAt: time.Now()}
	other.Key = s.taskKey(&other)
	s.pushOps(&other, &Push{Node: "den-1", Lease: lease}, time.Now(), "")
	first := got.last(t)
	if err := q.Offered(first.Key, first.Value); err != nil {
		t.Fatal(err)
	}
	c = q.Pushed(lease)[0]
	q.Take(c)
	ops := s.pushOps(&other, &Push{Node: "den-1", Lease: lease}, time.Now().Add(time.Second), "")
	if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := q.load(ctx); err != nil {
		t.Fatal(err)
	}
	if !c.Withdrawn() {
		t.Fatal("an offer written with other bytes is not withdrawn")
	}
	ps := q.Pushed(lease)
	if len(ps) != 1 || ps[0].Offered() || ps[0].Rev == 0 || ps[0].Task.ID != other.ID {
		t.Fatalf("the claim written: %+v", ps)
	}
}

// Offered takes only a claim pushed to its own node and stage.
func TestOfferedChecksTheClaim(t *testing.T) {
	s, cli, got := offeringStore(t)
	lease := grant(t, cli)
	task := Task{ID: newID(), JobID: newID(), Stage: Denoise, EnqueuedAt: time.Now()}
	task.Key = s.taskKey(&task)
	s.pushOps(&task, &Push{Node: "den-1", Lease: lease}, time.Now(), "")
	o := got.last(t)
	for name, tc := range map[string]struct {
		q          *Inbox
		key, value string
	}{
		"another node":  {s.NewInbox(Denoise, "den-2"), o.Key, string(o.Value)},
		"another stage": {s.NewInbox(Decode, "den-1"), o.Key, string(o.Value)},
		"key of another task": {s.NewInbox(Denoise, "den-1"),
			s.claimKey(Denoise, "den-1", newID()), string(o.Value)},
		"not json":   {s.NewInbox(Denoise, "den-1"), o.Key, "{"},
		"not a push": {s.NewInbox(Denoise, "den-1"), o.Key, `{"task":"` + task.ID + `","node":"den-1"}`},
		"too large":  {s.NewInbox(Denoise, "den-1"), o.Key, string(make([]byte, MaxOfferBytes+1))},
	} {
		if err := tc.q.Offered(tc.key, []byte(tc.value)); err == nil {
			t.Errorf("%s: offer taken", name)
		}
		if n := len(tc.q.Pushed(lease)); n != 0 {
			t.Errorf("%s: %d claims in the inbox", name, n)
		}
	}
}
