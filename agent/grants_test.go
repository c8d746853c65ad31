package agent

import (
	"context"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// A dispatcher granted a slot for work waiting, with none waiting when
// the grant arrives, declines it over the grant protocol: the worker notes
// the decline, so that it leaves the dispatcher out of those it grants to
// until gossip shows it anew, and grants the slot anew.
func TestGrantForWaitingWorkDeclined(t *testing.T) {
	cli := embeddedEtcd(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := func(node string, role jobs.Stage) *Agent {
		cfg := DefaultLocalConfig()
		cfg.NodeID, cfg.Roles = node, []jobs.Stage{role}
		return runAgent(t, ctx, cli, cfg)
	}
	worker, disp := start("decode-w", jobs.Decode), start("denoise-d", jobs.Denoise)
	for {
		p, ok := worker.member.Peer(disp.id)
		q, ok2 := disp.member.Peer(worker.id)
		if ok && ok2 && p.Alive && q.Alive && p.Record.PeerID != "" && q.Record.PeerID != "" {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the two agents never saw each other")
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := time.Now()
	g := routing.SlotGrant{To: disp.id, Free: 1, TTL: routing.GrantTTL, Waiting: true}
	book := worker.books[jobs.Decode]
	book.Promise(g, before)
	p, _ := worker.member.Peer(disp.id)
	worker.sendGrant(p.Record, grantMsg(jobs.Decode, g))
	for !book.Declined(disp.id, before) {
		if ctx.Err() != nil {
			t.Fatal("the grant for work waiting, to a dispatcher with none, was never declined")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The worker's loop grants the slot anew: nobody waits, so to the
	// producer, ahead of work, which holds it for its next push.
	for {
		owner, _ := book.Promised(time.Now())
		if owner.Waiting {
			t.Fatalf("the declined promise for work waiting still holds: %+v", owner)
		}
		if owner.To == disp.id && disp.grants.Free(worker.id, string(jobs.Decode), time.Now()) > 0 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the slot was not granted anew ahead of work: promised by %+v", owner)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
