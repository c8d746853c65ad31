package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// An offered claim that no write confirms (its writer's transaction
// failed): the worker starts the task from the offer, and once the offer
// runs out drops its work. Nothing of it reaches etcd, its output is
// released, and its credit comes back.
func TestWithdrawnOfferRecordsNothing(t *testing.T) {
	// The conditioning cache off: its entries are content-addressed, valid
	// whoever encodes them, and a tentative encode may well leave one.
	a, cli, cfg := startAgentWith(t, "offer-1", func(c *Config) { c.Jobs.OfferTTL = 300 * time.Millisecond; c.CondCacheBytes = 0 })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for a.member.Lease() == 0 {
		if ctx.Err() != nil {
			t.Fatal("no lease")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A submit pushed to this agent whose transaction fails: its job id
	// is taken. The offer went all the same.
	var mu sync.Mutex
	var offered []jobs.Offer
	jc := jobs.DefaultConfig()
	jc.Prefix = cfg.Prefix
	jc.Offer = func(o jobs.Offer) { mu.Lock(); offered = append(offered, o); mu.Unlock() }
	writer, err := jobs.NewStore(cli, jc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, cfg.Prefix+"/jobs/0123456789abcdef", `{"id":"0123456789abcdef","state":"running"}`); err != nil {
		t.Fatal(err)
	}
	before, err := cli.Get(ctx, cfg.Prefix+"/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	spec := engine.Spec{Prompt: "an offer never written", Seed: 3}.WithDefaults()
	_, err = writer.Submit(ctx, spec, jobs.Options{JobID: "0123456789abcdef", Push: &jobs.Push{Node: a.id, Lease: a.member.Lease()}})
	if err == nil {
		t.Fatal("a submit of a taken job id succeeded")
	}
	mu.Lock()
	if len(offered) != 1 {
		t.Fatalf("%d offers, want 1", len(offered))
	}
	o := offered[0]
	mu.Unlock()
	a.takeOwnOffer(o)

	for c := a.metrics.Claims(jobs.Encode); c.Withdrawn < 1; c = a.metrics.Claims(jobs.Encode) {
		if ctx.Err() != nil {
			t.Fatalf("the offer was never withdrawn: %+v", c)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if c := a.metrics.Claims(jobs.Encode); c.Offered != 1 || c.PushedStarted != 1 {
		t.Fatalf("encode claims %+v, want one started from its offer", c)
	}
	after, err := cli.Get(ctx, cfg.Prefix+"/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var wrote []string
	was := map[string]int64{}
	for _, kv := range before.Kvs {
		was[string(kv.Key)] = kv.ModRevision
	}
	for _, kv := range after.Kvs {
		if rev, ok := was[string(kv.Key)]; (!ok || rev != kv.ModRevision) && !isMembership(cfg.Prefix, string(kv.Key)) {
			wrote = append(wrote, string(kv.Key))
		}
	}
	if len(wrote) > 0 {
		t.Fatalf("a withdrawn offer wrote %v", wrote)
	}
	for st := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		held := a.xfer.HeldIDs()
		_, free := a.slots(jobs.Encode)
		if len(held) == 0 && free == a.cfg.Slots[jobs.Encode] {
			break
		}
		if time.Since(st) > 5*time.Second {
			t.Fatalf("after the withdrawal: held %v, %d encode slots free of %d", held, free, a.cfg.Slots[jobs.Encode])
		}
	}
}

// isMembership reports whether key is the agents' own bookkeeping under
// prefix (their node records and leases' keys), which changes whatever
// the jobs do.
func isMembership(prefix, key string) bool {
	for _, p := range []string{"/nodes/", "/identities/", "/health/"} {
		if len(key) >= len(prefix+p) && key[:len(prefix+p)] == prefix+p {
			return true
		}
	}
	return false
}
