package routing

import "math/rand/v2"

// Admission is the backpressure chain: a stage takes new work only while the
// stage after it can absorb what it will produce, so memory never fills with
// payloads waiting for a slow stage.
//
// The bound holds for the whole upstream pool, not per agent: the
// downstream budget (the downstream stage's total credits, plus Slack,
// plus PerProducer for each producer) is split into per-producer quotas
// (Quota), and each upstream agent counts
// only what it put there itself (its tasks running plus the downstream
// tasks, queued or running, whose input it produced). The quotas add up to
// the budget (or one per producer, where there are more producers than
// budget), so however many producers there are, the projected downstream
// backlog stays within it; agents that decided alone on the gossiped free
// credits each saw the same room and together overshot it.
type Admission struct {
	// Slack is how many outputs may wait downstream beyond the downstream
	// stage's total credits, for the whole upstream pool (keeps a pipeline
	// bubble from idling it).
	Slack int
	// PerProducer adds this many outputs to the budget for each producer
	// (live upstream agent), so that each has room for its running task
	// and an output on its way downstream however many producers share
	// the next stage's credits. With none, 13 denoise agents before one
	// decode slot had a quota of one each: each idled while its last
	// latent waited or decoded, and the encoders while the denoise tasks
	// they fed ran, and pushes to them went back (docs/benchmarks.md,
	// "Admission per worker, checked against a real mesh").
	PerProducer int
	// Off admits everything: no backpressure (a baseline to measure it
	// against; the downstream backlog then grows with the run).
	Off bool
}

// DefaultAdmission allows one waiting output beyond downstream credits for
// the pool, and two for each producer (its running task and one output on
// its way).
func DefaultAdmission() Admission { return Admission{Slack: 1, PerProducer: 2} }

// Budget is the most outputs of a stage that may be in flight upstream or
// waiting or running downstream, with downstreamCredits the total credits
// (slots) of the live downstream agents and producers the live upstream
// agents.
func (a Admission) Budget(downstreamCredits, producers int) int {
	return max(0, downstreamCredits) + max(0, a.Slack) + max(0, a.PerProducer)*max(0, producers)
}

// Quota is producer self's share of budget among producers (the live
// upstream agents of the stage, self included): an equal split, the
// remainder going to the first producers by id, so every producer that
// reads the same membership computes quotas that add up to budget exactly.
// A producer not in the list (not yet seen by itself) gets the share of a
// last one.
//
// Every producer gets at least one while the budget is not 0: a pool of
// more producers than the budget would otherwise leave most of them idle
// for good. The backlog bound is then one per producer, max(budget,
// producers); PerProducer keeps the budget above that.
func (a Admission) Quota(budget int, producers []string, self string) int {
	n, rank := standing(producers, self)
	return split(budget, n, rank)
}

// Share is producer self's quota (Quota) of the budget (Budget) over
// downstreamCredits, the budget's per-producer part counting the
// producers Quota splits it among.
func (a Admission) Share(downstreamCredits int, producers []string, self string) int {
	n, rank := standing(producers, self)
	return split(a.Budget(downstreamCredits, n), n, rank)
}

// split is the share of budget of the producer at rank among n.
func split(budget, n, rank int) int {
	if n == 0 {
		return budget
	}
	q := budget / n
	if rank < budget%n {
		q++
	}
	if budget > 0 {
		q = max(q, 1)
	}
	return q
}

// standing is how many producers share a budget (self counted when the
// list does not hold it yet) and how many of the others come before self
// by id.
func standing(producers []string, self string) (n, rank int) {
	n = len(producers)
	found := false
	for _, p := range producers {
		switch {
		case p == self:
			found = true
		case p < self:
			rank++
		}
	}
	if !found {
		n++
	}
	return n, rank
}

// Admit reports whether a producer may start one more task, with mine its
// outputs already counted (tasks running here plus downstream tasks fed by
// it) and quota its share (Quota).
func (a Admission) Admit(mine, quota int) bool {
	return a.Off || mine < quota
}

// Target is a possible consumer for a payload.
type Target struct {
	Node     string
	Free     int  // free credits for the stage
	SameHost bool // can take the payload over shared memory
	// Granted: the free credits are a grant the worker made to the
	// producer choosing (GrantTo), not gossip's, which every producer sees
	// alike and a round or two late.
	Granted bool
	// Room is the queue credit of a worker with no free credit: tasks it
	// would start soon enough to keep (QueuePolicy.HoldFor).
	Room int
}

// PickHint chooses the preferred consumer of a new task by the power of two
// choices among workers with credit, among those that granted it when any
// did: sample two, prefer same host, then more free credit. With no free
// credit anywhere, it chooses so among the workers with queue credit
// (Room), preferring more of it. It returns "" when no worker has either
// (no hint: the task waits for a worker to grant its dispatcher a slot).
// rng may be nil for the global source.
func PickHint(targets []Target, rng *rand.Rand) string {
	var ok, granted, room []Target
	for _, t := range targets {
		switch {
		case t.Free > 0:
			ok = append(ok, t)
			if t.Granted {
				granted = append(granted, t)
			}
		case t.Room > 0:
			t.Free = t.Room // compared as free credit below
			room = append(room, t)
		}
	}
	if len(granted) > 0 {
		ok = granted
	}
	if len(ok) == 0 {
		ok = room
	}
	switch len(ok) {
	case 0:
		return ""
	case 1:
		return ok[0].Node
	}
	intn := rand.IntN
	if rng != nil {
		intn = rng.IntN
	}
	i := intn(len(ok))
	j := intn(len(ok) - 1)
	if j >= i {
		j++
	}
	a, b := ok[i], ok[j]
	if better(b, a) {
		return b.Node
	}
	return a.Node
}

func better(a, b Target) bool {
	if a.SameHost != b.SameHost {
		return a.SameHost
	}
	return a.Free > b.Free
}

// Handoff is how a stage's output reaches the next stage.
type Handoff int

// Handoffs.
const (
	// HandoffP2P: the consumer pulls from the producer, which holds the
	// payload until the consumer commits.
	HandoffP2P Handoff = iota
	// HandoffStore: the producer relays the payload through the Store and
	// frees its own buffer at once.
	HandoffStore
)

// ChooseHandoff applies a transfer mode ("p2p", "store" or "auto") to one
// output: auto relays through the Store unless a consumer with credit is
// known at publish time and the producer's arena has room for the payload
// (the RFC: relay when the consumer is not ready, so the producer's GPU is
// not held by a payload waiting for it).
func ChooseHandoff(mode string, consumerReady, producerRoom bool) Handoff {
	switch mode {
	case "p2p":
		return HandoffP2P
	case "store":
		return HandoffStore
	}
	if consumerReady && producerRoom {
		return HandoffP2P
	}
	return HandoffStore
}
