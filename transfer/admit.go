package transfer

import (
	"context"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
)

// Admission. A Service serves only the peers its owner admits
// (Config.Admit) and gives a payload's ticket only to a peer its owner
// authorizes for that payload (Config.AuthorizePayload). transfer knows
// nothing of etcd or membership: the agent supplies both functions.

// admit reports whether peer p may use this service at all: open a control
// stream, a data-plane connection or an RDMA queue pair. The service itself
// is always admitted; a nil Config.Admit admits everyone.
func (s *Service) admit(p peer.ID) bool {
	return p == s.self || s.cfg.Admit == nil || s.cfg.Admit(p)
}

// authorizePayload asks Config.AuthorizePayload whether p may have a ticket
// for payload id, given the proof it sent. The call is bounded by IOTimeout.
func (s *Service) authorizePayload(id string, p peer.ID, proof []byte) error {
	if s.cfg.AuthorizePayload == nil || p == s.self {
		return nil
	}
	ctx, cancel := context.WithTimeout(s.life, s.cfg.IOTimeout)
	defer cancel()
	return s.cfg.AuthorizePayload(ctx, id, p, proof)
}

// ticketProofKey carries a pull's proof in its context.
type ticketProofKey struct{}

// WithTicketProof returns ctx carrying proof: every ticket request a pull
// made with it sends proof in TicketRequest.Proof, for the producer's
// Config.AuthorizePayload to judge. proof must be at most MaxProofLen bytes;
// a longer one is refused by the producer.
func WithTicketProof(ctx context.Context, proof []byte) context.Context {
	return WithTicketProofFunc(ctx, func(context.Context) ([]byte, error) { return proof, nil })
}

// WithTicketProofFunc is WithTicketProof for a proof made when a ticket
// request needs it (most pulls need none: their producer issued the
// ticket ahead): proof may wait, within the pull's ctx, and an error from
// it fails the pull.
func WithTicketProofFunc(ctx context.Context, proof func(context.Context) ([]byte, error)) context.Context {
	return context.WithValue(ctx, ticketProofKey{}, proof)
}

// ticketProof is the proof ctx carries (nil for none).
func ticketProof(ctx context.Context) ([]byte, error) {
	if f, ok := ctx.Value(ticketProofKey{}).(func(context.Context) ([]byte, error)); ok {
		return f(ctx)
	}
	return nil, nil
}

// refusalLog logs refused peers at most refusalBurst lines per second, so a
// hostile peer cannot flood the log; the first line after a quiet spell
// carries the count of refusals not logged.
type refusalLog struct {
	log *zap.Logger
	now func() time.Time

	mu sync.Mutex
	// mu guards the fields below.
	window     time.Time // start of the current one-second window
	logged     int       // lines logged in the window
	suppressed int64     // refusals not logged since the last line
}

// refusalBurst is how many refusals a second are logged.
const refusalBurst = 5

// refuse logs (rate-limited) that peer p was refused at what ("ticket",
// "data", "rdma", "payload"), and why.
func (r *refusalLog) refuse(what string, p peer.ID, why string, fields ...zap.Field) {
	r.mu.Lock()
	now := r.now()
	if now.Sub(r.window) >= time.Second {
		r.window, r.logged = now, 0
	}
	if r.logged >= refusalBurst {
		r.suppressed++
		r.mu.Unlock()
		return
	}
	r.logged++
	n := r.suppressed
	r.suppressed = 0
	r.mu.Unlock()
	fields = append(fields, zap.String("at", what), zap.Stringer("peer", p), zap.String("reason", why))
	if n > 0 {
		fields = append(fields, zap.Int64("suppressed", n))
	}
	r.log.Warn("peer refused", fields...)
}
