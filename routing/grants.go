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
