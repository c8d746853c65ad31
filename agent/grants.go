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
// grants it at once, to one dispatcher with work waiting for its stage,
// or else to one producer that feeds the stage, which pushes its next task
// there against it (a promise, slotBook). Gossip carries free credits a
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

// grantFreed grants this node's free slots of st when a task of it ends,
// when the stage takes work (not while draining, held back by admission,
// or blocked). With
// dispatchers gossip shows holding tasks of st that wait
// (NodeMeta.Waiting), the slots go to one of them, which hands them a task
// at once: fed, the producer of the task that just ended, if it is one
// (it has the credit back from its own ledger if it pushed that task, and
// is sent nothing), else one at random. A dispatcher hands waiting work on
// only against such a grant, so one slot granted twice would be one task
// pushed to a busy worker. (Waiting work comes first: a slot promised
// ahead is taken back if a hand-on takes it, slotBook.take.) With none
// waiting, they are promised to one producer of the stage before for its
// next push (routing.GrantTo: fed, else one at random), unless they are
// promised already.
func (a *Agent) grantFreed(st jobs.Stage, fed string, pushed bool) {
	free := a.grantable(st)
	if free <= 0 {
		return
	}
	waiting, producers, records := a.grantees(st)
	if len(waiting) == 0 {
		if to, _ := a.books[st].promised(time.Now()); to == "" {
			to = routing.GrantTo(producers, fed, nil)
			a.promise(st, to, free, records, to != fed || !pushed)
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
	a.sendGrant(records[to], st, free+a.queueCredit(st))
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
	if a.draining.Load() || a.held[st].Load() || a.blocked[st].Load() {
		return
	}
	room := a.queueCredit(st)
	if room <= 0 {
		return
	}
	waiting, _, records := a.grantees(st)
	if len(waiting) == 0 {
		return
	}
	to := waiting[rand.IntN(len(waiting))]
	if slices.Contains(waiting, fed) {
		to = fed
	}
	a.sendGrant(records[to], st, room)
}

// grantIdleEvery is how often an idle worker grants its free slots again to
// one dispatcher that still shows work waiting.
const grantIdleEvery = routing.GrantTTL / 4

// grantIdle grants this node's free slots of st: to one dispatcher gossip
// shows with tasks of st waiting, at most once per grantIdleEvery for
// each, else, unless they are promised already, to a producer of the stage
// before, as a promise. A worker whose loop finds nothing to start calls
// it: the grant a slot's end sends (grantFreed) goes nowhere while
// admission holds the stage back, a dispatcher hands waiting work on only
// against a grant, and a promise lapses unspent when its producer had no
// task. It returns when the slots' promise lapses (zero: none holds).
func (a *Agent) grantIdle(st jobs.Stage) time.Time {
	free := a.grantable(st)
	if free <= 0 {
		return time.Time{}
	}
	waiting, producers, records := a.grantees(st)
	now := time.Now()
	if len(waiting) == 0 {
		if _, until := a.books[st].promised(now); !until.IsZero() {
			return until
		}
		return a.promise(st, routing.GrantTo(producers, "", nil), free, records, true)
	}
	rand.Shuffle(len(waiting), func(i, j int) { waiting[i], waiting[j] = waiting[j], waiting[i] })
	for _, to := range waiting {
		if a.idleGrants.due(to+"/"+string(st), now, grantIdleEvery) {
			a.sendGrant(records[to], st, free+a.queueCredit(st))
			break
		}
	}
	return time.Time{}
}

// queueCredit is how many tasks of st beyond its free slots this node
// would start soon enough to keep (slotBook.room): a dispatcher with work
// waiting is granted them with the free slots, so that the next task is in
// this node's inbox when a slot frees, not handed on only then (a 1-slot
// denoise of 3 ms tasks idled about a millisecond a task for the hand-on).
func (a *Agent) queueCredit(st jobs.Stage) int {
	q := a.inboxes[st]
	if q == nil {
		return 0
	}
	return a.books[st].room(q.Waiting(a.member.Lease()), a.cfg.Queue.HoldFor, time.Now())
}

// grantable is how many slots of st this node may grant now: its free
// ones, when the stage takes work (not while draining, held back by
// admission, or blocked).
func (a *Agent) grantable(st jobs.Stage) int {
	if a.draining.Load() || a.held[st].Load() || a.blocked[st].Load() {
		return 0
	}
	_, free := a.slots(st)
	return free
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

// promise promises the free slots of st to producer to ("": none), and
// sends it the grant when send (a producer that pushed the task just
// ended has the credit back from its own ledger). It returns when the
// promise lapses.
func (a *Agent) promise(st jobs.Stage, to string, free int, records map[string]gossip.NodeRecord, send bool) time.Time {
	if to == "" {
		return time.Time{}
	}
	now := time.Now()
	a.books[st].promise(to, now)
	if send {
		a.sendGrant(records[to], st, free)
	}
	_, until := a.books[st].promised(now)
	return until
}

// revokeGrant takes back the grant of st's slots that producer holds: the
// slot went to another task.
func (a *Agent) revokeGrant(st jobs.Stage, producer string) {
	if p, ok := a.member.Peer(producer); ok {
		a.sendGrant(p.Record, st, 0)
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
