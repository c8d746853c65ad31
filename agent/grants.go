package agent

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/grant"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// Credit grants (agent/grant, routing.Grants): a worker whose slot frees
// tells the producers that feed its stage at once, and a producer pushes
// its next task to a worker that granted it a credit even while gossip
// still shows that worker full. Gossip carries free credits a round or
// two late; the producer used to correct it from a view of the whole next
// queue, which cost every producer every change of that queue. A producer
// whose pushed task is gone has that worker's credit back from its own
// ledger (creditReturned), with no message at all: the grant the worker
// would send it races the job's next stages, and lost that race to the
// next job's push on a loaded machine.

// takeGrant records a grant from a member: a stage of the pipeline, and
// a peer whose node record this agent has.
func (a *Agent) takeGrant(from peer.ID, m grant.Msg) {
	if !slices.Contains(jobs.Stages(), jobs.Stage(m.Stage)) {
		return // a name that is no stage is not kept
	}
	if rec, ok := a.member.ByPeerID(from.String()); ok && rec.ID != a.id {
		a.grants.Grant(rec.ID, m.Stage, m.Free, time.Now().Add(m.TTL()))
		a.meshChanged.Fire() // a dispatcher with tasks waiting hands one on
	}
}

// creditReturned gives back the credit of worker's slot of st, which a
// task this agent pushed there held: the task is gone (jobs.Fed).
func (a *Agent) creditReturned(st jobs.Stage, worker string) {
	if p, ok := a.member.Peer(worker); ok && p.Alive {
		a.grants.Return(worker, string(st), p.Record.Slots[string(st)], time.Now())
	}
}

// grantFreed grants this node's free slots of st to the nodes that feed
// it (routing.GrantTo: fed, the producer of the task that just ended,
// unless it pushed that task here and so has the credit back already, and
// one other), when the stage takes work: not while draining, held back by
// admission, or blocked. The others are the dispatchers gossip shows with
// tasks of st waiting (NodeMeta.Waiting), which hand one here at once;
// with none, the producers of the stage before.
func (a *Agent) grantFreed(st jobs.Stage, fed string, pushed bool) {
	if a.draining.Load() || a.held[st].Load() || a.blocked[st].Load() {
		return
	}
	_, free := a.slots(st)
	if free <= 0 {
		return
	}
	var waiting, producers []string
	records := map[string]gossip.NodeRecord{}
	up, hasUp := st.Prev()
	for _, p := range a.member.Peers() {
		if !p.Alive || p.Record.ID == a.id {
			continue
		}
		switch {
		case p.Meta.Waiting&gossip.StageBit(string(st)) != 0:
			waiting = append(waiting, p.Record.ID)
		case hasUp && p.Record.HasRole(string(up)):
			producers = append(producers, p.Record.ID)
		default:
			continue
		}
		records[p.Record.ID] = p.Record
	}
	if len(waiting) > 0 {
		producers = waiting
	}
	for _, node := range routing.GrantTo(producers, fed, pushed, nil) {
		a.sendGrant(records[node], st, free)
	}
}

// grantIdleEvery is how often an idle worker grants its free slots again to
// one dispatcher that still shows work waiting.
const grantIdleEvery = routing.GrantTTL / 4

// grantIdle grants this node's free slots of st to up to two dispatchers
// gossip shows with tasks of st waiting, each at most once per
// grantIdleEvery: a worker whose loop finds nothing to start. The grant a
// slot's end sends (grantFreed) goes nowhere while admission holds the
// stage back, and a dispatcher otherwise learns of the slot only from
// gossip, a round or two later.
func (a *Agent) grantIdle(st jobs.Stage) {
	if a.draining.Load() || a.held[st].Load() || a.blocked[st].Load() {
		return
	}
	_, free := a.slots(st)
	if free <= 0 {
		return
	}
	now := time.Now()
	var waiting []gossip.Peer
	for _, p := range a.member.Peers() {
		if p.Alive && p.Record.ID != a.id && p.Meta.Waiting&gossip.StageBit(string(st)) != 0 {
			waiting = append(waiting, p)
		}
	}
	rand.Shuffle(len(waiting), func(i, j int) { waiting[i], waiting[j] = waiting[j], waiting[i] })
	sent := 0
	for _, p := range waiting {
		if sent == 2 {
			return
		}
		if a.idleGrants.due(p.Record.ID+"/"+string(st), now, grantIdleEvery) {
			a.sendGrant(p.Record, st, free)
			sent++
		}
	}
}

// throttle remembers when each key last acted.
type throttle struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// due reports whether key last acted at least every ago (and notes that it
// acts now), forgetting keys long quiet.
func (t *throttle) due(key string, now time.Time, every time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.last == nil {
		t.last = map[string]time.Time{}
	}
	if now.Sub(t.last[key]) < every {
		return false
	}
	if len(t.last) > 1024 {
		for k, at := range t.last {
			if now.Sub(at) > every {
				delete(t.last, k)
			}
		}
	}
	t.last[key] = now
	return true
}

// sendGrant sends rec's node a grant of free slots of st, in the background.
func (a *Agent) sendGrant(rec gossip.NodeRecord, st jobs.Stage, free int) {
	pid, err := peer.Decode(rec.PeerID)
	if err != nil {
		return
	}
	a.wg.Go(func() {
		ctx, cancel := context.WithTimeout(a.ctx, time.Second)
		defer cancel()
		if err := grant.Send(ctx, a.host, pid, rec.P2PAddrs, string(st), free, routing.GrantTTL); err != nil {
			a.log.Debug("credit grant not sent", zap.String("to", rec.ID), zap.Error(err))
		}
	})
}
