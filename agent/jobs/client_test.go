package jobs

// Tests of the client side (client.go): cancel, frame streaming, retention,
// Delete and States.

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

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
	// The commit leaves the previews for streams still reading the last
	// one; its worker drops them a moment later (DropPreviews).
	left, _ := cli.Get(ctx, s.previewPrefix(job.ID), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if left.Count != 2 {
		t.Fatalf("%d frame preview records left after commit, want both", left.Count)
	}
	if err := s.DropPreviews(ctx, job.ID); err != nil {
		t.Fatal(err)
	}
	left, _ = cli.Get(ctx, s.previewPrefix(job.ID), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if left.Count != 0 {
		t.Fatalf("%d frame preview records left after DropPreviews", left.Count)
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
