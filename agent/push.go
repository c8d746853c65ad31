package agent

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
)

// Pushed claims (jobs.Push, routing.QueuePolicy.Push): whoever creates a
// task, a submitting API or a committing worker, claims it in the same
// write for the worker it hints, when that worker has a free slot; a task
// that waited is claimed for one the same way by its dispatcher
// (dispatch.go). The worker finds the claim in its inbox and starts it
// with no claim transaction of its own, and nobody races for it: a
// handoff costs one etcd write instead of two. What a worker cannot start
// soon it hands over to a free worker, or gives back to its dispatcher.

// pushTarget is the worker of stage st that a new task for model should go
// to (pickHint: one with a free slot), and, when the queue policy pushes,
// the claim to make for it, on the lease its registration lives on.
func (a *Agent) pushTarget(st jobs.Stage, s engine.Spec) (hint string, push *jobs.Push) {
	hint = a.pickHint(st, s)
	if hint == "" || !a.cfg.Queue.Push {
		return hint, nil
	}
	if a.waiting[st].Load() {
		return hint, nil // tasks of st wait in this agent's ledger: the new one takes its place in their order
	}
	if p, ok := a.member.Peer(hint); ok && p.Lease != 0 {
		a.grants.Take(hint, string(st), time.Now()) // pushed against its grant, if it made one: one credit spent
		return hint, &jobs.Push{Node: hint, Lease: p.Lease}
	}
	return hint, nil
}

// issueTickets returns outs with, on each peer-to-peer payload, a ticket
// issued to node, the worker its task is pushed to: that worker pulls
// without asking this producer for one (and this producer need not check
// its claim in etcd: it makes the claim itself, in the same commit). A
// conditioning cache entry this node holds (its copy's ref in Ref) gets
// one for that copy. A payload it cannot issue for goes without; its
// consumer asks as usual.
func (a *Agent) issueTickets(outs []jobs.Input, node string) []jobs.Input {
	p, ok := a.member.Peer(node)
	if !ok || p.Record.PeerID == "" {
		return outs
	}
	pid, err := peer.Decode(p.Record.PeerID)
	if err != nil {
		return outs
	}
	withTickets := slices.Clone(outs)
	for i, in := range withTickets {
		if in.Node != a.id {
			continue
		}
		id := in.Payload
		if in.Store {
			ref, ok := cachedCopy(in)
			if !ok {
				continue
			}
			id = ref.ID
		}
		if raw, err := a.xfer.Issue(id, pid); err == nil {
			withTickets[i].Ticket = raw
		} else {
			a.log.Debug("issuing a ticket for a pushed task", zap.String("payload", in.Payload), zap.Error(err))
		}
	}
	return withTickets
}

// pushedClaims are the claims pushed to this agent for stage st that it
// may start. One for a model its engine does not serve (an engine that
// re-registered without it) is given back at once.
func (a *Agent) pushedClaims(st jobs.Stage, q *jobs.Inbox, lease clientv3.LeaseID) []*jobs.Claim {
	cs := q.Pushed(lease)
	out := cs[:0]
	for _, c := range cs {
		if !a.runner.Serves(st, c.Task.Spec.ModelName()) {
			if c.Offered() {
				continue // given back once its write is in the inbox
			}
			a.giveBack(q, c, a.handOverTo(st, c.Task.Spec), "model not served here")
			continue
		}
		out = append(out, c)
	}
	return out
}

// pushedOf is how the queue policy sees pushed claims cs (routing.Pushed):
// the worker's turn over them is routing's (QueuePolicy.Pick, Returns),
// as the simulator's workers take theirs.
func pushedOf(cs []*jobs.Claim) []routing.Pushed {
	out := make([]routing.Pushed, len(cs))
	for i, c := range cs {
		out[i] = routing.Pushed{Candidate: candidate(c.Task), At: c.StartedAt, NotBefore: c.Task.NotBefore, Offered: c.Offered()}
	}
	return out
}

// returnPushes gives back the claims pushed to this agent for stage st
// that it cannot start (routing.QueuePolicy.Returns): those it has had no
// slot for within the steal grace while another worker could start them,
// and interactive ones due for preemption that it has no batch task to
// give way for. Each goes back to its dispatcher, which hands it to a
// worker that grants it a slot (a hand-over here could only go by
// gossip's free slots, which lag, and a worker they show free may be as
// busy). It returns when to look again (zero: nothing is waiting).
func (a *Agent) returnPushes(st jobs.Stage, q *jobs.Inbox) (next time.Time) {
	lease := a.member.Lease()
	claimed, enqueued, n := q.Oldest(lease)
	if n == 0 {
		return time.Time{} // the common case: ask nothing of gossip or the running tasks
	}
	now := time.Now()
	// None has waited the steal grace, nor is due for preemption: nothing
	// to look at before the first of those (a worker with a queue in its
	// inbox comes here at every change).
	due := claimed.Add(a.cfg.Queue.StealGrace)
	if a.cfg.Queue.PreemptAfter > 0 {
		due = earliest(due, enqueued.Add(a.cfg.Queue.PreemptAfter))
	}
	if now.Before(due) {
		return due
	}
	pushed := q.Pushed(lease)
	back, next := a.cfg.Queue.Returns(pushedOf(pushed), now, a.otherWorker(st), len(a.batchOnly(st)) > 0, a.books[st])
	for _, r := range back {
		why := "no free slot"
		if r.Stranded {
			why = "interactive work this worker cannot make room for" // its dispatcher finds a worker that yields
		}
		a.giveBack(q, pushed[r.Index], nil, why)
	}
	return next
}

// settled waits, within the etcd timeout, for offered claim c's write,
// and reports whether it confirmed the offer: c is then a claim in etcd
// like any pushed one.
func (a *Agent) settled(c *jobs.Claim) bool {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	return c.Settle(ctx) == nil
}

// handOverTo chooses the worker of stage st a pushed claim of a task for
// s is handed over to when this agent cannot start it at all (draining,
// or its engine no longer serves the model; routing.PickHint): another
// live worker that takes such work now (gossip: its roles, models and
// adapters) with a free slot (credit; not its queue credit: this worker's
// own queue is what it hands over from). nil: none, the claim goes back
// to its dispatcher.
func (a *Agent) handOverTo(st jobs.Stage, s engine.Spec) *jobs.Push {
	now := time.Now()
	node := a.pickWorker(st, s, func(p gossip.Peer) routing.Target {
		if p.Record.ID == a.id {
			return routing.Target{}
		}
		return routing.Target{Free: a.credit(p, st, now).Free}
	})
	if p, ok := a.member.Peer(node); ok && p.Lease != 0 {
		return &jobs.Push{Node: node, Lease: p.Lease}
	}
	return nil
}

// otherWorker reports whether stage st has a live worker besides this
// one, free or not: a claim this one cannot start goes back to its
// dispatcher, which pushes it to the first of them to free a slot
// (routing.QueuePolicy.GiveBack).
func (a *Agent) otherWorker(st jobs.Stage) bool {
	for _, p := range a.member.Peers() {
		if p.Alive && p.Record.ID != a.id && p.Record.HasRole(string(st)) {
			return true
		}
	}
	return false
}

// giveBack returns pushed claim c: handed over to worker to (Store.HandOver)
// when there is one and its lease holds, else to its dispatcher (a
// requeue); both are fenced by the claim. It marks the claim taken so that
// it is not given back twice while the inbox has yet to see it go.
func (a *Agent) giveBack(q *jobs.Inbox, c *jobs.Claim, to *jobs.Push, why string) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	var err error
	if to != nil {
		if err = a.store.HandOver(ctx, c, to); cache.LeaseGone(err) {
			to = nil // its lease just ended
		}
	}
	if to == nil {
		err = a.givingBack(c, func() error { return a.store.Requeue(ctx, c) })()
	}
	if err != nil {
		a.log.Debug("giving back a pushed claim", zap.String("job", c.Task.JobID), zap.String("stage", string(c.Task.Stage)), zap.Error(err))
		return // fenced (gone already), or etcd failed: the next look tries again
	}
	q.Take(c)
	log := a.log.With(zap.String("job", c.Task.JobID), zap.String("stage", string(c.Task.Stage)), zap.String("why", why))
	if to != nil {
		a.metrics.HandedOver(c.Task.Stage)
		log.Debug("pushed claim given back", zap.String("handed_to", to.Node))
	} else {
		a.metrics.PushedClaim(c.Task.Stage, true)
		log.Debug("pushed claim given back")
	}
}

// returnAllPushes gives back every claim pushed to this agent: it is
// draining and starts nothing more.
func (a *Agent) returnAllPushes() {
	for _, st := range a.cfg.Roles {
		q := a.inboxes[st]
		for _, c := range q.Pushed(a.member.Lease()) {
			if c.Offered() && !a.settled(c) {
				continue // never written (or its lease's end frees it)
			}
			a.giveBack(q, c, a.handOverTo(st, c.Task.Spec), "draining")
		}
	}
}

// cachedCopy is the ref of the copy of cache entry in that its producer
// named (Input.Ref), when it holds one.
func cachedCopy(in jobs.Input) (transfer.Ref, bool) {
	var ref transfer.Ref
	if !in.Cached || len(in.Ref) == 0 || json.Unmarshal(in.Ref, &ref) != nil || ref.ID == "" {
		return ref, false
	}
	return ref, true
}

// pickHint names the preferred worker of stage st of s: pickWorker by
// the credit each offers (credit).
func (a *Agent) pickHint(st jobs.Stage, s engine.Spec) string {
	now := time.Now()
	return a.pickWorker(st, s, func(p gossip.Peer) routing.Target { return a.credit(p, st, now) })
}

// pickWorker chooses a worker of stage st for s by routing.PickHint: power
// of two choices among live peers taking work for it (for a denoise naming
// an adapter, among those that have it loaded) with free slots as free
// counts them, same host first. "": none has one.
func (a *Agent) pickWorker(st jobs.Stage, s engine.Spec, credit func(gossip.Peer) routing.Target) string {
	var targets []routing.Target
	model := s.ModelName()
	for _, p := range a.member.Peers() {
		if takesWork(p, st, model) && takesAdapterOf(p, st, s) {
			t := credit(p)
			t.Node, t.SameHost = p.Record.ID, a.sameHost(p)
			targets = append(targets, t)
		}
	}
	return routing.PickHint(targets, nil)
}

// takesWork reports whether peer p, as gossip has it, takes tasks of stage
// st for model now: alive, not suspect, and the stage among the roles of
// its gossiped meta (which leaves out a draining or blocked stage).
func takesWork(p gossip.Peer, st jobs.Stage, model string) bool {
	return p.Alive && !p.Suspect && p.Record.HasRole(string(st)) && slices.Contains(p.Meta.Roles, string(st)) &&
		p.Meta.Serves(string(st), model, engine.DefaultModel)
}

// credit is what worker p offers a task of stage st at now: for this
// node, its own free slots, which it knows exactly; else the slots p
// granted this node (grants.go), which no other producer holds; else the
// free slots and queue credit gossip shows, a round or two late and the
// same for every producer (a third of the denoise pushes of a simulated
// 10,000-GPU mesh met a worker another producer had just filled).
func (a *Agent) credit(p gossip.Peer, st jobs.Stage, now time.Time) routing.Target {
	if p.Record.ID == a.id {
		_, free := a.slots(st)
		return routing.Target{Free: free, Granted: true}
	}
	if g := a.grants.Free(p.Record.ID, string(st), now); g > 0 {
		return routing.Target{Free: g, Granted: true}
	}
	return routing.Target{Free: int(p.Meta.Free.For(string(st))), Room: int(p.Meta.Room.For(string(st)))}
}
