package routing

import (
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// Credit grants: a worker whose slot frees grants it to one producer that
// feeds its stage (the agent sends the grant over libp2p), sooner and
// surer than gossip carries its free credits, so that the producer's next
// task is pushed to it instead of waiting in the queue for a claim, and
// no other producer's push lands on the slot. A grant lapses at its
// expiry, so a dead consumer's credit vanishes with it; a producer spends
// one credit of it for each task it pushes against it. A grant of no
// credit takes an earlier one back.

// GrantTTL is how long a grant holds: a few gossip rounds, after which
// gossip shows the worker as it is.
const GrantTTL = 2 * time.Second

// ReturnTTL is how long a credit a producer's ledger gives back holds
// (Return): long enough for the producer's next push, which is what it
// is for, and short, since the worker keeps its slot for the producer
// that long.
const ReturnTTL = 500 * time.Millisecond

// WaitingTTL is how long a slot granted to a dispatcher with work waiting
// is its: it hands a task on at once, or the slot goes to another soon.
const WaitingTTL = GrantTTL / 4

// SlotGrant is a worker's grant of its slots of one stage: To holds Free
// credits of them for TTL. Returned: To is the dispatcher whose task just
// freed the slot, whose own ledger gives the credit back when it sees the
// task gone (Grants.Return), so no message is sent. The zero SlotGrant is
// none.
type SlotGrant struct {
	To       string
	Free     int
	TTL      time.Duration
	Returned bool
	// Waiting: To was granted them as a dispatcher gossip showed with
	// work waiting; one with none by the time the grant arrives declines
	// it (Declines), and the worker grants them anew.
	Waiting bool
}

// SlotView is what a worker knows when it decides who owns its slots of
// one stage (GrantFreed, GrantIdle, GrantQueue): the agent builds it from
// its credits, its SlotBook and gossip, the simulator from its model.
type SlotView struct {
	// Free is how many slots it may grant: its free ones, while the stage
	// takes work (not draining, held back by admission or blocked).
	Free int
	// Queue is its queue credit: the tasks beyond its free slots and the
	// claims in its inbox that it would start within the hold
	// (SlotBook.Room); 0 while the stage takes no work.
	Queue int
	// Owner is the grant its free slots are promised by now
	// (SlotBook.Promised); the zero SlotGrant for none.
	Owner SlotGrant
	// Waiting are the dispatchers gossip shows with tasks of the stage
	// waiting, Producers the workers of the stage before: live members
	// other than itself.
	Waiting, Producers []string
	// Fed is the producer of the task that just ended, when it is one of
	// Waiting or Producers (the caller checks; Producers may be long);
	// "" otherwise.
	Fed string
}

// GrantFreed decides who owns the slot a task just freed (reading the
// view's Waiting, Producers and Fed only when dispatcher is ""). dispatcher is
// the task's dispatcher when its claim reached this worker through its
// inbox (pushed, or handed on), and it is another live member; "" else.
// The slot is that dispatcher's for ReturnTTL: its ledger gives it the
// credit back once it sees the task gone, with no message, and nobody
// else is granted the slot meanwhile (granted to another dispatcher too, a
// slot was handed two tasks: a 16-GPU bench serve run gave back 0.9
// denoise tasks a job). Otherwise GrantIdle decides.
func GrantFreed(v SlotView, dispatcher string, rng *rand.Rand) SlotGrant {
	if v.Free <= 0 {
		return SlotGrant{}
	}
	if dispatcher != "" {
		return SlotGrant{To: dispatcher, Free: v.Free, TTL: ReturnTTL, Returned: true}
	}
	return GrantIdle(v, rng)
}

// GrantIdle decides who owns a worker's free slots that have no owner: a
// dispatcher gossip shows with work waiting (Fed first, else one at
// random: GrantTo) is granted the free slots and the queue credit, for
// WaitingTTL, and hands tasks on at once; else one producer of the stage
// before (Fed first, else one at random) is granted them ahead of work,
// for GrantTTL, for its next push. An owner keeps the slots until its
// promise lapses, even while a dispatcher's work waits: taking slots
// granted ahead of work back for it made every idle worker of the stage
// send a grant and a revoke when one task started to wait, for 5% off the
// queueing of a simulated 1,000-GPU mesh (docs/benchmarks.md). The zero
// SlotGrant: the slots keep their owner, or there is nobody to grant them
// to.
func GrantIdle(v SlotView, rng *rand.Rand) SlotGrant {
	if v.Free <= 0 || v.Owner.To != "" {
		return SlotGrant{}
	}
	if len(v.Waiting) > 0 {
		return SlotGrant{To: GrantTo(v.Waiting, v.Fed, rng), Free: v.Free + v.Queue, TTL: WaitingTTL, Waiting: true}
	}
	to := v.Fed
	if to == "" {
		to = GrantTo(v.Producers, "", rng)
	}
	if to == "" {
		return SlotGrant{}
	}
	return SlotGrant{To: to, Free: v.Free, TTL: GrantTTL}
}

// GrantQueue decides who is granted a worker's queue credit when a task
// starts there (none without queue credit, whatever the rest of the
// view): one dispatcher gossip shows with work waiting (Fed first),
// so that while a backlog waits, the next task is in the worker's inbox
// when a slot frees, instead of being handed on only after the slot's
// grant (a 1-slot denoise of 3 ms tasks idled about a millisecond a task
// for that round trip). It promises no free slot. The grant says how
// things stand, so a dispatcher granted again holds the new figure, not
// the sum.
func GrantQueue(v SlotView, rng *rand.Rand) SlotGrant {
	if v.Queue <= 0 || len(v.Waiting) == 0 {
		return SlotGrant{}
	}
	return SlotGrant{To: GrantTo(v.Waiting, v.Fed, rng), Free: v.Queue, TTL: WaitingTTL, Waiting: true}
}

// Declines reports whether a dispatcher declines a grant it receives:
// one made to it for work waiting (SlotGrant.Waiting) when it has none
// waiting now. Gossip shows a dispatcher waiting a round or two after its
// last task went: a slot granted to it then sat idle for its promise
// (WaitingTTL) while others waited; a simulated 1:98:1 FLUX mesh handing
// every task on, with half a second's gossip, decoded 4 jobs a second of
// the 12 offered. The worker, told, grants the slot anew
// (SlotBook.Decline), leaving out the dispatcher until gossip shows it
// again.
func Declines(forWaiting, waiting bool) bool { return forWaiting && !waiting }

// GrantTo chooses the one producer a worker's free slots are granted to
// ahead of work, among producers: fed (the producer of the task that just
// ended, if it is among them: affinity, it most likely has the next),
// else one at random. One producer holds a slot's grant at a time: two
// holding it would push two tasks to one slot. rng may be nil for the
// global source; "" when there is no producer.
func GrantTo(producers []string, fed string, rng *rand.Rand) string {
	if fed != "" && slices.Contains(producers, fed) {
		return fed
	}
	if len(producers) == 0 {
		return ""
	}
	if rng != nil {
		return producers[rng.IntN(len(producers))]
	}
	return producers[rand.IntN(len(producers))]
}

// Grants is a producer's table of the credits workers granted it, by worker
// and stage. It is safe for concurrent use. Its size is bounded by the
// workers the agent admits (members) times the stages.
type Grants struct {
	mu sync.Mutex
	// mu guards m.
	m map[grantKey]grant
}

type grantKey struct{ node, stage string }

type grant struct {
	free  int
	until time.Time
}

// NewGrants returns an empty table.
func NewGrants() *Grants { return &Grants{m: map[grantKey]grant{}} }

// Grant records that node has free slots of stage until until, replacing
// what it granted before (a grant says how things stand, it does not add).
func (g *Grants) Grant(node, stage string, free int, until time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if free <= 0 {
		delete(g.m, grantKey{node, stage})
		return
	}
	g.m[grantKey{node, stage}] = grant{free: free, until: until}
}

// Return gives back one credit of node's for stage at now, up to slots
// (the node's own), for GrantTTL: a task this producer pushed to node is
// gone, so the slot it took is free. Unlike a grant it adds to what the
// table holds (the worker sends this producer no grant for that slot, see
// GrantTo), and slots bounds what a grant and a return for one slot could
// add up to.
func (g *Grants) Return(node, stage string, slots int, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := grantKey{node, stage}
	gr, ok := g.m[k]
	if !ok || !now.Before(gr.until) {
		gr = grant{}
	}
	gr.free, gr.until = min(gr.free+1, slots), now.Add(ReturnTTL)
	if gr.free <= 0 {
		delete(g.m, k)
		return
	}
	g.m[k] = gr
}

// Free is the credit node's grant for stage holds at now (0 once it lapsed).
func (g *Grants) Free(node, stage string, now time.Time) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := grantKey{node, stage}
	gr, ok := g.m[k]
	if ok && !now.Before(gr.until) {
		delete(g.m, k)
		return 0
	}
	return gr.free
}

// Any reports whether some worker's grant for stage holds credit at now.
func (g *Grants) Any(stage string, now time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for k, gr := range g.m {
		if k.stage == stage && gr.free > 0 && now.Before(gr.until) {
			return true
		}
	}
	return false
}

// Take spends one credit of node's grant for stage, reporting whether there
// was one: a producer pushing a task against it.
func (g *Grants) Take(node, stage string, now time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	k := grantKey{node, stage}
	gr, ok := g.m[k]
	if !ok || !now.Before(gr.until) {
		delete(g.m, k)
		return false
	}
	if gr.free--; gr.free == 0 {
		delete(g.m, k)
	} else {
		g.m[k] = gr
	}
	return true
}
