package agent

// Dispatch: how a waiting task reaches a worker. Nobody follows a whole
// stage. A task's dispatcher (its creator: the submitting agent, or the
// worker whose commit or rewind made it) pushes it to a worker with a free
// slot as it creates it (push.go); a task with no such worker then waits
// in etcd, and in its dispatcher's ledger (jobs.Fed), which follows it by
// its one key. The dispatcher hands it on (jobs.Store.Assign: one
// transaction, the same claim a push makes) as soon as a worker has a
// slot for it: one gossip shows free, or one that granted this node its
// credit (grants.go). Workers grant their freed slots to the dispatchers
// gossip shows with work waiting for their stage (NodeMeta.Waiting), so a
// backlog drains at the pace workers free up, one grant per slot, with no
// race: only a task's dispatcher hands it on. A dispatcher that leaves
// has its waiting tasks adopted by another node (adoptLoop).

import (
	"context"
	"errors"
	"hash/fnv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// dispatchEvery bounds how long a waiting task goes unlooked-at: a free
// slot shows by gossip or a grant, both of which wake the loop, so this
// is only the net under a missed wake.
const dispatchEvery = 250 * time.Millisecond

// adoptEvery is how often one agent per stage sweeps the stage for tasks
// whose dispatcher left (besides a sweep at every departure).
const adoptEvery = 10 * time.Second

// signal is a broadcast: Wait returns a channel closed at the next Fire.
type signal struct {
	mu sync.Mutex
	ch chan struct{}
}

func (s *signal) Wait() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == nil {
		s.ch = make(chan struct{})
	}
	return s.ch
}

func (s *signal) Fire() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
		s.ch = nil
	}
}

// liveOn reports whether node is a live member registered on lease (0:
// on any lease): a claim it holds on that lease still stands.
func (a *Agent) liveOn(node string, lease int64) bool {
	if node == a.id {
		return lease == 0 || int64(a.member.Lease()) == lease
	}
	p, ok := a.member.Peer(node)
	return ok && p.Alive && p.Lease != 0 && (lease == 0 || int64(p.Lease) == lease)
}

// dispatchLoop hands the tasks of stage st that wait in this agent's
// ledger to workers with a slot for them, in the queue policy's order,
// until none is left or no worker has a slot. It sleeps on the ledger, the
// mesh's gossip and grants (a.meshChanged), and a short timer while tasks
// wait.
func (a *Agent) dispatchLoop(st jobs.Stage) {
	f := a.fed[st]
	for a.ctx.Err() == nil {
		changed, mesh := f.Changed(), a.meshChanged.Wait()
		waiting := a.dispatch(st, f)
		a.setWaiting(st, waiting > 0)
		var tick <-chan time.Time
		var t *time.Timer
		if waiting > 0 {
			t = time.NewTimer(dispatchEvery)
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
// many still wait.
func (a *Agent) dispatch(st jobs.Stage, f *jobs.Fed) (waiting int) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	tasks := f.Waiting(ctx, a.liveOn)
	if len(tasks) == 0 {
		return 0
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
	for _, c := range ordered {
		t := byID[c.ID]
		if t.NotBefore.After(now) {
			continue // backing off after a failure
		}
		to := a.assignTarget(st, t, now)
		if to == nil {
			continue // no worker has a slot for it: the next free one grants
		}
		claim, err := a.store.Assign(ctx, t, to)
		switch {
		case err == nil:
			f.Assigned(claim.Task, to.Node)
			waiting--
		case errors.Is(err, jobs.ErrTaken), cache.LeaseGone(err):
			// Claimed, adopted or gone since the ledger saw it, or the
			// worker's lease just ended: the ledger hears of it.
		default:
			a.log.Debug("handing a waiting task to a worker", zap.String("job", t.JobID), zap.String("stage", string(st)), zap.Error(err))
			return waiting
		}
	}
	return waiting
}

// assignTarget chooses the worker waiting task t goes to: pickHint's
// choice (a free slot by gossip, or a credit it granted this node), and
// for interactive work past its preemption time with none free, a worker
// that runs batch work it can stop for it (NodeMeta.Yields; the worker's
// preemption loop gives way for a claim pushed to it). nil: none.
func (a *Agent) assignTarget(st jobs.Stage, t jobs.Task, now time.Time) *jobs.Push {
	s := t.Spec
	if st == jobs.Denoise && s.Adapter != "" && !a.adapterServed(s.ModelName(), s.Adapter) {
		if ok, _ := a.takesAdapter(st, t, now); !ok {
			return nil // nobody has its adapter loaded yet; within the grace one may load it
		}
		s.Adapter = "" // nobody has it: any worker fails the job (runAdapter)
	}
	node := a.pickHint(st, s)
	if node == "" && a.cfg.Queue.PreemptAfter > 0 && t.Class == routing.Interactive && !now.Before(t.EnqueuedAt.Add(a.cfg.Queue.PreemptAfter)) {
		node = a.pickWorker(st, s, func(p gossip.Peer) int {
			if p.Meta.Yields&gossip.StageBit(string(st)) != 0 {
				return 1
			}
			return 0
		})
	}
	if node == "" {
		return nil
	}
	p, ok := a.member.Peer(node)
	if !ok || p.Lease == 0 {
		return nil
	}
	if node != a.id && p.Meta.Free.For(string(st)) == 0 {
		a.grants.Take(node, string(st), now) // against its grant: one credit spent
	}
	return &jobs.Push{Node: node, Lease: p.Lease}
}

// setWaiting records whether stage st has tasks waiting in this agent's
// ledger and gossips the change: workers of st grant their free slots to
// the dispatchers that have (grants.go).
func (a *Agent) setWaiting(st jobs.Stage, w bool) {
	bit := gossip.StageBit(string(st))
	for {
		old := a.waiting.Load()
		now := old &^ uint32(bit)
		if w {
			now |= uint32(bit)
		}
		if old == now {
			return
		}
		if a.waiting.CompareAndSwap(old, now) {
			a.publishMeta()
			return
		}
	}
}

// adoptLoop adopts the waiting tasks of dispatchers that left the mesh:
// at every departure, and every adoptEvery, for each stage this agent is
// the sweeper of (one live agent per stage, by rendezvous), it reads the
// stage's tasks and makes itself the dispatcher of those whose dispatcher
// is gone (jobs.Store.Orphans, Adopt). A sweep is one range read.
func (a *Agent) adoptLoop() {
	events, stop := a.member.Subscribe()
	defer stop()
	t := time.NewTicker(adoptEvery)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			if ev.Type != gossip.EventDeregistered && ev.Type != gossip.EventDead {
				continue
			}
		case <-t.C:
		}
		for _, st := range jobs.Stages() {
			if a.sweeper(st) {
				a.adopt(st)
			}
		}
	}
}

// sweeper reports whether this agent sweeps stage st for orphans: the
// live, registered agent whose id hashes highest with the stage's name.
func (a *Agent) sweeper(st jobs.Stage) bool {
	score := func(id string) uint64 {
		h := fnv.New64a()
		h.Write([]byte(string(st) + "/" + id))
		return h.Sum64()
	}
	mine := score(a.id)
	for _, p := range a.member.Peers() {
		if p.Alive && p.Record.ID != a.id && score(p.Record.ID) > mine {
			return false
		}
	}
	return true
}

// adopt makes this agent the dispatcher of st's orphaned waiting tasks.
func (a *Agent) adopt(st jobs.Stage) {
	ctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	orphans, err := a.store.Orphans(ctx, st, a.id, a.liveOn)
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
