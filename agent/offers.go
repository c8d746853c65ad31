package agent

import (
	"context"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/agent/offer"
)

// Offered claims (jobs.Offer, agent/offer): every push this agent writes
// (a submit's, a commit's, a dispatcher's hand-on, a hand-over) is sent to
// its worker as the transaction goes, and the worker starts the task from
// it before the write answers. Its fenced writes wait until the inbox's
// watch shows the claim as offered (jobs.Claim.Settle); a withdrawn offer
// (no such write within jobs.OfferTTL, or another one) stops the task,
// which then records nothing (execute). routing.QueuePolicy.Offer turns
// it off.

// offerTimeout bounds sending one offer: past it the worker learns of the
// claim from its inbox's watch, as without offers.
const offerTimeout = time.Second

// sendOffer sends offered claim o to its worker in the background, or
// puts it in this agent's own inbox (jobs.Config.Offer).
func (a *Agent) sendOffer(o jobs.Offer) {
	if o.Node == a.id {
		a.takeOwnOffer(o)
		return
	}
	p, ok := a.member.Peer(o.Node)
	if !ok {
		return
	}
	pid, err := peer.Decode(p.Record.PeerID)
	if err != nil {
		return
	}
	a.wg.Go(func() {
		ctx, cancel := context.WithTimeout(a.ctx, offerTimeout)
		defer cancel()
		if err := offer.Send(ctx, a.host, pid, p.Record.P2PAddrs, o); err != nil {
			a.log.Debug("claim offer not sent", zap.String("to", o.Node), zap.Error(err))
		}
	})
}

// takeOffer takes a claim another member offers this agent.
func (a *Agent) takeOffer(from peer.ID, m offer.Msg) {
	a.takeOwnOffer(jobs.Offer{Stage: jobs.Stage(m.Stage), Node: a.id, Key: m.Key, Value: m.Value})
}

// takeOwnOffer puts offered claim o in the inbox of its stage, which
// checks it.
func (a *Agent) takeOwnOffer(o jobs.Offer) {
	q := a.inboxes[o.Stage]
	if q == nil {
		return // not a stage of this agent's roles
	}
	if err := q.Offered(o.Key, o.Value); err != nil {
		a.log.Debug("claim offer refused", zap.String("stage", string(o.Stage)), zap.Error(err))
	}
}
