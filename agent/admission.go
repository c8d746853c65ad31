package agent

// Admission (the backpressure chain, routing.Admission): a producer starts a
// task only while its share of the next stage's budget has room, counting
// its outputs from its own ledger of the tasks its commits created
// (jobs.Fed), which follows each from before the commit that creates it.

import (
	"sync"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// setHeld records whether admission holds stage st back and gossips the
// change. Producers count each other from etcd records, not gossip, so a
// held producer's quota is unchanged; what changes is that no producer
// pushes to it, and its pushed claims go to whoever gossip shows free.
func (a *Agent) setHeld(st jobs.Stage, h bool) {
	if a.held[st].Swap(h) != h {
		a.log.Debug("admission", zap.String("stage", string(st)), zap.Bool("held", h))
		a.publishMeta()
	}
}

// fixOutput fixes the next stage's task of c's commit in out: its key
// lies under this agent's prefix (jobs.Fed), so every attempt of the
// commit writes the one key this agent's ledger watches.
func (a *Agent) fixOutput(c *jobs.Claim, out *jobs.Output) {
	if _, last := c.Task.Stage.Next(); !last {
		out.Next = a.store.NextTask(c)
	}
}

// committedOutput counts the next stage's task c's commit created among
// this agent's outputs (jobs.Fed) until it is done. After a commit with no
// answer the ledger's watch counts it if it was written.
func (a *Agent) committedOutput(c *jobs.Claim, err error) {
	down, last := c.Task.Stage.Next()
	if last || err != nil || c.Next.Key == "" {
		return
	}
	a.fed[down].Created(c.Next)
}

// fedSeen is a revision at which the stage after st held no more of this
// agent's outputs than its admission counts (jobs.Fed.Seen; 0 for the last
// stage).
func (a *Agent) fedSeen(st jobs.Stage) int64 {
	if down, _ := st.Next(); a.fed[down] != nil {
		return a.fed[down].Seen()
	}
	return 0
}

// countCommitting counts a task of st as committing until the returned
// function is first called.
func (a *Agent) countCommitting(st jobs.Stage) (uncount func()) {
	a.committing[st].Add(1)
	return sync.OnceFunc(func() { a.committing[st].Add(-1) })
}

// admit applies the backpressure chain (routing.Admission): start a task
// only while this node's share of the next stage's budget has room. The
// budget is the next stage's total credits (the slots its live agents
// register) plus the slack; this node's quota is its share among the live
// agents of this stage, and it counts against it its running tasks of st
// and the next stage's tasks, queued or running, fed by its outputs. The
// quotas of all producers add up to the budget, so the projected backlog
// downstream stays within it however many producers there are. The next
// stage's tasks fed by this agent come from its ledger: no etcd read.
func (a *Agent) admit(st jobs.Stage) (ok bool, down jobs.Stage) {
	down, last := st.Next()
	if last || a.cfg.Admission.Off {
		return true, ""
	}
	mine, quota, synced := a.admission(st, down)
	ok = a.cfg.Admission.Admit(mine, quota)
	// An agent that relays every output through the Store (store mode)
	// parks them there, not in its arena or a consumer's: the Store's room
	// bounds them (fits checks it per task), so it runs ahead of a slow or
	// absent downstream pool, which is what frees its GPU. auto keeps the
	// credit chain and relays only an output whose consumer is not ready.
	if !ok && a.cfg.TransferMode == jobs.StoreRelay {
		_, largest := a.storeRoom()
		ok = largest > 0
	}
	// Held or not, gossip says so at once: a worker whose commit just
	// filled its share must not look free to the producer whose admission
	// that same commit woke (it would push a task here to be given back),
	// and one with room must not look full (an idle mesh's pushes would
	// miss it).
	a.setHeld(st, !ok)
	// Until the ledger has read what an earlier incarnation fed (a few
	// milliseconds at start) nothing starts, but gossip is not told: a
	// stage shown held then was still shown held to the first push.
	return ok && synced, down
}

// admission is what this node counts against its quota of st's share of
// the budget of down, the stage after st, and that quota
// (routing.Admission.Share): its tasks of st in flight (running, then
// committing) and down's tasks its outputs created that are not done,
// from its ledger (synced: the ledger has read what an earlier
// incarnation fed). Counted before the ledger is read: a commit that ends
// meanwhile has added its output there (committedOutput) before it stops
// counting here.
func (a *Agent) admission(st, down jobs.Stage) (mine, quota int, synced bool) {
	inFlight := a.credits[st].InUse() + int(a.committing[st].Load())
	fed, synced := a.fed[down].Count()
	credits := 0
	var producers []string
	for _, p := range a.member.Peers() {
		if !p.Alive {
			continue
		}
		if p.Record.HasRole(string(down)) {
			n, ok := p.Record.Slots[string(down)]
			if !ok { // an agent that predates Slots: its free credits
				n = int(p.Meta.Free.For(string(down)))
			}
			credits += n
		}
		if p.Record.HasRole(string(st)) {
			producers = append(producers, p.Record.ID)
		}
	}
	return fed + inFlight, a.cfg.Admission.Share(credits, producers, a.id), synced
}
