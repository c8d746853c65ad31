package agent

import (
	"context"
	"slices"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/grant"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// Credit grants (agent/grant, routing.Grants): a worker whose slot frees
// grants it at once, to one dispatcher with work waiting for its stage,
// or else to one producer that feeds the stage, which pushes its next task
// there against it (a promise, routing.SlotBook). Gossip carries free credits a
// round or two late, and the same to every producer: pushing by it sent a
// third of the denoise tasks of a simulated 10,000-GPU mesh to workers
// another producer had just filled. A producer whose pushed task is gone
// has that worker's credit back from its own ledger (creditReturned), with
// no message at all: the grant the worker would send it races the job's
// next stages, and lost that race to the next job's push on a loaded
// machine.

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

// grantFreed gives this node's free slots of st an owner when task c of
// it ends (its work done), when the stage takes work (not while draining,
// held back by admission, or blocked): one party at a time holds a free
// slot (routing.SlotBook), so that no two pushes meet on it. A task that reached
// this node through its inbox (every task now: pushed or handed on) gives
// its dispatcher the credit back from its own ledger once the commit
// lands (Grants.Return), so the slot is that dispatcher's, for
// routing.ReturnTTL, and nobody else is granted it meanwhile: granted to
// another dispatcher too, it was handed two tasks (a 16-GPU bench serve
// run gave back 0.9 denoise tasks a job). Otherwise grantIdle finds it an
// owner (the worker's loop calls it when it has nothing to start).
func (a *Agent) grantFreed(st jobs.Stage, c *jobs.Claim) {
	if a.grantable(st) <= 0 {
		return
	}
	if d := c.Task.Dispatcher; c.Pushed && d != "" && d != a.id && a.alive(d) {
		a.books[st].Promise(d, time.Now(), routing.ReturnTTL)
		return
	}
	a.grantIdle(st, c.Task.Producer())
}

// grantQueue grants this node's queue credit for st (queueCredit: the
// tasks it would start within the hold after those it has) to one
// dispatcher gossip shows with tasks of st waiting, fed first, when a task
// of st starts here: so that while a backlog waits, the next task is in
// this node's inbox when a slot frees, instead of being handed on only
// after the slot's grant (a 1-slot denoise of 3 ms tasks idled about a
// millisecond a task for that round trip). The grant says how things
// stand, so a dispatcher granted again holds the new figure, not the sum.
func (a *Agent) grantQueue(st jobs.Stage, fed string) {
	if !a.takingWork(st) {
		return
	}
	room := a.queueCredit(st)
	if room <= 0 {
		return
	}
	waiting, _, records := a.grantees(st)
	if to := routing.GrantTo(waiting, fed, nil); to != "" {
		a.sendGrant(records[to], st, room, grantWaitingTTL)
	}
}

// grantIdle gives this node's free slots of st an owner unless they have
// one (a promise that holds), and returns when that owner's hold lapses
// (zero: none made): to one dispatcher gossip shows with tasks of st
// waiting (fed, the producer of the task that just ended, first), which
// hands it a task at once, else, ahead of work, to one producer of the
// stage before for its next push (routing.GrantTo: fed, else one at
// random). A dispatcher hands waiting work on only against such a grant.
// A worker whose loop finds nothing to start calls it, so an owner that
// let its hold lapse unspent is replaced then.
func (a *Agent) grantIdle(st jobs.Stage, fed string) time.Time {
	free := a.grantable(st)
	if free <= 0 {
		return time.Time{}
	}
	now := time.Now()
	if to, until := a.books[st].Promised(now); to != "" {
		return until
	}
	waiting, producers, records := a.grantees(st)
	to, ttl := routing.GrantTo(producers, fed, nil), routing.GrantTTL
	if len(waiting) > 0 {
		to, ttl = routing.GrantTo(waiting, fed, nil), grantWaitingTTL
		free += a.queueCredit(st)
	}
	if to == "" {
		return time.Time{}
	}
	until := a.books[st].Promise(to, now, ttl)
	a.sendGrant(records[to], st, free, ttl)
	return until
}

// grantWaitingTTL is how long a slot granted to a dispatcher with work
// waiting is its: it hands a task on at once, or the slot goes to another
// soon.
const grantWaitingTTL = routing.GrantTTL / 4

// queueCredit is how many tasks of st beyond its free slots this node
// would start soon enough to keep (routing.SlotBook.Room): a dispatcher with work
// waiting is granted them with the free slots, so that the next task is in
// this node's inbox when a slot frees, not handed on only then (a 1-slot
// denoise of 3 ms tasks idled about a millisecond a task for the hand-on).
func (a *Agent) queueCredit(st jobs.Stage) int {
	q := a.inboxes[st]
	if q == nil {
		return 0
	}
	return a.books[st].Room(q.Waiting(a.member.Lease()), a.cfg.Queue.HoldFor, time.Now())
}

// grantable is how many slots of st this node may grant now: its free
// ones (slots leaves out those the claims in its inbox take next), when
// the stage takes work.
func (a *Agent) grantable(st jobs.Stage) int {
	if !a.takingWork(st) {
		return 0
	}
	_, free := a.slots(st)
	return free
}

// takingWork reports whether stage st takes work now: not while this
// agent drains, admission holds the stage back, or no task's output fits.
func (a *Agent) takingWork(st jobs.Stage) bool {
	return !a.draining.Load() && !a.held[st].Load() && !a.blocked[st].Load()
}

// grantees are who gossip shows may be granted slots of st: the
// dispatchers with tasks of st waiting, and the producers of the stage
// before (its workers), with their node records.
func (a *Agent) grantees(st jobs.Stage) (waiting, producers []string, records map[string]gossip.NodeRecord) {
	records = map[string]gossip.NodeRecord{}
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
	return waiting, producers, records
}

// revokeGrant takes back the grant of st's slots that producer holds: the
// slot went to another task.
func (a *Agent) revokeGrant(st jobs.Stage, producer string) {
	if p, ok := a.member.Peer(producer); ok {
		a.sendGrant(p.Record, st, 0, routing.GrantTTL)
	}
}

// sendGrant sends rec's node a grant of free slots of st for ttl, in the
// background.
func (a *Agent) sendGrant(rec gossip.NodeRecord, st jobs.Stage, free int, ttl time.Duration) {
	pid, err := peer.Decode(rec.PeerID)
	if err != nil {
		return
	}
	a.wg.Go(func() {
		ctx, cancel := context.WithTimeout(a.ctx, time.Second)
		defer cancel()
		if err := grant.Send(ctx, a.host, pid, rec.P2PAddrs, string(st), free, ttl); err != nil {
			a.log.Debug("credit grant not sent", zap.String("to", rec.ID), zap.Error(err))
		}
	})
}
