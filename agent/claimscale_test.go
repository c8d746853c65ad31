package agent

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// etcdCounter counts what one client asks of etcd: requests by kind, the
// keys range reads return, watches opened, and claim transactions.
type etcdCounter struct {
	reads, writes, txns, keysRead, watches atomic.Int64
	claimTxns, claims                      atomic.Int64
}

type snapshot struct{ reads, writes, txns, keysRead, watches, claimTxns, claims int64 }

func (c *etcdCounter) snap() snapshot {
	return snapshot{c.reads.Load(), c.writes.Load(), c.txns.Load(), c.keysRead.Load(), c.watches.Load(), c.claimTxns.Load(), c.claims.Load()}
}

func (s snapshot) minus(o snapshot) snapshot {
	return snapshot{s.reads - o.reads, s.writes - o.writes, s.txns - o.txns, s.keysRead - o.keysRead, s.watches - o.watches, s.claimTxns - o.claimTxns, s.claims - o.claims}
}

// requests is every request sent to etcd (a transaction counts once).
func (s snapshot) requests() int64 { return s.reads + s.writes + s.txns + s.watches }

// count wraps cli's KV and Watcher. Call it before anything uses cli.
func (c *etcdCounter) count(cli *clientv3.Client) {
	cli.KV = &countingKV{KV: cli.KV, c: c}
	cli.Watcher = &countingWatcher{Watcher: cli.Watcher, c: c}
}

type countingKV struct {
	clientv3.KV
	c *etcdCounter
}

func (k *countingKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	k.c.reads.Add(1)
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.c.keysRead.Add(int64(len(resp.Kvs)))
	}
	return resp, err
}

func (k *countingKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	k.c.writes.Add(1)
	return k.KV.Put(ctx, key, val, opts...)
}

func (k *countingKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	k.c.writes.Add(1)
	return k.KV.Delete(ctx, key, opts...)
}

func (k *countingKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	if op.IsGet() {
		k.c.reads.Add(1)
	} else {
		k.c.writes.Add(1)
	}
	return k.KV.Do(ctx, op)
}

func (k *countingKV) Txn(ctx context.Context) clientv3.Txn {
	return &countingTxn{Txn: k.KV.Txn(ctx), c: k.c}
}

type countingTxn struct {
	clientv3.Txn
	c     *etcdCounter
	claim bool // the transaction puts a claim key
}

func (t *countingTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }
func (t *countingTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *countingTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	for _, op := range ops {
		if op.IsPut() && strings.Contains(string(op.KeyBytes()), "/claims/") {
			t.claim = true
		}
	}
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *countingTxn) Commit() (*clientv3.TxnResponse, error) {
	t.c.txns.Add(1)
	if t.claim {
		t.c.claimTxns.Add(1)
	}
	resp, err := t.Txn.Commit()
	if err == nil {
		for _, r := range resp.Responses {
			if rr := r.GetResponseRange(); rr != nil {
				t.c.keysRead.Add(int64(len(rr.Kvs)))
			}
		}
		if t.claim && resp.Succeeded {
			t.c.claims.Add(1)
		}
	}
	return resp, err
}

type countingWatcher struct {
	clientv3.Watcher
	c *etcdCounter
}

func (w *countingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.c.watches.Add(1)
	return w.Watcher.Watch(ctx, key, opts...)
}

// submitMany submits n jobs of class from 16 goroutines.
func submitMany(t *testing.T, js *jobs.Store, n int, class routing.Class) []string {
	t.Helper()
	var (
		mu   sync.Mutex
		ids  []string
		next atomic.Int64
		wg   sync.WaitGroup
		errs = make(chan error, 16)
	)
	sp := engine.Spec{Prompt: "scale", Width: 64, Height: 64, Steps: 1}.WithDefaults()
	for range 16 {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				j, err := js.Submit(context.Background(), sp, jobs.Options{Class: class, Transfer: jobs.P2P})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				ids = append(ids, j.ID)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	return ids
}

// claimed reports whether job id's encode task is claimed (or done).
func claimed(t *testing.T, js *jobs.Store, id string) bool {
	t.Helper()
	j, err := js.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return j.State != jobs.Queued
}

// TestClaimAtScale is issue 10's queue at scale: 300 tasks of one stage
// running on other workers, ahead of everything in key order, and a
// backlog of 100 or 2,000. A new interactive task is claimed within a
// second, a batch task that has aged is claimed ahead of 1,000 fresh
// interactive ones, and what a claim costs etcd does not grow with the
// backlog.
func TestClaimAtScale(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of etcd writes")
	}
	costs := map[int]snapshot{}
	for _, backlog := range []int{100, 2000} {
		t.Run(fmt.Sprint(backlog), func(t *testing.T) {
			costs[backlog] = claimAtScale(t, backlog)
		})
	}
	small, large := costs[100], costs[2000]
	if small.claims == 0 || large.claims == 0 {
		t.Fatal("no claims measured")
	}
	per := func(s snapshot, n int64) float64 { return float64(n) / float64(s.claims) }
	t.Logf("etcd per claimed and committed task, backlog 100 vs 2000: requests %.2f vs %.2f, claim txns %.2f vs %.2f, keys read %.2f vs %.2f, watches opened %.2f vs %.2f",
		per(small, small.requests()), per(large, large.requests()), per(small, small.claimTxns), per(large, large.claimTxns),
		per(small, small.keysRead), per(large, large.keysRead), per(small, small.watches), per(large, large.watches))
	if per(large, large.requests()) > 1.25*per(small, small.requests())+0.5 {
		t.Errorf("requests per claim grew with the backlog: %.2f at 100, %.2f at 2000", per(small, small.requests()), per(large, large.requests()))
	}
	if per(large, large.keysRead) > 1.25*per(small, small.keysRead)+1 {
		t.Errorf("keys read per claim grew with the backlog: %.2f at 100, %.2f at 2000", per(small, small.keysRead), per(large, large.keysRead))
	}
}

func claimAtScale(t *testing.T, backlog int) snapshot {
	ctx := context.Background()
	srv, err := etcdembed.Start(ctx, etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	newClient := func() *clientv3.Client {
		cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cli.Close() })
		return cli
	}
	cli := newClient()
	cfg := DefaultLocalConfig()
	jc := cfg.Jobs
	jc.Prefix = cfg.Prefix
	var ago atomic.Int64 // how far back the test's submissions are dated
	jc.Now = func() time.Time { return time.Now().Add(-time.Duration(ago.Load())) }
	js, err := jobs.NewStore(cli, jc)
	if err != nil {
		t.Fatal(err)
	}

	// 300 interactive tasks run on other workers: their keys come first.
	submitMany(t, js, 300, routing.Interactive)
	pend, _, err := js.Pending(ctx, jobs.Encode)
	if err != nil {
		t.Fatal(err)
	}
	others, err := cli.Grant(ctx, 600)
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range pend {
		if _, err := js.TryClaim(ctx, task, "other", others.ID); err != nil {
			t.Fatal(err)
		}
	}
	submitMany(t, js, backlog, routing.Standard)

	// One encode worker, admission open (no denoise pool in this test).
	var ops etcdCounter
	acli := newClient()
	ops.count(acli)
	cfg.NodeID = "enc"
	cfg.Roles = []jobs.Stage{jobs.Encode}
	cfg.Slots = map[jobs.Stage]int{jobs.Encode: 1, jobs.Denoise: 1, jobs.Decode: 1}
	cfg.Admission.Slack = 1 << 30
	cfg.TransferMode = jobs.P2P
	cfg.HTTPListen, cfg.AdminListen = "", ""
	cfg.Logger = zaptest.NewLogger(t)
	a, err := New(cfg, acli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "queue view loaded", func() bool { return a.queues[jobs.Encode].Synced() })

	// What claims cost, once the view is loaded: over the next 40 claims.
	start := ops.snap()
	waitFor(t, 60*time.Second, "40 claims", func() bool { return ops.claims.Load()-start.claims >= 40 })
	// Settle: the last claim's task commits.
	time.Sleep(200 * time.Millisecond)
	cost := ops.snap().minus(start)
	t.Logf("backlog %d: %d claims, %d claim txns, %d requests (%d reads, %d writes, %d txns, %d watches), %d keys read",
		backlog, cost.claims, cost.claimTxns, cost.requests(), cost.reads, cost.writes, cost.txns, cost.watches, cost.keysRead)

	// A new interactive task is claimed within a second.
	fresh := submitMany(t, js, 1, routing.Interactive)[0]
	submitted := time.Now()
	waitFor(t, 10*time.Second, "new interactive task claimed", func() bool { return claimed(t, js, fresh) })
	t.Logf("backlog %d: a new interactive task claimed %v after its submission", backlog, time.Since(submitted).Round(time.Millisecond))
	if d := time.Since(submitted); d > time.Second {
		t.Errorf("backlog %d: a new interactive task waited %v for its claim, want <= 1s", backlog, d)
	}

	if backlog >= 2000 {
		// 1,000 fresh interactive tasks, then a batch task that waited two
		// aging steps: it ranks with them and, older, goes first; one just
		// queued does not.
		submitMany(t, js, 1000, routing.Interactive)
		ago.Store(int64(2*cfg.Queue.AgingStep + time.Second))
		aged := submitMany(t, js, 1, routing.Batch)[0]
		ago.Store(0)
		young := submitMany(t, js, 1, routing.Batch)[0]
		waitFor(t, 30*time.Second, "aged batch task claimed", func() bool { return claimed(t, js, aged) })
		pend, _, err := js.Pending(ctx, jobs.Encode)
		if err != nil {
			t.Fatal(err)
		}
		interactive := 0
		for _, task := range pend {
			if task.Class == routing.Interactive {
				interactive++
			}
		}
		t.Logf("the aged batch task was claimed with %d interactive tasks still queued", interactive)
		if interactive < 500 {
			t.Errorf("the aged batch task was claimed only once the interactive queue drained to %d", interactive)
		}
		if claimed(t, js, young) {
			t.Errorf("a batch task that has not aged was claimed ahead of interactive work")
		}
	}
	return cost
}

// waitFor retries cond every 10 ms until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestIdleAgentEtcdLoad: an idle agent of every role asks etcd for nothing
// but its alarm poll (its queue gauges come from its watch-fed views).
func TestIdleAgentEtcdLoad(t *testing.T) {
	ctx := context.Background()
	srv, err := etcdembed.Start(ctx, etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	var ops etcdCounter
	ops.count(cli)
	cfg := DefaultLocalConfig()
	cfg.NodeID = "idle"
	def := DefaultConfig()
	cfg.AlarmEvery = def.AlarmEvery                   // the default's polls, not the test config's
	cfg.Store.MaintainEvery = def.Store.MaintainEvery // the Store's safety-net pass reads its records
	const idle = 10 * time.Second
	cfg.HTTPListen, cfg.AdminListen = "", ""
	cfg.Logger = zaptest.NewLogger(t)
	a, err := New(cfg, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "queue views loaded", func() bool {
		for _, q := range a.queues {
			if !q.Synced() {
				return false
			}
		}
		return true
	})
	time.Sleep(2 * time.Second) // start-up reads and writes done
	start := ops.snap()
	time.Sleep(idle)
	d := ops.snap().minus(start)
	perSec := float64(d.requests()) / idle.Seconds()
	t.Logf("idle agent (all roles): %.2f etcd requests/s (%d reads, %d writes, %d txns, %d watches opened in %v)", perSec, d.reads, d.writes, d.txns, d.watches, idle)
	// Nothing per stage: what remains are the safety-net passes of the
	// Store (objects/) and the membership (nodes/), one read each per
	// MaintainEvery, and the alarm poll (a Maintenance call, not counted).
	if limit := 5 / cfg.Store.MaintainEvery.Seconds(); perSec > limit {
		t.Errorf("idle agent sends %.2f requests/s to etcd, want <= %.2f", perSec, limit)
	}
}
