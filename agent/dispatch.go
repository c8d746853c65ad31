package agent

// Dispatch: how a waiting task reaches a worker. Nobody follows a whole
// stage. A task's dispatcher (its creator: the submitting agent, or the
// worker whose commit or rewind made it) pushes it to a worker with a free
// slot as it creates it (push.go); a task with no such worker then waits
// in etcd, and in its dispatcher's ledger (jobs.Fed), which follows it by
// its one key. The dispatcher hands it on (jobs.Store.Assign: one
// transaction, the same claim a push makes) against a slot a worker
// granted it (grants.go), or to itself when it has one. A worker grants a
// freed slot to one dispatcher gossip shows with work waiting for its
// stage (NodeMeta.Waiting), so a backlog drains at the pace workers free
// up, one grant per slot, with no race: only a task's dispatcher hands it
// on, and only one dispatcher holds a slot's grant. (Gossip's free slots
// are a round or two late, and every dispatcher sees the same: handing on
// by them pushed several tasks to one slot.) A dispatcher that leaves has
// its waiting tasks adopted by another node (adoptLoop).

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// dispatchEvery bounds how long a waiting task goes unlooked-at: a grant
// and gossip both wake the loop, so this is only the net under a missed
// wake.
const dispatchEvery = 250 * time.Millisecond

// grantWait is how long waiting tasks go only to workers that granted
// this node a slot before a dispatch pass hands them to workers gossip
// shows free too. A grant arrives within milliseconds of a slot's end on
// a quiet machine; on a loaded one (the CI's race run) an interactive task
// waited a whole second of 1 s here behind a batch backlog, which class
// ordering exists to avoid.
const grantWait = 250 * time.Millisecond

// gossipSettled is how long a worker's gossip must have stood still before
// a dispatcher that waited grantWait hands it a task by its free slots: a
// worker that is idle and granted this dispatcher nothing (its grant lost,
// or gone elsewhere) says the same for long; one whose slot just freed is
// most likely taken already (by the owner of that slot, or by another
// dispatcher's grant), and its gossip is a round or two behind. Without
// it, a 16-GPU Wan bench serve run handed 76 waiting tasks by gossip to
// busy workers, each given back.
const gossipSettled = time.Second

// adoptEvery is how often one agent per stage sweeps the stage for tasks
// whose dispatcher left, besides a sweep at every departure:
// the net under a departure missed. (A task given back after its
// dispatcher left is adopted by the worker giving it back.)
const adoptEvery = time.Minute

// broadcast: Wait returns a channel closed at the next Fire.
type broadcast struct {
	mu sync.Mutex
	ch chan struct{}
}

func (s *broadcast) Wait() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == nil {
		s.ch = make(chan struct{})
	}
	return s.ch
}

func (s *broadcast) Fire() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
		s.ch = nil
	}
}

// holderGrace is how long a holder that came back on a new lease (etcd
// lost its old one, and the claims on it) has to take its finished work
// back (Store.Reclaim) before its tasks' dispatchers hand them on.
const holderGrace = 5 * time.Second

// liveOn reports whether a claim node holds on lease (0: any lease) still
// stands, as far as this agent can tell without asking etcd: node is a
// live member on that lease, or has been on another one for less than
// holderGrace. (A claim that does not stand may still be there; Assign
// compares it absent.)
func (a *Agent) liveOn(node string, lease int64) bool {
	cur := a.member.Lease()
	if node != a.id {
		p, ok := a.member.Peer(node)
		if !ok || !p.Alive {
			return false
		}
		cur = p.Lease
	}
	if lease == 0 || int64(cur) == lease {
		return true
	}
	return time.Since(a.leases.since(node, int64(cur))) < holderGrace
}

// liveOnMemo is liveOn remembering its answers, for one pass over many
// tasks.
func (a *Agent) liveOnMemo() func(node string, lease int64) bool {
	type holder struct {
		node  string
		lease int64
	}
	seen := map[holder]bool{}
	return func(node string, lease int64) bool {
		h := holder{node, lease}
		live, ok := seen[h]
		if !ok {
			live = a.liveOn(node, lease)
			seen[h] = live
		}
		return live
	}
}

// alive reports whether node is a live member, registered or not: a
// dispatcher keeps its ledger in memory, lease or none.
func (a *Agent) alive(node string) bool {
	if node == a.id {
		return true
	}
	p, ok := a.member.Peer(node)
	return ok && p.Alive
}

// leaseAges remembers since when this agent has seen each node on its
// current lease (0 while it registers again).
type leaseAges struct {
	mu   sync.Mutex
	seen map[string]leaseSeen
}

type leaseSeen struct {
	lease int64
	since time.Time
}

// since is when node was first seen on lease, now for a lease not seen
// before.
func (l *leaseAges) since(node string, lease int64) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen == nil {
		l.seen = map[string]leaseSeen{}
	}
	s, ok := l.seen[node]
	if !ok || s.lease != lease {
		s = leaseSeen{lease: lease, since: time.Now()}
		l.seen[node] = s
	}
	return s.since
}

// dispatchLoop hands the tasks of stage st that wait in this agent's
// ledger to workers with a slot for them, in the queue policy's order,
// until none is left or no worker has a slot. It sleeps on the ledger, the
// mesh's gossip and grants (a.meshChanged), and a short timer while tasks
// wait. It hands on against grants, and after grantWait with nothing
// handed on, by gossip's free slots too.
func (a *Agent) dispatchLoop(st jobs.Stage) {
	f := a.fed[st]
	progress := time.Now() // when a task last went on, or none waited
	for a.ctx.Err() == nil {
		changed, mesh := f.Changed(), a.meshChanged.Wait()
		// Tasks that waited grantWait with none handed on go by gossip too:
		// a slot whose grant went elsewhere, or was never sent, is not lost.
		waiting, handed := a.dispatch(st, f, time.Since(progress) > grantWait)
		if handed > 0 || waiting == 0 {
			progress = time.Now()
		}
		a.setWaiting(st, waiting > 0)
		var tick <-chan time.Time
		var t *time.Timer
		if n, _ := f.Count(); waiting > 0 || n > 0 {
			// Tasks wait, or may start to when a holder's grace ends.
			every := dispatchEvery
			if waiting == 0 {
				every = time.Second
			}
			t = time.NewTimer(every)
			tick = t.C
		}
		select {
		case <-changed:
		case <-mesh:
		case <-tick:
		case <-a.ctx.Done():
		}
		if t != nil {
			t.Stop()
		}
	}
}

// dispatch hands on what it can of st's waiting tasks and returns how
// many still wait, and how many it handed on. byGossip lets it hand on to
// workers gossip shows free as well as to those that granted a slot.
func (a *Agent) dispatch(st jobs.Stage, f *jobs.Fed, byGossip bool) (waiting, handed int) {
	live := a.liveOnMemo() // a backlog's tasks name few holders
	if !byGossip && !a.holdsCredit(st, time.Now()) {
		// Nothing to hand on against: count, do not list and order, the
		// tasks (a pass runs at every change of the ledger and of gossip,
		// and a backlog behind a busy stage is long).
		return f.WaitingCount(live), 0
	}
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	tasks := f.Waiting(ctx, live)
	if len(tasks) == 0 {
		return 0, 0
	}
	now := time.Now()
	byID := make(map[string]jobs.Task, len(tasks))
	cands := make([]routing.Candidate, 0, len(tasks))
	for _, t := range tasks {
		byID[t.ID] = t
		c := candidate(t)
		c.Hint = "" // the dispatcher chooses; a hint only orders the workers' own
		cands = append(cands, c)
	}
	ordered, _ := a.cfg.Queue.Order(cands, a.id, now)
	waiting = len(tasks)
	given := map[string]int{} // claims this pass pushed to each worker, which no count shows yet
	// The kinds of task no worker had a slot for in this pass: the rest of
	// that kind wait too, and are not looked at again (a long queue would
	// cost a look at every worker per task on every change).
	full := map[targetKind]bool{}
	for _, c := range ordered {
		t := byID[c.ID]
		if t.NotBefore.After(now) {
			continue // backing off after a failure
		}
		kind := a.kindOf(t, now)
		if full[kind] {
			continue
		}
		to := a.assignTarget(st, t, now, given, byGossip)
		if to == nil {
			full[kind] = true
			continue // no worker has a slot for it: the next free one grants
		}
		claim, err := a.store.Assign(ctx, t, to)
		a.metrics.ClaimTxn(st)
		switch {
		case err == nil:
			f.Assigned(claim.Task, to.Node)
			given[to.Node]++
			waiting--
			handed++
			a.log.Debug("waiting task handed on", zap.String("job", t.JobID), zap.String("stage", string(st)), zap.String("to", to.Node))
		case errors.Is(err, jobs.ErrTaken):
			// Claimed, adopted or gone since the ledger saw it (the ledger
			// hears of it), or its last holder's claim is still there.
			a.metrics.ClaimConflict(st)
			f.Refused(t)
		case cache.LeaseGone(err):
			// The worker's lease just ended: gossip says so soon.
		default:
			a.log.Debug("handing a waiting task to a worker", zap.String("job", t.JobID), zap.String("stage", string(st)), zap.Error(err))
			return waiting, handed
		}
	}
	return waiting, handed
}

// holdsCredit reports whether this agent may hand a task of st on at now
// without gossip: a worker's grant holds credit, or this node has a free
// slot of its own for st.
func (a *Agent) holdsCredit(st jobs.Stage, now time.Time) bool {
	if a.grants.Any(string(st), now) {
		return true
	}
	if a.credits[st] == nil {
		return false
	}
	_, free := a.slots(st)
	return free > 0
}

// targetKind is what assignTarget's choice depends on besides the
// workers: a task's model and adapter, and whether it is interactive work
// due for preemption.
type targetKind struct {
	model, adapter string
	due            bool
}

func (a *Agent) kindOf(t jobs.Task, now time.Time) targetKind {
	return targetKind{model: t.Spec.ModelName(), adapter: t.Spec.Adapter, due: a.duePreemption(t, now)}
}

// duePreemption reports whether t is interactive work that has waited
// past --preempt-after: its dispatcher may push it to a worker that would
// stop batch work for it.
func (a *Agent) duePreemption(t jobs.Task, now time.Time) bool {
	after := a.cfg.Queue.PreemptAfter
	return after > 0 && t.Class == routing.Interactive && !now.Before(t.EnqueuedAt.Add(after))
}

// assignTarget chooses the worker waiting task t goes to: pickWorker's
// choice among those that granted this node a credit (credit, less what
// this pass gave each already; byGossip: or that gossip shows free), and
// for interactive work past its preemption time with none free, a worker
// that runs batch work it can stop for it (NodeMeta.Yields; the worker's
// preemption loop gives way for a claim pushed to it). nil: none.
func (a *Agent) assignTarget(st jobs.Stage, t jobs.Task, now time.Time, given map[string]int, byGossip bool) *jobs.Push {
	s := t.Spec
	if st == jobs.Denoise && s.Adapter != "" && !a.adapterServed(s.ModelName(), s.Adapter) {
		if ok, _ := a.takesAdapter(st, t, now); !ok {
			return nil // nobody has its adapter loaded yet; within the grace one may load it
		}
		s.Adapter = "" // nobody has it: any worker fails the job (runAdapter)
	}
	// Against a grant (or this node's own free slot), less what this pass
	// gave; by gossip's free slots only past grantWait (byGossip).
	node := a.pickWorker(st, s, func(p gossip.Peer) routing.Target {
		id := p.Record.ID
		if c := a.credit(p, st, now); c.Granted && c.Free > given[id] {
			return routing.Target{Free: c.Free - given[id], Granted: true}
		}
		if byGossip && id != a.id && saidSince(p, t) && now.Sub(p.MetaAt) >= gossipSettled {
			return routing.Target{Free: int(p.Meta.Free.For(string(st))) - given[id]}
		}
		return routing.Target{}
	})
	if node == "" && a.duePreemption(t, now) {
		node = a.pickWorker(st, s, func(p gossip.Peer) routing.Target {
			if p.Meta.Yields&gossip.StageBit(string(st)) != 0 && given[p.Record.ID] == 0 && saidSince(p, t) {
				return routing.Target{Free: 1}
			}
			return routing.Target{}
		})
	}
	if node == "" {
		return nil
	}
	p, ok := a.member.Peer(node)
	if !ok || p.Lease == 0 {
		return nil
	}
	if node != a.id {
		a.grants.Take(node, string(st), now) // against its grant: one credit spent
	}
	return &jobs.Push{Node: node, Lease: p.Lease}
}

// saidSince reports whether what gossip says of worker p (its free slots,
// whether it yields) may send it waiting task t: unless p gave t back,
// and has gossiped nothing since this node's ledger saw it back. What p
// said before is what it turned down; a worker whose batch task had just
// ended was sent the same interactive task eight times in 40 ms, each
// given back, until its gossip caught up.
func saidSince(p gossip.Peer, t jobs.Task) bool {
	return t.Back != p.Record.ID || p.MetaAt.After(t.Seen)
}

// givingBack wraps give, a give-back of claim c (Requeue, Yield,
// Abandon): a task given back waits for its dispatcher, and one whose
// dispatcher left would wait for the next sweep, so the worker giving it
// back becomes its dispatcher in the same write, and follows it.
func (a *Agent) givingBack(c *jobs.Claim, give func() error) func() error {
	if d := c.Task.Dispatcher; d == "" || a.alive(d) {
		return give
	}
	return func() error {
		c.Task.Dispatcher = a.id
		err := give()
		if err == nil {
			a.fed[c.Task.Stage].Add(jobs.Task{Key: c.Task.Key, Stage: c.Task.Stage}) // read once: its revision is the give-back's
		}
		return err
	}
}

// setWaiting records whether stage st has tasks waiting in this agent's
// ledger and gossips the change: workers of st grant their free slots to
// the dispatchers that have (grants.go).
func (a *Agent) setWaiting(st jobs.Stage, w bool) {
	if a.waiting[st].Swap(w) != w {
		a.publishMeta()
	}
}

// adoptLoop adopts the waiting tasks of dispatchers that left the mesh:
// at every departure, and every adoptEvery, for each stage this agent is
// the sweeper of (one live agent per stage, by rendezvous), it reads the
// stage's tasks and makes itself the dispatcher of those whose dispatcher
// is gone (jobs.Store.Orphans, Adopt). A sweep is one range read.
func (a *Agent) adoptLoop() {
	t := time.NewTicker(adoptEvery)
	defer t.Stop()
	for {
		departed := a.departed.Wait()
		select {
		case <-a.ctx.Done():
			return
		case <-departed:
		case <-t.C:
		}
		a.sweepAll()
	}
}

// sweepAll sweeps each stage this agent is the sweeper of.
func (a *Agent) sweepAll() {
	for _, st := range jobs.Stages() {
		if a.sweeper(st) {
			a.adopt(st)
		}
	}
}

// sweeper reports whether this agent sweeps stage st for orphans: the
// live agent that wins the stage by rendezvous (cache.RendezvousScore).
func (a *Agent) sweeper(st jobs.Stage) bool {
	key := "sweep/" + string(st)
	mine := cache.RendezvousScore(a.id, key)
	for _, p := range a.member.Peers() {
		if p.Alive && p.Record.ID != a.id && cache.RendezvousScore(p.Record.ID, key) > mine {
			return false
		}
	}
	return true
}

// adopt makes this agent the dispatcher of st's orphaned waiting tasks.
func (a *Agent) adopt(st jobs.Stage) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	orphans, err := a.store.Orphans(ctx, st, a.id, a.alive, a.liveOn)
	if err != nil {
		a.log.Debug("sweeping for orphaned tasks", zap.String("stage", string(st)), zap.Error(err))
		return
	}
	for _, t := range orphans {
		adopted, err := a.store.Adopt(ctx, t, a.id)
		if err != nil {
			continue // claimed, adopted or gone meanwhile
		}
		a.log.Info("adopted a task whose dispatcher left", zap.String("job", t.JobID), zap.String("stage", string(st)), zap.String("from", t.Dispatcher))
		a.fed[st].Add(adopted)
	}
}
