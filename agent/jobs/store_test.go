package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

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

// fixedRecord is a staged record without a lease.
type fixedRecord struct{ op clientv3.Op }

func (r fixedRecord) Op() clientv3.Op                 { return r.op }
func (r fixedRecord) Renew(ctx context.Context) error { return nil }

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

// A waiting client follows the job's ended key, which only the finishing
// transaction writes: its watch gets one event a job, not one a stage
// commit, and it still returns at the terminal state, whether it began
// before the first stage, between stages or after the end.
func TestWaitSeesOneEventAJob(t *testing.T) {
	s, cli := newStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lease := grant(t, cli)
	job, err := s.Submit(ctx, spec(), Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	events := make(chan int, 1)
	wctx, stopWatch := context.WithCancel(ctx)
	wch := cli.Watch(wctx, s.endedKey(job.ID))
	go func() {
		n := 0
		for wr := range wch {
			n += len(wr.Events)
		}
		events <- n
	}()
	type waited struct {
		job Job
		err error
	}
	wait := func() <-chan waited {
		ch := make(chan waited, 1)
		go func() {
			j, err := s.Wait(ctx, job.ID)
			ch <- waited{j, err}
		}()
		return ch
	}
	before := wait()
	enc := claimOne(t, s, Encode, "enc-1", lease)
	if err := s.Commit(ctx, enc, Output{Payloads: payload("emb", "enc-1")}); err != nil {
		t.Fatal(err)
	}
	between := wait()
	den := claimOne(t, s, Denoise, "den-1", lease)
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	select {
	case w := <-before:
		t.Fatalf("Wait returned before the job ended: %+v %v", w.job, w.err)
	case <-time.After(100 * time.Millisecond):
	}
	dec := claimOne(t, s, Decode, "dec-1", lease)
	res := &Result{ContentType: "image/png", Bytes: 42, SHA256: "ab", Object: ResultID(job.ID)}
	if err := s.Commit(ctx, dec, Output{Result: res}); err != nil {
		t.Fatal(err)
	}
	for name, ch := range map[string]<-chan waited{"before the first stage": before, "between stages": between, "after the end": wait()} {
		if w := <-ch; w.err != nil || w.job.State != Succeeded || w.job.Result == nil || *w.job.Result != *res {
			t.Errorf("Wait begun %s: %+v, %v; want the succeeded job", name, w.job, w.err)
		}
	}
	// The ended key is the finished record, on a lease of its own.
	r, err := cli.Get(ctx, s.endedKey(job.ID))
	if err != nil || len(r.Kvs) != 1 || r.Kvs[0].Lease == 0 {
		t.Fatalf("ended key: %+v %v; want the record on a lease", r, err)
	}
	if rec, _ := cli.Get(ctx, s.jobKey(job.ID)); len(rec.Kvs) != 1 || string(rec.Kvs[0].Value) != string(r.Kvs[0].Value) {
		t.Errorf("ended key's value is not the finished record")
	}
	stopWatch()
	if n := <-events; n != 1 {
		t.Errorf("the ended key saw %d events over the job's three commits, want 1", n)
	}
	// Deleting the job deletes its ended key.
	if err := s.Delete(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
	if r, _ := cli.Get(ctx, s.endedKey(job.ID), clientv3.WithCountOnly()); r.Count != 0 {
		t.Errorf("ended key left after the job's delete")
	}
}
