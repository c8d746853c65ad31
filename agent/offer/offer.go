// Package offer carries offered claims between agents over libp2p: the
// writer of a push sends the claim key's value to its worker as the
// transaction that writes it goes, so that the worker starts the task
// before the write answers (jobs.Offer). One frame, one way, per push;
// what the worker may do with an offer before the write confirms it, and
// how it is confirmed, is agent/jobs's.
package offer

import (
	"context"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// ProtocolID is the libp2p protocol of offered claims.
const ProtocolID = "/latentmesh/offer/1"

// wireVersion is the version of Msg; a reader refuses any other.
const wireVersion = 1

// Bounds of the protocol, checked before anything is allocated or acted on.
const (
	maxStageLen = 32
	maxKeyLen   = 1024
	// maxFrame is a claim of jobs.MaxOfferBytes with its key and stage.
	maxFrame = jobs.MaxOfferBytes + maxKeyLen + 256
	// ioTimeout bounds an offer's read or write.
	ioTimeout = 2 * time.Second
)

// Msg is one offered claim: the key and value a transaction puts.
type Msg struct {
	V     int    `msgpack:"v"`
	Stage string `msgpack:"stage"`
	Key   string `msgpack:"key"`
	Value []byte `msgpack:"value"`
}

// Validate implements transfer's message check.
func (m *Msg) Validate() error {
	switch {
	case m.V != wireVersion:
		return fmt.Errorf("%w: offer version %d", transfer.ErrVersion, m.V)
	case m.Stage == "" || len(m.Stage) > maxStageLen:
		return fmt.Errorf("%w: stage of %d bytes", transfer.ErrProtocol, len(m.Stage))
	case m.Key == "" || len(m.Key) > maxKeyLen:
		return fmt.Errorf("%w: claim key of %d bytes", transfer.ErrProtocol, len(m.Key))
	case len(m.Value) == 0 || len(m.Value) > jobs.MaxOfferBytes:
		return fmt.Errorf("%w: claim of %d bytes (at most %d)", transfer.ErrProtocol, len(m.Value), jobs.MaxOfferBytes)
	}
	return nil
}

// Serve takes offers on h from the peers allow admits (members of the
// mesh) and hands each to take, with its sender, until the returned
// function is called. A frame from anyone else is not read.
func Serve(h host.Host, allow func(peer.ID) bool, take func(from peer.ID, m Msg), log *zap.Logger) (stop func()) {
	return transfer.ServeOneFrame[Msg](h, ProtocolID, maxFrame, ioTimeout, allow, take, log.Named("offer"))
}

// Send offers p the claim o. ctx bounds the exchange.
func Send(ctx context.Context, h host.Host, p peer.ID, addrs []string, o jobs.Offer) error {
	m := Msg{V: wireVersion, Stage: string(o.Stage), Key: o.Key, Value: o.Value}
	if err := m.Validate(); err != nil {
		return err
	}
	return transfer.SendOneFrame(ctx, h, p, addrs, ProtocolID, ioTimeout, "offer", &m)
}
