package jobs

// Tests of ending a stage (commit.go): rewinds, released inputs, finished
// jobs, and retention leases etcd forgot.

import (
	"context"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

func TestRewindThenFail(t *testing.T) {
	s, cli := newStore(t)
	s.cfg.MaxRewinds = 1
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	for i := 0; i < 2; i++ {
		den := claimAt(t, s, lease, Denoise)
		if err := s.Rewind(ctx, den, "producer gone"); err != nil {
			t.Fatal(err)
		}
	}
	got, _ := s.Get(ctx, job.ID)
	if got.State != Failed || got.Error.Code != "payload_lost" || got.Rewinds != 1 {
		t.Fatalf("after two losses: %+v", got)
	}
	if q, _, _, _ := s.Depth(ctx, Encode); q != 0 {
		t.Fatalf("failed job left an encode task")
	}
}

// A Store input is released in the consumer's commit: its object record goes.
func TestStoreInputReleasedOnCommit(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard, Transfer: StoreRelay})
	enc := claimOne(t, s, Encode, "enc-1", lease)
	obj := cache.JobObjectID(job.ID, "encode.x")
	key := cache.ObjectKey(s.cfg.Prefix, obj)
	out := Output{Payloads: []Input{{Payload: obj, Node: "enc-1", Store: true}}, Records: []StagedRecord{fixedRecord{clientv3.OpPut(key, `{"id":"`+obj+`"}`)}}}
	if err := s.Commit(ctx, enc, out); err != nil {
		t.Fatal(err)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 0 {
		t.Fatalf("a Store output got a payload record: %+v", prs)
	}
	den := claimOne(t, s, Denoise, "den-1", lease)
	if den.Task.Transfer != StoreRelay || len(den.Task.Inputs) != 1 || !den.Task.Inputs[0].Store {
		t.Fatalf("denoise task: %+v", den.Task)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	if r, _ := cli.Get(ctx, key); len(r.Kvs) != 0 {
		t.Fatal("consumed Store object's record survived the commit")
	}
}

// A claim on a task whose job has finished removes the orphan task too.
func TestCommitOnFinishedJobRemovesOrphanTask(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	enc := claimAt(t, s, lease, Encode)
	// Simulate the orphan: the job finishes while a task for it still exists.
	if _, err := s.Cancel(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.Drop(ctx, enc); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, enc.Task.Key, mustJSON(enc.Task)); err != nil {
		t.Fatal(err)
	}
	pend, _, _ := s.Pending(ctx, Encode)
	if len(pend) != 1 {
		t.Fatalf("orphan not set up: %v", pend)
	}
	c, err := s.TryClaim(ctx, pend[0], "w2", lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, c, Output{Payloads: payload("x", "w2")}); !errors.Is(err, ErrFinished) {
		t.Fatalf("commit on cancelled job: %v", err)
	}
	if q, r, _, _ := s.Depth(ctx, Encode); q != 0 || r != 0 {
		t.Fatalf("orphan task survived: depth %d/%d", q, r)
	}
}

// leasedRecord is a staged record on a lease it renews as cache.Staged
// does: a fresh grant when etcd forgot the old one.
type leasedRecord struct {
	cli     *clientv3.Client
	key     string
	lease   clientv3.LeaseID
	renewed int
}

func (r *leasedRecord) Op() clientv3.Op {
	return clientv3.OpPut(r.key, "{}", clientv3.WithLease(r.lease))
}

func (r *leasedRecord) Renew(ctx context.Context) error {
	g, err := r.cli.Grant(ctx, 60)
	if err != nil {
		return err
	}
	r.lease, r.renewed = g.ID, r.renewed+1
	return nil
}

// A commit whose retention leases etcd no longer knows (an etcd replaced
// or restored): the job record's and a staged record's. Both are renewed
// and the commit goes through, once, without spinning.
func TestCommitRenewsForgottenLeases(t *testing.T) {
	s, cli := newStore(t)
	s.cfg.Retention = time.Hour
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	enc := claimOne(t, s, Encode, "enc-1", lease)
	if err := s.Commit(ctx, enc, Output{Payloads: payload("emb", "enc-1")}); err != nil {
		t.Fatal(err)
	}
	den := claimOne(t, s, Denoise, "den-1", lease)
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	// The job's retention lease is granted and cached by a first finished
	// job, then revoked behind the Store's back, as a new etcd would not
	// know it.
	other, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	if _, err := s.Cancel(ctx, other.ID); err != nil {
		t.Fatal(err)
	}
	r, err := cli.Get(ctx, s.jobKey(other.ID))
	if err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease == 0 {
		t.Fatalf("finished job record not on a retention lease: %v %v", r, err)
	}
	if _, err := cli.Revoke(ctx, clientv3.LeaseID(r.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	stale, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, stale.ID); err != nil {
		t.Fatal(err)
	}
	rec := &leasedRecord{cli: cli, key: cache.ObjectKey(s.cfg.Prefix, ResultID(job.ID)), lease: stale.ID}

	dec := claimOne(t, s, Decode, "dec-1", lease)
	res := &Result{ContentType: "image/png", Bytes: 42, SHA256: "ab", Object: ResultID(job.ID)}
	if err := s.Commit(ctx, dec, Output{Result: res, Records: []StagedRecord{rec}}); err != nil {
		t.Fatalf("commit with forgotten leases: %v", err)
	}
	if rec.renewed != 1 {
		t.Fatalf("staged record renewed %d times, want 1", rec.renewed)
	}
	got, err := s.Get(ctx, job.ID)
	if err != nil || got.State != Succeeded || got.Stages[Decode].Attempt != 1 {
		t.Fatalf("job after the commit: %+v %v", got, err)
	}
	if r, _ := cli.Get(ctx, rec.key); len(r.Kvs) != 1 || r.Kvs[0].Lease != int64(rec.lease) {
		t.Fatalf("result record not written on the renewed lease: %+v", r.Kvs)
	}

	// A lease that stays unknown however often it is renewed ends the
	// commit with the error after a bounded number of tries.
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Standard}); err != nil {
		t.Fatal(err)
	}
	e2 := claimOne(t, s, Encode, "enc-1", lease)
	bad := &forgetfulRecord{op: clientv3.OpPut("k", "v", clientv3.WithLease(stale.ID))}
	err = s.Commit(ctx, e2, Output{Payloads: payload("emb2", "enc-1"), Records: []StagedRecord{bad}})
	if !cache.LeaseGone(err) {
		t.Fatalf("commit with a lease that stays gone: %v, want lease not found", err)
	}
	if bad.renewed != leaseRenewals {
		t.Fatalf("renewed %d times, want %d", bad.renewed, leaseRenewals)
	}
}

// forgetfulRecord never gets a lease etcd knows.
type forgetfulRecord struct {
	op      clientv3.Op
	renewed int
}

func (r *forgetfulRecord) Op() clientv3.Op { return r.op }
func (r *forgetfulRecord) Renew(ctx context.Context) error {
	r.renewed++
	return nil
}

// A job whose conditioning is in the cache starts at its denoise, with an
// encode stage record that says so; its commit (and a cancel) keeps the
// cache entries, which other jobs share, and releases nothing else.
func TestCachedConditioningSkipsEncode(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	keys := []string{cache.ObjectKey(s.cfg.Prefix, "cond.v.p"), cache.ObjectKey(s.cfg.Prefix, "cond.v.n")}
	for _, k := range keys {
		if _, err := cli.Put(ctx, k, `{"id":"x"}`); err != nil {
			t.Fatal(err)
		}
	}
	cond := []Input{{Payload: "cond.v.p", Node: "enc-1", Store: true, Cached: true}, {Payload: "cond.v.n", Node: "enc-1", Store: true, Cached: true}}
	if _, err := s.Submit(ctx, spec(), Options{Class: routing.Standard, Cond: []Input{{Payload: "x", Store: true}}}); err == nil {
		t.Fatal("a conditioning input that is no cache entry was accepted")
	}
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard, Cond: cond})
	if err != nil {
		t.Fatal(err)
	}
	if q, _, _, _ := s.Depth(ctx, Encode); q != 0 {
		t.Fatalf("a cached job has an encode task")
	}
	if job.Stage != Denoise || job.Stages[Encode] == nil || !job.Stages[Encode].Cached || job.Stages[Encode].Node != "enc-1" {
		t.Fatalf("submitted job: stage %s, encode record %+v", job.Stage, job.Stages[Encode])
	}
	den := claimOne(t, s, Denoise, "den-1", lease)
	if len(den.Task.Inputs) != 2 || !den.Task.Inputs[1].Cached {
		t.Fatalf("denoise task inputs %+v", den.Task.Inputs)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	got, _ := s.Get(ctx, job.ID)
	if !got.Stages[Encode].Cached || got.Stages[Denoise] == nil {
		t.Fatalf("after the denoise: %+v", got.Stages)
	}
	// A second job on the same entries, cancelled while queued.
	job2, err := s.Submit(ctx, spec(), Options{Class: routing.Standard, Cond: cond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Cancel(ctx, job2.ID); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if r, _ := cli.Get(ctx, k); len(r.Kvs) != 1 {
			t.Fatalf("cache entry %s released by a consumer", k)
		}
	}
}
