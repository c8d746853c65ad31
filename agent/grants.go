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

// grantFreed grants this node's free slots of st when a task of it ends,
// when the stage takes work (not while draining, held back by admission,
// or blocked). With dispatchers gossip shows holding tasks of st that
// wait (NodeMeta.Waiting), the slot goes to one of them, which hands it a
// task at once: fed, the producer of the task that just ended, if it is
// one (it has the credit back from its own ledger if it pushed that task,
// and is sent nothing), else one at random. A dispatcher hands waiting
// work on only against such a grant, so one slot granted twice would be
// one task pushed to a busy worker. With none waiting, the producers of
// the stage before get it as a hint for their next push
// (routing.GrantTo: fed and one other).
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
	if len(waiting) == 0 {
		for _, node := range routing.GrantTo(producers, fed, pushed, nil) {
			a.sendGrant(records[node], st, free)
		}
		return
	}
	to := waiting[rand.IntN(len(waiting))]
	if slices.Contains(waiting, fed) {
		if pushed {
			return // its ledger gave it the credit back
		}
		to = fed
	}
	a.idleGrants.due(to+"/"+string(st), time.Now(), grantIdleEvery) // grantIdle need not send it again
	a.sendGrant(records[to], st, free)
}

// grantIdleEvery is how often an idle worker grants its free slots again to
// one dispatcher that still shows work waiting.
const grantIdleEvery = routing.GrantTTL / 4

// grantIdle grants this node's free slots of st to one dispatcher gossip
// shows with tasks of st waiting, at most once per grantIdleEvery for
// each: a worker whose loop finds nothing to start. The grant a slot's
// end sends (grantFreed) goes nowhere while admission holds the stage
// back, and a dispatcher hands waiting work on only against a grant.
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
	for _, p := range waiting {
		if a.idleGrants.due(p.Record.ID+"/"+string(st), now, grantIdleEvery) {
			a.sendGrant(p.Record, st, free)
			return
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
