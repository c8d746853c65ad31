package agent

import (
	"context"
	"math"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// What this agent tells the mesh and its operator: the gossip meta it
// publishes (credits, models, Store room), what it does when peers
// change, and its status.

// meta is this node's gossiped soft state.
func (a *Agent) meta() gossip.NodeMeta {
	var m gossip.NodeMeta
	total := 0
	for _, st := range a.cfg.Roles {
		c := a.credits[st]
		// Roles are the stages this node takes work for now (its etcd
		// record has the ones it is configured for): not while draining,
		// nor while a stage has no room for its outputs, admission holds
		// it back, or it has no engine slot. Producers hint and push only
		// to those.
		if a.takingWork(st) && a.runner.Slots(st) > 0 {
			m.Roles = append(m.Roles, string(st))
			_, free := a.slots(st)
			m.Free.Set(string(st), uint32(free))
			if free == 0 {
				m.Room.Set(string(st), uint32(a.queueCredit(st))) // busy: what a short stage still takes
			}
		}
		m.Running += uint32(c.InUse())
		total += c.Total()
		if len(a.batchOnly(st)) > 0 {
			m.Yields |= gossip.StageBit(string(st))
		}
	}
	for st, w := range a.waiting {
		if w.Load() {
			m.Waiting |= gossip.StageBit(string(st))
		}
	}
	if total > 0 {
		m.Load = float32(m.Running) / float32(total)
	}
	if st := a.xfer.Stats(); st.HasArena {
		m.FreeBufferBytes = uint64(st.Arena.Free)
	}
	m.StoreFree = uint64(a.cstore.Room())
	for model, stages := range a.runner.Models() {
		roles := make([]string, 0, len(stages))
		for _, st := range stages {
			if a.credits[st] != nil { // served by the engine and a role of this agent
				roles = append(roles, string(st))
			}
		}
		if len(roles) > 0 && len(m.Models) < gossip.MaxMetaModels {
			ms := gossip.NewModelStages(model, roles...)
			ms.DefaultSteps = uint16(min(a.runner.DefaultSteps(model), math.MaxUint16))
			m.Models = append(m.Models, ms)
		}
	}
	if a.ext != nil && len(m.Models) == 0 {
		// Serving nothing yet must not read as "the built-in model".
		m.Models = []gossip.ModelStages{{Name: "-", Stages: 0}}
	}
	slices.SortFunc(m.Models, func(x, y gossip.ModelStages) int { return strings.Compare(x.Name, y.Name) })
	return m
}

// gossipEngine republishes this node's meta whenever its engine registers
// or goes away, and wakes the workers (via Changed) to claim or stop.
//
// It publishes after taking the change channel, never before: an engine
// that registered between Start's first meta and this loop's first wait
// (an engine started with its agent registers within milliseconds) was
// never advertised, and its model never appeared until it reconnected.
func (a *Agent) gossipEngine() {
	for {
		ch := a.runner.Changed()
		if ch == nil {
			return // the built-in engine never changes
		}
		leaseChanged := a.member.LeaseChanged() // a registration may not carry the models
		a.publishMeta()
		a.publishModels()
		a.dropStaleCond()
		a.checkBatchSlots()
		select {
		case <-a.ctx.Done():
			return
		case <-ch:
		case <-leaseChanged:
		}
	}
}

// resyncHeld releases held payloads that have no record and are not being
// produced or committed by a running task: their release events were lost
// to an etcd compaction.
func (a *Agent) resyncHeld() {
	// Held and in-flight are read together (begin publishes and notes a
	// payload under the same lock), so no payload is seen held but not yet
	// in flight; a task committing meanwhile leaves a record behind.
	a.inflightMu.Lock()
	held := a.xfer.HeldIDs()
	inflight := make(map[string]bool, len(a.inflight))
	for id := range a.inflight {
		inflight[id] = true
	}
	a.inflightMu.Unlock()
	recorded, err := a.store.Recorded(a.ctx, a.id)
	if err != nil {
		a.log.Warn("resync held payloads", zap.Error(err))
		return
	}
	for _, id := range held {
		if !recorded[id] && !inflight[id] {
			a.log.Info("releasing payload whose release was compacted away", zap.String("payload", id))
			a.release(id)
		}
	}
}

// gossipStoreRoom republishes this node's meta when its Store room changes,
// so that producers waiting for room (and placement) see it: at most ten
// times a second, whatever the rate of puts.
func (a *Agent) gossipStoreRoom() {
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-a.cstore.RoomChanged():
		}
		a.publishMeta()
		a.sleep(100 * time.Millisecond)
	}
}

// forgetDeparted follows the membership's events: it drops the data-plane
// state kept for producers that left the mesh (an shm mapping of a
// departed agent's arena would otherwise keep its memory alive for good),
// has the Store repair what they held and the dispatch adopt what they
// dispatched, and wakes the dispatchers at every change.
func (a *Agent) forgetDeparted() {
	events, stop := a.member.Subscribe()
	defer stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			a.meshChanged.Fire()
			if ev.Type == gossip.EventDeregistered && ev.Peer.Record.PeerID != "" {
				a.xfer.Forget(ev.Peer.Record.PeerID)
			}
			if ev.Type == gossip.EventDeregistered || ev.Type == gossip.EventDead {
				a.cstore.Kick()   // re-replicate what it held
				a.departed.Fire() // adopt the tasks it dispatched (adoptLoop)
			}
		}
	}
}

// reportLoop refreshes queue-depth and credit gauges every two seconds.
// Each agent reports the tasks waiting in its own ledgers (dispatch.go),
// so an idle agent sends etcd nothing for them, and a sum over agents is
// the mesh's backlog.
func (a *Agent) reportLoop() {
	for {
		every := 2 * time.Second
		for st, f := range a.fed {
			a.metrics.SetQueueDepth(st, f.WaitingByClass(a.liveOn))
		}
		for st := range a.credits {
			_, free := a.slots(st)
			a.metrics.SetCredits(st, free, a.credits[st].InUse())
		}
		a.sleep(every)
		if a.ctx.Err() != nil {
			return
		}
	}
}

// slots is what stage st can run here: the agent's credits (--slots),
// bounded by the engine's declared slots (an external engine's; none while
// it is not registered). Gossip, status and metrics all show this.
func (a *Agent) slots(st jobs.Stage) (total, free int) {
	c, engine := a.credits[st], a.runner.Slots(st)
	queued := 0 // claims pushed here that wait for a slot: the next free ones are theirs
	if q := a.inboxes[st]; q != nil {
		queued = q.Waiting(a.member.Lease())
	}
	return min(c.Total(), engine), max(0, min(c.Free(), engine-c.InUse())-queued)
}

// Status is the admin view of this node and what it sees of the mesh.
type Status struct {
	Node    gossip.NodeRecord         `json:"node"`
	Credits map[jobs.Stage]CreditInfo `json:"credits"`
	Peers   []PeerStatus              `json:"peers"`
	Queues  map[jobs.Stage]QueueInfo  `json:"queues"`
	Data    DataInfo                  `json:"data_plane"`
	Store   cache.LocalStats          `json:"store"`
	// EtcdResets counts the times the etcd client saw etcd replaced (an
	// empty or restored etcd at the same address) and started over.
	EtcdResets int64 `json:"etcd_resets"`
	// Preempted counts the batch tasks this agent gave back for waiting
	// interactive work.
	Preempted int64 `json:"preempted"`
}

// DataInfo is this node's data plane: what it holds and how it pulled.
type DataInfo struct {
	Transport    string           `json:"transport"` // configured mode
	HeldPayloads int              `json:"held_payloads"`
	HeldBytes    int64            `json:"held_bytes"`
	ArenaBytes   int64            `json:"arena_bytes,omitempty"`
	ArenaFree    int64            `json:"arena_free,omitempty"`
	Pulls        map[string]int64 `json:"pulls_by_transport"`
	StorePulls   map[string]int64 `json:"store_pulls_by_transport"` // copies into and reads from the Store
	// IssuedPulls counts the pulls that used the ticket their producer
	// issued with a pushed task, asking it for none.
	IssuedPulls int64 `json:"issued_ticket_pulls"`
	// HeapFallbacks counts outputs and HeapPulls pulls that landed on the
	// heap because the arena was full (workers check for room before they
	// claim, so these stay rare); Relayed counts outputs handed on through
	// the Store.
	HeapFallbacks int64 `json:"heap_fallbacks"`
	HeapPulls     int64 `json:"heap_pulls"`
	Relayed       int64 `json:"relayed"`
}

// CreditInfo is one stage's slot ledger.
type CreditInfo struct {
	Total int `json:"total"`
	Free  int `json:"free"`
}

// PeerStatus is one peer as this node sees it.
type PeerStatus struct {
	ID      string            `json:"id"`
	Roles   []string          `json:"roles"`
	Alive   bool              `json:"alive"`
	Suspect bool              `json:"suspect,omitempty"`
	Free    map[string]uint32 `json:"free_credits"`
	Load    float32           `json:"load"`
	HTTP    string            `json:"http_addr,omitempty"`
	// Slots is each role's total credits; Models the models its engine
	// serves (empty: the built-in model); StoreFree the largest object its
	// Store can take now, all as the peer registered or gossiped them.
	Slots     map[string]int `json:"slots,omitempty"`
	Models    []string       `json:"models,omitempty"`
	StoreFree uint64         `json:"store_free"`
}

// QueueInfo is one stage's queue.
type QueueInfo struct {
	Queued  int64 `json:"queued"`
	Running int64 `json:"running"`
	// ByClass counts the stage's tasks of each priority class, queued or
	// running.
	ByClass map[routing.Class]int64 `json:"by_class"`
}

// Status reports this node, its peers and the queues.
func (a *Agent) Status(ctx context.Context) (Status, error) {
	st := Status{
		Node:    a.member.Self().Record,
		Credits: map[jobs.Stage]CreditInfo{},
		Queues:  map[jobs.Stage]QueueInfo{},
	}
	for s := range a.credits {
		total, free := a.slots(s)
		st.Credits[s] = CreditInfo{Total: total, Free: free}
	}
	for _, p := range a.member.Peers() {
		st.Peers = append(st.Peers, PeerStatus{
			ID: p.Record.ID, Roles: p.Record.Roles, Alive: p.Alive, Suspect: p.Suspect,
			Free: freeByRole(p.Meta.Free),
			Load: p.Meta.Load, HTTP: p.Record.HTTPAddr,
			Slots: p.Record.Slots, Models: modelNames(p.Meta.Models), StoreFree: p.Meta.StoreFree,
		})
	}
	for _, s := range jobs.Stages() {
		byClass, running, err := a.store.ClassDepth(ctx, s) // on demand: nobody follows a whole stage
		if err != nil {
			return Status{}, err
		}
		var total int64
		for _, n := range byClass {
			total += n
		}
		st.Queues[s] = QueueInfo{Queued: total - running, Running: running, ByClass: byClass}
	}
	xs := a.xfer.Stats()
	st.Data = DataInfo{
		Transport: a.cfg.Transfer.Transport, HeldPayloads: xs.Payloads, HeldBytes: xs.PayloadBytes,
		ArenaBytes: xs.Arena.Size, ArenaFree: xs.Arena.Free, Pulls: xs.Pulls, StorePulls: xs.StorePulls, IssuedPulls: xs.IssuedPulls,
		HeapFallbacks: xs.HeapFallbacks, HeapPulls: a.heapPulls.Load(), Relayed: a.relayed.Load(),
	}
	st.Store = a.cstore.LocalStats()
	st.EtcdResets = a.guard.Resets()
	st.Preempted = a.preempted.Load()
	return st, nil
}

// modelNames lists the names of gossiped models.
func modelNames(ms []gossip.ModelStages) []string {
	out := make([]string, 0, len(ms))
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

// freeByRole lists gossiped free credits by stage name.
func freeByRole(c gossip.StageCredits) map[string]uint32 {
	out := make(map[string]uint32, 3)
	for _, st := range jobs.Stages() {
		out[string(st)] = c.For(string(st))
	}
	return out
}

// sameHost reports whether node runs on this agent's host (and so can take
// payloads over shared memory).
func (a *Agent) sameHost(p gossip.Peer) bool {
	return p.Record.Host != "" && p.Record.Host == a.xfer.HostID()
}
