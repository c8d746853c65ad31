package routing

import (
	"math/rand/v2"
	"sync"
	"time"
)

// Credit grants: a worker whose slot frees tells the producers that feed
// its stage at once (the agent sends the grant over libp2p), sooner than
// gossip carries its free credits, so that the producer's next task is
// pushed to it instead of waiting in the queue for a claim. A grant lapses
// at its expiry, so a dead consumer's credit vanishes with it; a producer
// spends one credit of it for each task it pushes against it.

// GrantTTL is how long a grant holds: a few gossip rounds, after which
// gossip shows the worker as it is.
const GrantTTL = 2 * time.Second

// GrantFanout is how many producers a worker grants a freed slot to: the
// one whose task it just finished (affinity: it most likely has the next)
// and one other, chosen at random (the power of two choices: a second
// producer with work finds the slot too, and the two need not race, since
// each push is a claim etcd fences).
const GrantFanout = 2

// GrantTo chooses up to GrantFanout producers to grant a freed slot to
// among producers: fed (the producer of the task that just ended, if it is
// among them) and one other at random. A fed producer that pushed that
// task learns the slot is free from its own ledger (Grants.Return), so
// when pushed it is left out and only the other is chosen. rng may be nil
// for the global source.
func GrantTo(producers []string, fed string, pushed bool, rng *rand.Rand) []string {
	intn := rand.IntN
	if rng != nil {
		intn = rng.IntN
	}
	var out, others []string
	want := GrantFanout
	for _, p := range producers {
		switch {
		case p != fed:
			others = append(others, p)
		case pushed:
			want-- // it has the credit back already
		default:
			out = append(out, p)
		}
	}
	for len(out) < want && len(others) > 0 {
		i := intn(len(others))
		out = append(out, others[i])
		others[i] = others[len(others)-1]
		others = others[:len(others)-1]
	}
	return out
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
	gr.free, gr.until = min(gr.free+1, slots), now.Add(GrantTTL)
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
