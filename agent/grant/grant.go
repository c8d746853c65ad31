// Package grant carries credit grants between agents over libp2p: a worker
// whose slot frees tells a producer that feeds its stage how many slots it
// has free, for how long, sooner than gossip would (a gossip round or
// two), so that the producer's next task is pushed to it with its claim
// rather than left in the queue for a claim race. One frame, one way, per
// grant; nothing of it reaches etcd. A dispatcher granted a slot for work
// waiting that has none left declines it with a frame back
// (routing.Declines), so the worker grants it anew at once. What to
// grant, to whom, and what a grant is worth is routing's (routing.Grants,
// routing.GrantIdle and the rest).
package grant

import (
	"context"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// ProtocolID is the libp2p protocol of credit grants.
const ProtocolID = "/latentmesh/grant/1"

// wireVersion is the version of Msg; a reader refuses any other.
const wireVersion = 1

// Bounds of the protocol, checked before anything is allocated or acted on.
const (
	maxFrame    = 128 // a stage name, two integers and two flags
	maxStageLen = 32
	// MaxFree bounds the slots one grant may claim: more than any node's.
	MaxFree = 1024
	// MaxTTL bounds how long a grant may hold.
	MaxTTL = 10 * time.Second
	// ioTimeout bounds a grant's read or write.
	ioTimeout = 2 * time.Second
)

// Msg is one grant: the sender has Free slots of Stage free for TTLMs
// (none: a grant taken back). Waiting: granted to the receiver as a
// dispatcher with work of Stage waiting. Decline: the sender, such a
// dispatcher with none waiting, declines the receiver's grant (Free 0).
type Msg struct {
	V       int    `msgpack:"v"`
	Stage   string `msgpack:"stage"`
	Free    int    `msgpack:"free"`
	TTLMs   int    `msgpack:"ttl_ms"`
	Waiting bool   `msgpack:"waiting,omitempty"`
	Decline bool   `msgpack:"decline,omitempty"`
}

// Validate implements transfer's message check.
func (m *Msg) Validate() error {
	switch {
	case m.V != wireVersion:
		return fmt.Errorf("%w: grant version %d", transfer.ErrVersion, m.V)
	case m.Stage == "" || len(m.Stage) > maxStageLen:
		return fmt.Errorf("%w: stage of %d bytes", transfer.ErrProtocol, len(m.Stage))
	case m.Free < 0 || m.Free > MaxFree:
		return fmt.Errorf("%w: %d free slots (at most %d)", transfer.ErrProtocol, m.Free, MaxFree)
	case m.TTLMs <= 0 || time.Duration(m.TTLMs)*time.Millisecond > MaxTTL:
		return fmt.Errorf("%w: grant for %d ms (at most %v)", transfer.ErrProtocol, m.TTLMs, MaxTTL)
	case m.Decline && (m.Free != 0 || m.Waiting):
		return fmt.Errorf("%w: a decline granting %d slots", transfer.ErrProtocol, m.Free)
	}
	return nil
}

// TTL is how long the grant holds.
func (m *Msg) TTL() time.Duration { return time.Duration(m.TTLMs) * time.Millisecond }

// Serve takes grants on h from the peers allow admits (members of the
// mesh) and hands each to take, with its sender, until the returned
// function is called. A frame from anyone else is not read.
func Serve(h host.Host, allow func(peer.ID) bool, take func(from peer.ID, m Msg), log *zap.Logger) (stop func()) {
	return transfer.ServeOneFrame[Msg](h, ProtocolID, maxFrame, ioTimeout, allow, take, log.Named("grant"))
}

// New is a grant of free slots of stage for ttl.
func New(stage string, free int, ttl time.Duration) Msg {
	return Msg{V: wireVersion, Stage: stage, Free: free, TTLMs: int(ttl / time.Millisecond)}
}

// Send sends m to p. ctx bounds the exchange.
func Send(ctx context.Context, h host.Host, p peer.ID, addrs []string, m Msg) error {
	if err := m.Validate(); err != nil {
		return err
	}
	return transfer.SendOneFrame(ctx, h, p, addrs, ProtocolID, ioTimeout, "grant", &m)
}
