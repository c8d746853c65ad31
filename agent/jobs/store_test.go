package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// newStore starts a real embedded etcd and returns a Store on it.
func newStore(t *testing.T) (*Store, *clientv3.Client) {
	t.Helper()
	ctx := context.Background()
	srv, err := etcdembed.Start(ctx, etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zaptest.NewLogger(t).Named("etcdclient")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	cfg := DefaultConfig()
	cfg.Logger = zaptest.NewLogger(t)
	s, err := NewStore(cli, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, cli
}

func grant(t *testing.T, cli *clientv3.Client) clientv3.LeaseID {
	t.Helper()
	l, err := cli.Grant(context.Background(), 30)
	if err != nil {
		t.Fatal(err)
	}
	return l.ID
}

func spec() engine.Spec {
	return engine.Spec{Prompt: "a red fox", Seed: 7}.WithDefaults()
}

// claimOne claims the only pending task of stage.
func claimOne(t *testing.T, s *Store, stage Stage, node string, lease clientv3.LeaseID) *Claim {
	t.Helper()
	ctx := context.Background()
	pend, _, err := s.Pending(ctx, stage)
	if err != nil {
		t.Fatal(err)
	}
	if len(pend) != 1 {
		t.Fatalf("%s: %d pending tasks, want 1", stage, len(pend))
	}
	c, err := s.TryClaim(ctx, pend[0], node, lease)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// claimAt runs the only job's stages before st (committing a payload from
// each) and returns the claim on its st task.
func claimAt(t *testing.T, s *Store, lease clientv3.LeaseID, st Stage) *Claim {
	t.Helper()
	for _, prev := range Stages() {
		c := claimOne(t, s, prev, string(prev), lease)
		if prev == st {
			return c
		}
		if err := s.Commit(context.Background(), c, Output{Payloads: payload("out-"+string(prev), string(prev))}); err != nil {
			t.Fatal(err)
		}
	}
	t.Fatalf("unknown stage %s", st)
	return nil
}

func payload(id, node string) []Input {
	return []Input{{Payload: id, Node: node, Ref: json.RawMessage(`{"id":"` + id + `"}`)}}
}

func TestLifecycle(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)

	job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	if job.State != Queued || job.Stage != Encode {
		t.Fatalf("new job: %+v", job)
	}

	enc := claimOne(t, s, Encode, "enc-1", lease)
	if _, err := s.TryClaim(ctx, enc.Task, "enc-2", lease); !errors.Is(err, ErrTaken) {
		t.Fatalf("second claim: %v, want ErrTaken", err)
	}
	if pend, _, _ := s.Pending(ctx, Encode); len(pend) != 0 {
		t.Fatalf("claimed task still pending: %v", pend)
	}
	if got, _ := s.Get(ctx, job.ID); got.State != Running || got.Progress == nil || got.Progress.Node != "enc-1" {
		t.Fatalf("while encoding: %+v", got)
	}
	if err := s.Commit(ctx, enc, Output{Payloads: payload("emb", "enc-1"), Hint: "den-1", Work: 3 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}

	den := claimOne(t, s, Denoise, "den-1", lease)
	if den.Task.Hint != "den-1" || len(den.Task.Inputs) != 1 || den.Task.Inputs[0].Payload != "emb" {
		t.Fatalf("denoise task: %+v", den.Task)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 1 || prs[0].Payload != "emb" || prs[0].Stage != Encode {
		t.Fatalf("payload records after encode: %+v", prs)
	}
	// The progress key says who runs the stage; its steps are the worker's
	// (agent/progress), never written to etcd.
	if got, _ := s.Get(ctx, job.ID); got.Progress == nil || got.Progress.Stage != Denoise || got.Progress.Node != "den-1" || got.Progress.Step != 0 {
		t.Fatalf("progress: %+v", got.Progress)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 1 || prs[0].Payload != "lat" {
		t.Fatalf("embedding not released on denoise commit: %+v", prs)
	}

	dec := claimOne(t, s, Decode, "dec-1", lease)
	res := &Result{ContentType: "image/png", Bytes: 42, SHA256: "ab", Object: ResultID(job.ID)}
	objKey := cache.ObjectKey(s.cfg.Prefix, res.Object)
	if err := s.Commit(ctx, dec, Output{Result: res, Records: []StagedRecord{fixedRecord{clientv3.OpPut(objKey, `{"id":"x"}`)}}}); err != nil {
		t.Fatal(err)
	}
	// The result's Store record was written by the commit, and only the
	// record: no file bytes are in etcd.
	if r, _ := cli.Get(ctx, objKey); len(r.Kvs) != 1 {
		t.Fatalf("result object record not written by the commit")
	}

	got, err := s.Wait(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != Succeeded || *got.Result != *res || got.Stages[Encode].Node != "enc-1" || got.Stages[Decode].Attempt != 1 {
		t.Fatalf("finished job: %+v", got)
	}
	if got.Stages[Encode].Millis != 3 {
		t.Fatalf("encode ms = %v, want 3", got.Stages[Encode].Millis)
	}
	// The finished record lives on a retention lease.
	if r, _ := cli.Get(ctx, s.jobKey(job.ID)); len(r.Kvs) != 1 || r.Kvs[0].Lease == 0 {
		t.Fatalf("finished job record not on a retention lease: %+v", r.Kvs)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 0 {
		t.Fatalf("payloads leaked: %+v", prs)
	}
	for _, st := range Stages() {
		if q, r, _, _ := s.Depth(ctx, st); q != 0 || r != 0 {
			t.Fatalf("%s depth %d/%d after finish", st, q, r)
		}
	}
	if _, err := s.Cancel(ctx, job.ID); !errors.Is(err, ErrFinished) {
		t.Fatalf("cancel finished: %v", err)
	}
}

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

func TestCancelWhileRunning(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	den := claimAt(t, s, lease, Denoise)
	got, err := s.Cancel(ctx, job.ID)
	if err != nil || got.State != Cancelled {
		t.Fatalf("cancel: %+v %v", got, err)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 0 {
		t.Fatalf("cancel left payload records: %+v", prs)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den")}); !errors.Is(err, ErrFinished) {
		t.Fatalf("commit after cancel: %v, want ErrFinished", err)
	}
	if q, r, _, _ := s.Depth(ctx, Denoise); q != 0 || r != 0 {
		t.Fatalf("denoise depth after cancel %d/%d", q, r)
	}
	if j, _ := s.Get(ctx, job.ID); j.Result != nil {
		t.Fatalf("cancelled job has a result: %+v", j.Result)
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

func TestBadIDs(t *testing.T) {
	s, _ := newStore(t)
	for _, id := range []string{"", "../jobs", "a/b", "x y", string(make([]byte, 65))} {
		if _, err := s.Get(context.Background(), id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q) = %v, want ErrNotFound", id, err)
		}
	}
}

func TestStreamFrames(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	dec := claimAt(t, s, lease, Decode)
	// Previews are Store objects; this test's "Store" is a map of bytes.
	var mu sync.Mutex
	bytesOf := map[string][]byte{}
	putFrame := func(f int, b string) {
		t.Helper()
		id := PreviewID(job.ID, f)
		mu.Lock()
		bytesOf[id] = []byte(b)
		mu.Unlock()
		rec, _ := json.Marshal(cache.Record{ID: id, Size: int64(len(b)), Mode: cache.TTL, Job: job.ID})
		if _, err := cli.Put(ctx, cache.ObjectKey(s.cfg.Prefix, id), string(rec)); err != nil {
			t.Fatal(err)
		}
	}
	fetch := func(_ context.Context, r cache.Record) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		return bytesOf[r.ID], nil
	}
	putFrame(0, "frame0")

	got := make(chan Frame, 8)
	done := make(chan Job, 1)
	go func() {
		j, err := s.StreamFrames(ctx, job.ID, fetch, func(f Frame) error { got <- f; return nil })
		if err != nil {
			t.Error(err)
		}
		done <- j
	}()
	// Frame 0 was there before the stream started; frame 1 arrives during it;
	// a second copy of frame 1 (a retried decode) is not sent again.
	if f := <-got; f.Index != 0 || string(f.PNG) != "frame0" {
		t.Fatalf("first frame %+v", f)
	}
	putFrame(1, "frame1")
	if f := <-got; f.Index != 1 || string(f.PNG) != "frame1" {
		t.Fatalf("second frame %+v", f)
	}
	putFrame(1, "frame1-again")
	res := &Result{ContentType: "image/gif", Bytes: 3, Object: ResultID(job.ID)}
	if err := s.Commit(ctx, dec, Output{Result: res}); err != nil {
		t.Fatal(err)
	}
	select {
	case j := <-done:
		if j.State != Succeeded {
			t.Fatalf("stream ended with job %s", j.State)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("stream did not end when the job finished")
	}
	if len(got) != 0 {
		t.Fatalf("%d extra frames sent", len(got))
	}
	left, _ := cli.Get(ctx, s.previewPrefix(job.ID), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if left.Count != 0 {
		t.Fatalf("%d frame preview records left after commit", left.Count)
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

// Finished job records expire with their retention lease; Delete removes a
// finished job and its objects at once; States reads many jobs.
func TestRetentionDeleteAndStates(t *testing.T) {
	s, cli := newStore(t)
	s.cfg.Retention = 2 * time.Second
	ctx := context.Background()
	a, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	b, _ := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	c, _ := s.Submit(ctx, spec(), Options{Class: routing.Batch})
	for _, id := range []string{a.ID, b.ID} {
		if _, err := s.Cancel(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	st, err := s.States(ctx, []string{a.ID, c.ID, "nosuchjob"})
	if err != nil || len(st) != 2 || st[a.ID] != Cancelled || st[c.ID] != Queued {
		t.Fatalf("States = %v, %v", st, err)
	}
	if err := s.Delete(ctx, c.ID); !errors.Is(err, ErrNotFinished) {
		t.Fatalf("Delete of a queued job: %v", err)
	}
	objKey := cache.ObjectKey(s.cfg.Prefix, ResultID(b.ID))
	if _, err := cli.Put(ctx, objKey, "{}"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, b.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("deleted job still there: %v", err)
	}
	if r, _ := cli.Get(ctx, objKey); len(r.Kvs) != 0 {
		t.Fatal("Delete left the job's result object record")
	}
	// a expires with its retention lease (bucketed: at most 2 s + 1 s late).
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := s.Get(ctx, a.ID); errors.Is(err, ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("finished job record outlived its retention")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := s.Get(ctx, c.ID); err != nil {
		t.Fatalf("a queued job expired: %v", err)
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

// fixedRecord is a staged record without a lease.
type fixedRecord struct{ op clientv3.Op }

func (r fixedRecord) Op() clientv3.Op                 { return r.op }
func (r fixedRecord) Renew(ctx context.Context) error { return nil }

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
// fenced, so a requeued claim can no longer commit. A queue view counts
// the stage's tasks by producer (FedBy, for admission quotas).
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
	q := runQueue(t, s, Denoise)
	within(t, "the claimed task in the view", func() bool { return q.FedBy("encode") == 1 })
	if n := q.FedBy("other"); n != 0 {
		t.Fatalf("backlog fed by another node: %d", n)
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
