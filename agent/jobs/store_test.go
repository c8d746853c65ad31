package jobs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
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
	cfg.ResultPart = 10 // force multi-part results
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

	job, err := s.Submit(ctx, spec(), routing.Standard)
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
	if err := s.SetProgress(ctx, den, 5, 20); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, job.ID); got.Progress == nil || got.Progress.Step != 5 || got.Progress.Total != 20 {
		t.Fatalf("progress: %+v", got.Progress)
	}
	if err := s.Commit(ctx, den, Output{Payloads: payload("lat", "den-1")}); err != nil {
		t.Fatal(err)
	}
	if prs, _ := s.Payloads(ctx); len(prs) != 1 || prs[0].Payload != "lat" {
		t.Fatalf("embedding not released on denoise commit: %+v", prs)
	}

	if _, _, err := s.Result(ctx, job.ID); !errors.Is(err, ErrNotReady) {
		t.Fatalf("result before decode: %v", err)
	}
	dec := claimOne(t, s, Decode, "dec-1", lease)
	file := []byte("a result longer than one part of ten bytes")
	if err := s.Commit(ctx, dec, Output{Result: file, ContentType: "image/png"}); err != nil {
		t.Fatal(err)
	}

	got, err := s.Wait(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != Succeeded || got.Result.Parts != 5 || got.Stages[Encode].Node != "enc-1" || got.Stages[Decode].Attempt != 1 {
		t.Fatalf("finished job: %+v", got)
	}
	if got.Stages[Encode].Millis != 3 {
		t.Fatalf("encode ms = %v, want 3", got.Stages[Encode].Millis)
	}
	data, ct, err := s.Result(ctx, job.ID)
	if err != nil || ct != "image/png" || !bytes.Equal(data, file) {
		t.Fatalf("result = %q %q %v", data, ct, err)
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
	job, err := s.Submit(ctx, spec(), routing.Standard)
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
	job, _ := s.Submit(ctx, spec(), routing.Standard)
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
	if _, _, err := s.Result(ctx, job.ID); !errors.Is(err, ErrNotReady) {
		t.Fatalf("result of cancelled job: %v", err)
	}
}

func TestPendingOrderAndBackoff(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	for _, c := range []routing.Class{routing.Batch, routing.Standard, routing.Interactive} {
		if _, err := s.Submit(ctx, spec(), c); err != nil {
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
	job, _ := s.Submit(ctx, spec(), routing.Standard)
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

func TestWaitChangeWakesOnNewTask(t *testing.T) {
	s, _ := newStore(t)
	ctx := context.Background()
	_, rev, err := s.Pending(ctx, Encode)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.WaitChange(ctx, Encode, rev, time.Now().Add(time.Minute)) }()
	if _, err := s.Submit(ctx, spec(), routing.Standard); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("WaitChange did not wake on a new task")
	}
	// With nothing happening it returns at the deadline.
	_, rev, _ = s.Pending(ctx, Decode)
	start := time.Now()
	if err := s.WaitChange(ctx, Decode, rev, start.Add(50*time.Millisecond)); err != nil {
		t.Fatal(err)
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
	job, _ := s.Submit(ctx, spec(), routing.Standard)
	dec := claimAt(t, s, lease, Decode)
	if err := s.PutFrame(ctx, dec, 0, []byte("frame0")); err != nil {
		t.Fatal(err)
	}

	got := make(chan Frame, 8)
	done := make(chan Job, 1)
	go func() {
		j, err := s.StreamFrames(ctx, job.ID, func(f Frame) error { got <- f; return nil })
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
	for _, b := range []string{"frame1", "frame1-again"} {
		if err := s.PutFrame(ctx, dec, 1, []byte(b)); err != nil {
			t.Fatal(err)
		}
	}
	if f := <-got; f.Index != 1 || string(f.PNG) != "frame1" {
		t.Fatalf("second frame %+v", f)
	}
	if err := s.Commit(ctx, dec, Output{Result: []byte("gif"), ContentType: "image/gif"}); err != nil {
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
	left, _ := cli.Get(ctx, s.framePrefix(job.ID), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if left.Count != 0 {
		t.Fatalf("%d frame previews left after commit", left.Count)
	}
}

// A worker that abandons a task after the job was cancelled must not bring
// the deleted task back (it would be claimed and run for nothing, forever).
func TestAbandonAfterCancelKeepsTaskDeleted(t *testing.T) {
	s, cli := newStore(t)
	ctx := context.Background()
	lease := grant(t, cli)
	job, _ := s.Submit(ctx, spec(), routing.Standard)
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
	job, _ := s.Submit(ctx, spec(), routing.Standard)
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
