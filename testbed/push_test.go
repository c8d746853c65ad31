package testbed

import (
	"context"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// On an idle mesh every task is pushed to a free worker with its claim:
// no worker sends a claim transaction, every stage runs on its first
// attempt, and a job costs etcd one write per stage plus the submit.
func TestPushedHandoffs(t *testing.T) {
	cl := startCluster(t, "", nil)
	ops := CountEtcdOps(cl.Client)
	for _, st := range jobs.Stages() {
		addAgent(t, cl, schedAgent(cl, string(st)+"-1", st, 1, nil))
	}
	entry := cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	waitAllAlive(t, cl)
	before := ops.Snap()
	const n = 10
	for i := range n {
		// A prompt of its own: every job's encode runs (a repeated one
		// would come from the conditioning cache).
		spec := engine.Spec{Prompt: fmt.Sprintf("a lantern %d", i), Seed: int64(i), Width: 64, Height: 64, Steps: 2}.WithDefaults()
		j, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Interactive})
		if err != nil {
			t.Fatal(err)
		}
		done := waitSucceeded(t, ctx, entry, j.ID)
		for _, st := range jobs.Stages() {
			if r := done.Stages[st]; r == nil || r.Attempt != 1 || r.Node != string(st)+"-1" {
				t.Fatalf("job %d stage %s: %+v, want attempt 1 on %s-1", i, st, r, st)
			}
		}
	}
	d := ops.Snap().Minus(before)
	if d.ClaimTxns != 0 {
		t.Fatalf("%d claim transactions for %d jobs on an idle mesh, want 0: every task was pushed", d.ClaimTxns, n)
	}
	// Each task started once, from the claim its writer offered with the
	// write (the submit's, the encode's and the denoise's commits) or from
	// the write's watch event, whichever came first (an embedded etcd on
	// an idle machine often wins by a fraction of a millisecond), and no
	// offer was withdrawn: every one was written as offered.
	for i, a := range cl.Agents {
		st := jobs.Stages()[i]
		c := a.Claims()[st]
		if c.PushedStarted != n || c.Withdrawn != 0 {
			t.Fatalf("%s: %s claims %+v, want all %d started once, no offer withdrawn", a.ID(), st, c, n)
		}
		t.Logf("%s: %d of %d tasks started from their offer", st, c.Offered, n)
	}
	// Each pushed denoise and decode pulled its input with the ticket its
	// producer issued with the push, asking for none.
	for _, a := range cl.Agents[1:] {
		st, err := a.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Data.IssuedPulls < n {
			t.Fatalf("%s pulled %d of %d inputs with an issued ticket", a.ID(), st.Data.IssuedPulls, n)
		}
	}
	t.Logf("per job: %.1f requests, %.1f transactions", float64(d.Requests())/n, float64(d.Txns)/n)
}

// A claim pushed to a worker with no free slot (gossip was stale, or
// several producers chose it at once) is given back after the steal grace,
// since another worker has a slot: to its dispatcher, which hands it to
// that worker as soon as it grants its slot, with no claim raced for, and
// it runs there while the first is still busy.
func TestPushedClaimGivenBackToFreeWorker(t *testing.T) {
	cl := startCluster(t, "", nil)
	slow := func(ac *agent.Config) { ac.Engine.EncodeCost = 3 * time.Second }
	a := addAgent(t, cl, schedAgent(cl, "enc-a", jobs.Encode, 1, slow))
	addAgent(t, cl, schedAgent(cl, "enc-b", jobs.Encode, 1, slow))
	addAgent(t, cl, schedAgent(cl, "den", jobs.Denoise, 1, nil))
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 1, nil))
	waitAllAlive(t, cl)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := cl.Client.Get(ctx, "/latentmesh/default/nodes/enc-a")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("enc-a's registration: %v %v", resp, err)
	}
	toA := &jobs.Push{Node: "enc-a", Lease: clientv3.LeaseID(resp.Kvs[0].Lease)}
	spec := func(i int) engine.Spec {
		return engine.Spec{Prompt: "a kite", Seed: int64(i), Width: 64, Height: 64, Steps: 2}.WithDefaults()
	}
	first, err := a.Submit(ctx, spec(1), jobs.Options{Class: routing.Standard, Push: toA})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error { // enc-a is busy with it
		j, err := a.Get(ctx, first.ID)
		if err != nil {
			return err
		}
		if j.Progress == nil || j.Progress.Node != "enc-a" {
			return fmt.Errorf("the first job's progress: %+v", j.Progress)
		}
		return nil
	})
	second, err := a.Submit(ctx, spec(2), jobs.Options{Class: routing.Standard, Push: toA})
	if err != nil {
		t.Fatal(err)
	}
	j1, j2 := waitSucceeded(t, ctx, a, first.ID), waitSucceeded(t, ctx, a, second.ID)
	e1, e2 := j1.Stages[jobs.Encode], j2.Stages[jobs.Encode]
	if e1.Node != "enc-a" || e2.Node != "enc-b" || e2.Attempt != 2 {
		// Its first claim was the push to enc-a, given back; its second
		// the dispatcher's to enc-b.
		t.Fatalf("encodes: first on %s, second on %s attempt %d; want the second given back and run by enc-b on its second claim", e1.Node, e2.Node, e2.Attempt)
	}
	if !e2.StartedAt.Before(e1.FinishedAt) {
		t.Fatalf("the second encode started at %v, after the first finished at %v: it waited for the busy worker", e2.StartedAt, e1.FinishedAt)
	}
}

// waitAllAlive waits until every agent sees every other alive in gossip:
// hints and pushes go only to workers gossip shows with a free slot.
func waitAllAlive(t *testing.T, cl *Cluster) {
	t.Helper()
	eventually(t, 10*time.Second, func() error {
		for _, a := range cl.Agents {
			st, err := a.Status(context.Background())
			if err != nil {
				return err
			}
			alive := 0
			for _, p := range st.Peers {
				if p.Alive {
					alive++
				}
			}
			if alive != len(cl.Agents) {
				return fmt.Errorf("%s sees %d of %d alive", a.ID(), alive, len(cl.Agents))
			}
		}
		return nil
	})
}
