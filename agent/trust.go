package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// Trust: only members act (docs/ARCHITECTURE.md#trust). A peer is a member
// when its libp2p peer id is in a node record registered in etcd under the
// prefix, whatever its gossip liveness. The transfer service and the libp2p
// host ask admitPeer about every connection and stream; the producer asks
// authorizePayload before each ticket.

// admitPeer reports whether p is a member. Until the membership exists
// (during New) nobody is.
//
// A peer it does not know yet gets up to newcomerWait to appear: a node
// that has just registered (or registered again, after a lost lease) claims
// and pulls at once, a few milliseconds before every member's watch of
// nodes/ has delivered its record.
func (a *Agent) admitPeer(p peer.ID) bool {
	pid := p.String()
	if a.isMemberPeer(pid) {
		return true
	}
	for deadline := time.Now().Add(newcomerWait); time.Now().Before(deadline); {
		select {
		case <-time.After(newcomerPoll):
		case <-a.ctx.Done():
			return false
		}
		if a.isMemberPeer(pid) {
			return true
		}
	}
	return false
}

// newcomerWait bounds how long admission waits for an unknown peer's node
// record to reach this agent (a watch delivers it within milliseconds);
// newcomerPoll is how often it looks meanwhile.
const (
	newcomerWait = time.Second
	newcomerPoll = 20 * time.Millisecond
)

// isMemberPeer is admitPeer for a peer id in its string form (the
// Store's IsMember).
func (a *Agent) isMemberPeer(pid string) bool {
	m := a.members.Load()
	if m == nil {
		return false
	}
	_, ok := m.ByPeerID(pid)
	return ok
}

// authorizePayload decides whether member p may have a ticket for payload
// id. A peer-to-peer stage output goes only to the node holding the claim
// on the task that reads it: p must send that claim (jobs.Claim.Proof) and
// the claim, read from etcd, must name p's node. Anything else this node
// serves (its Store copies, a stage output being relayed into the Store)
// goes to any member, since holders re-replicate and readers fetch.
func (a *Agent) authorizePayload(ctx context.Context, id string, p peer.ID, proof []byte) error {
	a.handoffsMu.Lock()
	handoff := a.handoffs[id]
	a.handoffsMu.Unlock()
	if !handoff {
		return nil
	}
	if len(proof) == 0 {
		return errors.New("stage handoff: no claim proof")
	}
	node, err := a.store.ClaimHolder(ctx, proof, id)
	if err != nil {
		return fmt.Errorf("stage handoff: %w", err)
	}
	m := a.members.Load()
	if m == nil {
		return errors.New("membership not started")
	}
	if rec, ok := m.ByPeerID(p.String()); !ok || rec.ID != node {
		return fmt.Errorf("stage handoff: the claim is %s's, not this peer's", node)
	}
	return nil
}

// markStageOutput marks payload id as a peer-to-peer stage output, which
// only its consumer's claim holder may pull (authorizePayload).
func (a *Agent) markStageOutput(id string) {
	a.handoffsMu.Lock()
	a.handoffs[id] = true
	a.handoffsMu.Unlock()
}

// release drops a payload this node published, and its handoff mark.
func (a *Agent) release(id string) {
	a.xfer.Release(id)
	a.handoffsMu.Lock()
	delete(a.handoffs, id)
	close(a.released)
	a.released = make(chan struct{})
	a.handoffsMu.Unlock()
}

// releasedSignal is closed at the next release (a drain waits on it).
func (a *Agent) releasedSignal() <-chan struct{} {
	a.handoffsMu.Lock()
	defer a.handoffsMu.Unlock()
	return a.released
}

// withClaim marks ctx so that pulls made with it show c's claim to the
// producer.
func withClaim(ctx context.Context, c *jobs.Claim) context.Context {
	// An offered claim has a proof once its write confirms it: a pull
	// that must show it (its producer issued no ticket, or one for
	// another worker) waits for that, and no other does.
	ctx = transfer.WithTicketProofFunc(ctx, func(ctx context.Context) ([]byte, error) {
		if err := c.Settle(ctx); err != nil {
			return nil, err
		}
		return c.Proof(), nil
	})
	if c.Pushed {
		// The producer made this claim and issued this worker a ticket with
		// it: the pull need not ask for one.
		for _, in := range c.Task.Inputs {
			switch ref, cached := cachedCopy(in); {
			case len(in.Ticket) == 0:
			case !in.Store:
				ctx = transfer.WithIssued(ctx, in.Payload, in.Ticket)
			case cached: // for the copy the producer holds
				ctx = transfer.WithIssued(ctx, ref.ID, in.Ticket)
			}
		}
	}
	return ctx
}

// registeredAs reports whether node is registered with libp2p peer id pid.
func (a *Agent) registeredAs(node, pid string) bool {
	p, ok := a.member.Peer(node)
	return ok && p.Registered && p.Record.PeerID != "" && p.Record.PeerID == pid
}

// checkProducer makes sure ref's producer is the node the input names, as
// registered in etcd: a forged task (etcd is writable by whoever reaches
// it) cannot make this worker pull bytes from a peer of its choosing. A
// mismatch is a lost input; the job restarts from encode.
func (a *Agent) checkProducer(in jobs.Input, ref transfer.Ref) error {
	p, ok := a.member.Peer(in.Node)
	if !ok || !p.Registered {
		return fmt.Errorf("%w: producer node %s of %s is not registered", errInputLost, in.Node, in.Payload)
	}
	if p.Record.PeerID == "" || p.Record.PeerID != ref.Producer.PeerID {
		a.log.Warn("input names a producer that is not its node's registered peer; not pulling",
			zap.String("payload", in.Payload), zap.String("node", in.Node),
			zap.String("registered_peer", p.Record.PeerID), zap.String("ref_peer", ref.Producer.PeerID))
		return fmt.Errorf("%w: %s's ref names peer %s, node %s is registered as %s",
			errInputLost, in.Payload, ref.Producer.PeerID, in.Node, p.Record.PeerID)
	}
	return nil
}
