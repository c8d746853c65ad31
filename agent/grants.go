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

// takeGrant takes a grant from a member: a stage of the pipeline, and a
// peer whose node record this agent has. A grant made for work waiting
// here when none is (routing.Declines) is declined; a decline of this
// node's grant has its worker loop grant the slots anew.
func (a *Agent) takeGrant(from peer.ID, m grant.Msg) {
	st := jobs.Stage(m.Stage)
	if !slices.Contains(jobs.Stages(), st) {
		return // a name that is no stage is not kept
	}
	rec, ok := a.member.ByPeerID(from.String())
	if !ok || rec.ID == a.id {
		return
	}
	now := time.Now()
	switch {
	case m.Decline:
		if b := a.books[st]; b != nil && b.Decline(rec.ID, now) {
			a.meshChanged.Fire() // the worker loop grants the slots anew
		}
	case routing.Declines(m.Waiting, a.waiting[st].Load()):
		d := grant.New(m.Stage, 0, routing.WaitingTTL)
		d.Decline = true
		a.sendGrant(rec, d)
	default:
		a.grants.Grant(rec.ID, m.Stage, m.Free, now.Add(m.TTL()))
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
// it ends (its work done), by routing.GrantFreed: the task's dispatcher,
// whose ledger gives itself the credit back once it sees the task gone,
// when the claim reached this node through its inbox (every task now:
// pushed or handed on); else grantIdle's choice.
func (a *Agent) grantFreed(st jobs.Stage, c *jobs.Claim) {
	d := c.Task.Dispatcher
	if !c.Pushed || d == a.id || !a.alive(d) {
		d = ""
	}
	v := a.ownView(st)
	if d != "" || v.Free <= 0 {
		a.grant(st, routing.GrantFreed(v, d, nil), nil) // it reads no gossip then
		return
	}
	v, records := a.gossipView(st, v, c.Task.Producer())
	a.grant(st, routing.GrantFreed(v, d, nil), records)
}

// grantQueue grants this node's queue credit for st when a task of it
// starts (routing.GrantQueue) to a dispatcher gossip shows with tasks of
// st waiting, fed first.
func (a *Agent) grantQueue(st jobs.Stage, fed string) {
	v := a.ownView(st)
	if v.Queue <= 0 {
		return // no queue credit: routing.GrantQueue grants nothing, and gossip need not be read
	}
	v, records := a.gossipView(st, v, fed)
	if g := routing.GrantQueue(v, nil); g.To != "" {
		a.sendGrant(records[g.To], grantMsg(st, g))
	}
}

// grantIdle gives this node's free slots of st an owner unless they have
// one (routing.GrantIdle: fed, the producer of the task that just ended,
// first), and returns when the owner's hold lapses (zero: none). A
// dispatcher hands waiting work on only against such a grant. A worker
// whose loop finds nothing to start calls it, and again at every change
// of gossip, so an owner that let its hold lapse unspent is replaced.
func (a *Agent) grantIdle(st jobs.Stage, fed string) time.Time {
	if _, until := a.books[st].Promised(time.Now()); !until.IsZero() {
		return until // kept until it lapses; no need to look at gossip
	}
	v, records := a.gossipView(st, a.ownView(st), fed)
	return a.grant(st, routing.GrantIdle(v, nil), records)
}

// grant promises this node's free slots of st by g (none for a zero g),
// sends g unless its holder's ledger returns it, and returns when the
// promise lapses.
func (a *Agent) grant(st jobs.Stage, g routing.SlotGrant, records map[string]gossip.NodeRecord) time.Time {
	if g.To == "" {
		return time.Time{}
	}
	until := a.books[st].Promise(g, time.Now())
	if !g.Returned {
		a.sendGrant(records[g.To], grantMsg(st, g))
	}
	return until
}

// grantMsg is grant g of st's slots as sent.
func grantMsg(st jobs.Stage, g routing.SlotGrant) grant.Msg {
	m := grant.New(string(st), g.Free, g.TTL)
	m.Waiting = g.Waiting
	return m
}

// ownView is what this node knows of its own slots of st when it grants
// them (routing.SlotView): free ones, queue credit, and the current
// promise. gossipView adds the grantees, which a task's end with a
// dispatcher to return the slot to, and a start with no queue credit, do
// not need: they come at every task's start and end, and the list of
// members is copied to read them.
func (a *Agent) ownView(st jobs.Stage) routing.SlotView {
	v := routing.SlotView{Free: a.grantable(st)}
	if a.takingWork(st) {
		v.Queue = a.queueCredit(st)
	}
	v.Owner, _ = a.books[st].Promised(time.Now())
	return v
}

// gossipView is v with the grantees gossip shows for st, fed being the
// producer of the task that just ended (or ""), and their node records.
func (a *Agent) gossipView(st jobs.Stage, v routing.SlotView, fed string) (routing.SlotView, map[string]gossip.NodeRecord) {
	var records map[string]gossip.NodeRecord
	v.Waiting, v.Producers, records = a.grantees(st)
	if _, ok := records[fed]; ok {
		v.Fed = fed
	}
	return v, records
}

// queueCredit is how many tasks of st beyond its free slots and the
// claims in its inbox this node would start soon enough to keep
// (routing.SlotBook.Room): a dispatcher with work waiting is granted them
// with the free slots, so that the next task is in this node's inbox when
// a slot frees, not handed on only then (a 1-slot denoise of 3 ms tasks
// idled about a millisecond a task for the hand-on).
func (a *Agent) queueCredit(st jobs.Stage) int {
	if a.inboxes[st] == nil {
		return 0
	}
	return a.books[st].Room(a.inboxWaiting(st), a.cfg.Queue.HoldFor, time.Now())
}

// inboxWaiting is how many claims of st wait in this node's inbox.
func (a *Agent) inboxWaiting(st jobs.Stage) int {
	if q := a.inboxes[st]; q != nil {
		return q.Waiting(a.member.Lease())
	}
	return 0
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
			if a.books[st].Declined(p.Record.ID, p.MetaAt) {
				continue // it declined since gossip last showed it
			}
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
		a.sendGrant(p.Record, grant.New(string(st), 0, routing.GrantTTL))
	}
}

// sendGrant sends rec's node grant m, in the background.
func (a *Agent) sendGrant(rec gossip.NodeRecord, m grant.Msg) {
	pid, err := peer.Decode(rec.PeerID)
	if err != nil {
		return
	}
	a.wg.Go(func() {
		ctx, cancel := context.WithTimeout(a.ctx, time.Second)
		defer cancel()
		if err := grant.Send(ctx, a.host, pid, rec.P2PAddrs, m); err != nil {
			a.log.Debug("credit grant not sent", zap.String("to", rec.ID), zap.Error(err))
		}
	})
}
