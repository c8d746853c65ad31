package testbed

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// submitter submits a job: a Store's Submit, or an agent's.
type submitter func(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error)

// dispatchedBy submits through js with node as the tasks' dispatcher, as
// that node's API would (its ledger reads them when it starts).
func dispatchedBy(js *jobs.Store, node string) submitter {
	return func(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error) {
		opts.Dispatcher = node
		return js.Submit(ctx, spec, opts)
	}
}

// submitMany submits n jobs of class from 16 goroutines.
func submitMany(t *testing.T, submit submitter, n int, class routing.Class) []string {
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
				j, err := submit(context.Background(), sp, jobs.Options{Class: class, Transfer: jobs.P2P})
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
// backlog of 100 or 2,000 waiting in one dispatcher's ledger, the
// worker's own (it submitted them). A new interactive task is claimed
// within a second, a batch task that has aged is claimed ahead of 1,000
// fresh interactive ones, and what a claim (the dispatcher's Assign)
// costs etcd does not grow with the backlog.
func TestClaimAtScale(t *testing.T) {
	if testing.Short() {
		t.Skip("thousands of etcd writes")
	}
	costs := map[int]EtcdOpCounts{}
	for _, backlog := range []int{100, 2000} {
		t.Run(fmt.Sprint(backlog), func(t *testing.T) {
			costs[backlog] = claimAtScale(t, backlog)
		})
	}
	small, large := costs[100], costs[2000]
	if small.Claims == 0 || large.Claims == 0 {
		t.Fatal("no claims measured")
	}
	per := func(s EtcdOpCounts, n int64) float64 { return float64(n) / float64(s.Claims) }
	t.Logf("etcd per claimed and committed task, backlog 100 vs 2000: requests %.2f vs %.2f, claim txns %.2f vs %.2f, keys read %.2f vs %.2f, watches opened %.2f vs %.2f",
		per(small, small.Requests()), per(large, large.Requests()), per(small, small.ClaimTxns), per(large, large.ClaimTxns),
		per(small, small.KeysRead), per(large, large.KeysRead), per(small, small.Watches), per(large, large.Watches))
	if per(large, large.Requests()) > 1.25*per(small, small.Requests())+0.5 {
		t.Errorf("requests per claim grew with the backlog: %.2f at 100, %.2f at 2000", per(small, small.Requests()), per(large, large.Requests()))
	}
	if per(large, large.KeysRead) > 1.25*per(small, small.KeysRead)+1 {
		t.Errorf("keys read per claim grew with the backlog: %.2f at 100, %.2f at 2000", per(small, small.KeysRead), per(large, large.KeysRead))
	}
}

func claimAtScale(t *testing.T, backlog int) EtcdOpCounts {
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
	cfg := agent.DefaultLocalConfig()
	jc := cfg.Jobs
	jc.Prefix = cfg.Prefix
	var ago atomic.Int64 // how far back the test's submissions are dated
	jc.Now = func() time.Time { return time.Now().Add(-time.Duration(ago.Load())) }
	js, err := jobs.NewStore(cli, jc)
	if err != nil {
		t.Fatal(err)
	}

	// 300 interactive tasks run on other workers: their keys come first.
	submitMany(t, dispatchedBy(js, "other"), 300, routing.Interactive)
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
	submitMany(t, dispatchedBy(js, "enc"), backlog, routing.Standard)

	// One encode worker, admission open (no denoise pool in this test).
	acli := newClient()
	ops := CountEtcdOps(acli)
	cfg.NodeID = "enc"
	cfg.Roles = []jobs.Stage{jobs.Encode}
	cfg.Slots = map[jobs.Stage]int{jobs.Encode: 1, jobs.Denoise: 1, jobs.Decode: 1}
	cfg.Admission.Slack = 1 << 30
	cfg.TransferMode = jobs.P2P
	cfg.HTTPListen, cfg.AdminListen = "", ""
	cfg.Logger = zaptest.NewLogger(t)
	cfg.Jobs.Now = jc.Now  // its submissions are dated as the test's
	cfg.CondCacheBytes = 0 // every submission queues an encode, none finds its texts cached
	a, err := agent.New(cfg, acli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	// What claims cost once the agent runs (its ledger loaded, which reads
	// the queue once): over 40 claims after its first 10.
	waitFor(t, 60*time.Second, "10 claims", func() bool { return ops.Snap().Claims >= 10 })
	start := ops.Snap()
	waitFor(t, 60*time.Second, "40 claims", func() bool { return ops.Snap().Claims-start.Claims >= 40 })
	time.Sleep(200 * time.Millisecond) // the last claim's task commits
	cost := ops.Snap().Minus(start)
	t.Logf("backlog %d: %d claims, %d claim txns, %d requests (%d reads, %d writes, %d txns, %d watches), %d keys read",
		backlog, cost.Claims, cost.ClaimTxns, cost.Requests(), cost.Reads, cost.Writes, cost.Txns, cost.Watches, cost.KeysRead)

	// A new interactive task is claimed within a second.
	fresh := submitMany(t, a.Submit, 1, routing.Interactive)[0]
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
		submitMany(t, a.Submit, 1000, routing.Interactive)
		ago.Store(int64(2*cfg.Queue.AgingStep + time.Second))
		aged := submitMany(t, a.Submit, 1, routing.Batch)[0]
		ago.Store(0)
		young := submitMany(t, a.Submit, 1, routing.Batch)[0]
		// The worker drains the interactive tasks while they are
		// submitted: count those still queued behind the aged one.
		queued := interactiveQueued(t, js)
		waitFor(t, 30*time.Second, "aged batch task claimed", func() bool { return claimed(t, js, aged) })
		interactive := interactiveQueued(t, js)
		t.Logf("the aged batch task was claimed with %d of the %d interactive tasks queued at its submission still queued", interactive, queued)
		if queued < 100 || interactive < queued/2 {
			t.Errorf("the aged batch task was claimed only once the interactive queue drained from %d to %d", queued, interactive)
		}
		if claimed(t, js, young) {
			t.Errorf("a batch task that has not aged was claimed ahead of interactive work")
		}
	}
	return cost
}

// interactiveQueued counts the interactive encode tasks that wait.
func interactiveQueued(t *testing.T, js *jobs.Store) int {
	t.Helper()
	pend, _, err := js.Pending(context.Background(), jobs.Encode)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, task := range pend {
		if task.Class == routing.Interactive {
			n++
		}
	}
	return n
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

// TestIdleAgentEtcdLoad: an agent of every role idle for 60 s makes no raft
// proposal (it renews its lease, which is none) and asks etcd for nothing
// but the membership's safety-net read (its queue gauges come from its
// watch-fed views).
func TestIdleAgentEtcdLoad(t *testing.T) {
	// Idle for a minute, it runs beside the other parallel test: settled
	// reads this test's embedded etcd alone (its lease counters are the
	// process's, and are not read here).
	t.Parallel()
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
	ops := CountEtcdOps(cli)
	cfg := agent.DefaultLocalConfig()
	cfg.NodeID = "idle"
	def := agent.DefaultConfig()
	cfg.Store.MaintainEvery = def.Store.MaintainEvery // the default's pass period
	const idle = 60 * time.Second
	cfg.HTTPListen, cfg.AdminListen = "", ""
	cfg.Logger = zaptest.NewLogger(t)
	a, err := agent.New(cfg, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // start-up reads and writes done (queue views loaded)
	start, before := ops.Snap(), settled(t, srv)
	time.Sleep(idle)
	d, proposals := ops.Snap().Minus(start), settled(t, srv).Minus(before).proposals
	perSec := float64(d.Requests()) / idle.Seconds()
	t.Logf("idle agent (all roles): %.0f raft proposals and %.2f etcd requests/s (%d reads, %d writes, %d txns, %d watches opened) in %v",
		proposals, perSec, d.Reads, d.Writes, d.Txns, d.Watches, idle)
	// Its lease keepalives are not raft proposals; nothing else may be
	// (the alarm poll was one every 5 s).
	if proposals != 0 {
		t.Errorf("an agent idle for %v made %.0f raft proposals, want none beyond its keepalives", idle, proposals)
	}
	// Nothing per stage, and the Store's pass works from its watch-fed
	// index: what remains is the membership's safety-net read of nodes/
	// (one per 10 s).
	if limit := 2 / cfg.Store.MaintainEvery.Seconds(); perSec > limit {
		t.Errorf("idle agent sends %.2f requests/s to etcd, want <= %.2f", perSec, limit)
	}
}
