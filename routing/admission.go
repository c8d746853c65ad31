package routing

import "math/rand/v2"

// Admission is the backpressure chain: a stage takes new work only while the
// stage after it can absorb what it will produce, so memory never fills with
// payloads waiting for a slow stage.
type Admission struct {
	// Slack is how many outputs may wait downstream beyond the downstream
	// stage's total free credits (keeps a pipeline bubble from idling it).
	Slack int
}

// DefaultAdmission allows one waiting output beyond free downstream credits.
func DefaultAdmission() Admission { return Admission{Slack: 1} }

// Admit reports whether a worker may start one more task whose output goes to
// a downstream stage with downstreamQueued tasks already waiting and
// downstreamFree free credits (summed from gossip), with inFlight tasks of
// this stage already running that will also land downstream.
func (a Admission) Admit(downstreamQueued, downstreamFree, inFlight int) bool {
	return downstreamQueued+inFlight < downstreamFree+a.Slack
}

// Target is a possible consumer for a payload.
type Target struct {
	Node     string
	Free     int  // free credits for the stage
	SameHost bool // can take the payload over shared memory
}

// PickHint chooses the preferred consumer of a new task by the power of two
// choices among workers with credit: sample two, prefer same host, then more
// free credit. It returns "" when no worker has credit (no hint: anyone may
// take the task). rng may be nil for the global source.
func PickHint(targets []Target, rng *rand.Rand) string {
	var ok []Target
	for _, t := range targets {
		if t.Free > 0 {
			ok = append(ok, t)
		}
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
