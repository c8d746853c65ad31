package transfer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/control"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	"github.com/libp2p/go-libp2p/core/protocol"
	rcmgr "github.com/libp2p/go-libp2p/p2p/host/resource-manager"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"
	ma "github.com/multiformats/go-multiaddr"
	"go.uber.org/zap"
)

// HostConfig configures the libp2p host NewHostWith opens. Every bound is
// explicit so that what one peer can make this host allocate does not
// depend on libp2p's defaults or the machine's memory.
type HostConfig struct {
	// Listen is the multiaddr the host listens on.
	Listen string
	// Key is the host's identity; nil means a fresh one.
	Key crypto.PrivKey
	// Admit says whether a peer may connect: an inbound connection from a
	// peer it refuses is closed right after the security handshake (where
	// the peer id is proven), before any stream exists. nil admits every
	// peer. The agent admits the peers registered in etcd; it must be cheap.
	Admit func(p peer.ID) bool
	// StreamsPerPeer bounds the inbound streams one peer holds open at
	// once, over all protocols. A consumer opens one ticket stream per
	// pull (chunked pulls keep theirs open while they run) and the Store a
	// few per request: 64 covers a busy member, while 3,000 half-written
	// streams from one peer no longer each hold a goroutine and a frame
	// buffer.
	StreamsPerPeer int
	// ConnsPerPeer bounds the connections one peer holds. libp2p needs one;
	// a few allow for simultaneous dials.
	ConnsPerPeer int
	// Conns bounds the inbound connections in all; each peer needs one, so
	// it bounds the mesh size a node serves. 1024 leaves room for a mesh of
	// hundreds of nodes.
	Conns int
	// PeerMemory bounds the memory (stream windows, buffers) libp2p
	// reserves for one peer; Memory bounds it for all.
	PeerMemory, Memory int64
	// Logger receives refused connections (rate-limited), named "p2p".
	Logger *zap.Logger
}

// DefaultHostConfig returns a HostConfig with every bound set (see each
// field for why), listening on listen with key.
func DefaultHostConfig(listen string, key crypto.PrivKey) HostConfig {
	return HostConfig{
		Listen:         listen,
		Key:            key,
		StreamsPerPeer: 64,
		ConnsPerPeer:   8,
		Conns:          1024,
		PeerMemory:     32 << 20,
		Memory:         512 << 20,
		Logger:         zap.NewNop(),
	}
}

func (c HostConfig) validate() error {
	switch {
	case c.Logger == nil:
		return errors.New("transfer: host config: Logger is nil")
	case c.Listen == "":
		return errors.New("transfer: host config: Listen is empty")
	case c.StreamsPerPeer < 1 || c.ConnsPerPeer < 1 || c.Conns < 1:
		return fmt.Errorf("transfer: host config: stream/conn bounds %d/%d/%d must be >= 1", c.StreamsPerPeer, c.ConnsPerPeer, c.Conns)
	case c.PeerMemory < 1<<20 || c.Memory < c.PeerMemory:
		return fmt.Errorf("transfer: host config: memory bounds %d/%d (want PeerMemory >= 1 MiB, Memory >= PeerMemory)", c.PeerMemory, c.Memory)
	}
	return nil
}

// limits builds the resource manager's limits: libp2p's defaults, with the
// bounds that matter against a hostile peer set explicitly.
func (c HostConfig) limits() rcmgr.ConcreteLimitConfig {
	scaling := rcmgr.DefaultLimits
	libp2p.SetDefaultServiceLimits(&scaling)
	base := scaling.Scale(c.Memory, 4*c.Conns)
	peerStreams := rcmgr.LimitVal(c.StreamsPerPeer)
	partial := rcmgr.PartialLimitConfig{
		System: rcmgr.ResourceLimits{
			Conns:           rcmgr.LimitVal(2 * c.Conns),
			ConnsInbound:    rcmgr.LimitVal(c.Conns),
			ConnsOutbound:   rcmgr.LimitVal(c.Conns),
			StreamsInbound:  rcmgr.LimitVal(16 * c.Conns),
			StreamsOutbound: rcmgr.LimitVal(16 * c.Conns),
			Streams:         rcmgr.LimitVal(32 * c.Conns),
			FD:              rcmgr.LimitVal(4 * c.Conns),
			Memory:          rcmgr.LimitVal64(c.Memory),
		},
		PeerDefault: rcmgr.ResourceLimits{
			Conns:           rcmgr.LimitVal(c.ConnsPerPeer),
			ConnsInbound:    rcmgr.LimitVal(c.ConnsPerPeer),
			ConnsOutbound:   rcmgr.LimitVal(c.ConnsPerPeer),
			StreamsInbound:  peerStreams,
			StreamsOutbound: rcmgr.LimitVal(4 * c.StreamsPerPeer),
			Streams:         rcmgr.LimitVal(5 * c.StreamsPerPeer),
			Memory:          rcmgr.LimitVal64(c.PeerMemory),
		},
		// Per-protocol-per-peer limits from SetDefaultServiceLimits would
		// otherwise apply to ours unbounded; give ours the peer bound too.
		ProtocolPeerDefault: rcmgr.ResourceLimits{
			StreamsInbound:  peerStreams,
			StreamsOutbound: rcmgr.LimitVal(4 * c.StreamsPerPeer),
			Streams:         rcmgr.LimitVal(5 * c.StreamsPerPeer),
			Memory:          rcmgr.LimitVal64(c.PeerMemory),
		},
	}
	return partial.Build(base)
}

// NewHost opens the libp2p host a Service carries its control messages on,
// with DefaultHostConfig: every peer admitted (tests, benchmarks); agents use
// NewHostWith and an Admit function.
func NewHost(listen string, key crypto.PrivKey) (host.Host, error) {
	return NewHostWith(DefaultHostConfig(listen, key))
}

// NewHostWith opens the libp2p host a Service carries its control messages
// on: TCP only, with relay, metrics and address discovery off, a resource
// manager holding cfg's bounds, and a connection gater asking cfg.Admit.
// Payloads never travel over it (libp2p streams move 0.18-0.40x of raw TCP
// here), so the lean configuration costs nothing and keeps the goroutine
// count small.
func NewHostWith(cfg HostConfig) (host.Host, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	// Without WithMetricsDisabled the manager reports every stream and
	// memory reservation to a Prometheus trace reporter that nothing here
	// reads: measured, 3.4% of a tiny job's CPU (`bench api --cpuprofile`).
	rm, err := rcmgr.NewResourceManager(rcmgr.NewFixedLimiter(cfg.limits()), rcmgr.WithMetricsDisabled())
	if err != nil {
		return nil, fmt.Errorf("transfer: resource manager: %w", err)
	}
	opts := []libp2p.Option{
		libp2p.ListenAddrStrings(cfg.Listen),
		libp2p.Transport(tcp.NewTCPTransport),
		libp2p.DisableRelay(),
		libp2p.DisableMetrics(),
		libp2p.DisableIdentifyAddressDiscovery(),
		libp2p.ResourceManager(rm),
		libp2p.ConnectionGater(&admitGater{admit: cfg.Admit, refused: refusalLog{log: cfg.Logger.Named("p2p"), now: time.Now}}),
	}
	if cfg.Key != nil {
		opts = append(opts, libp2p.Identity(cfg.Key))
	}
	h, err := libp2p.New(opts...)
	if err != nil {
		rm.Close()
		return nil, fmt.Errorf("transfer: libp2p host on %s: %w", cfg.Listen, err)
	}
	return h, nil
}

// admitGater closes inbound connections from peers admit refuses, once the
// security handshake has proven who they are. Outbound dials are not gated:
// the agent checks a producer's peer id against its registration before it
// pulls.
type admitGater struct {
	admit   func(peer.ID) bool
	refused refusalLog
}

func (*admitGater) InterceptPeerDial(peer.ID) bool                                  { return true }
func (*admitGater) InterceptAddrDial(peer.ID, ma.Multiaddr) bool                    { return true }
func (*admitGater) InterceptAccept(network.ConnMultiaddrs) bool                     { return true }
func (*admitGater) InterceptUpgraded(network.Conn) (bool, control.DisconnectReason) { return true, 0 }

func (g *admitGater) InterceptSecured(dir network.Direction, p peer.ID, addrs network.ConnMultiaddrs) bool {
	if dir != network.DirInbound || g.admit == nil || g.admit(p) {
		return true
	}
	g.refused.refuse("p2p", p, "not admitted", zap.Stringer("remote", addrs.RemoteMultiaddr()))
	return false
}

// OpenStream opens a stream of protocol proto to peer p, learning its
// addrs (libp2p multiaddrs, as node records list them; bad ones are
// skipped) for a while first. The stream is reset when ctx ends; stop
// releases that tie (call it, then close the stream, when done). The
// agents' one-frame protocols (progress, credit grants, the Store's
// requests) all start this way.
func OpenStream(ctx context.Context, h host.Host, p peer.ID, addrs []string, proto protocol.ID) (str network.Stream, stop func() bool, err error) {
	for _, a := range addrs {
		if m, err := ma.NewMultiaddr(a); err == nil {
			h.Peerstore().AddAddr(p, m, peerstore.TempAddrTTL)
		}
	}
	str, err = h.NewStream(ctx, p, proto)
	if err != nil {
		return nil, nil, err
	}
	return str, context.AfterFunc(ctx, func() { str.Reset() }), nil
}

// ServeOneFrame serves protocol proto on h for the agents' one-way
// messages (credit grants, offered claims): each stream carries one frame
// of at most max bytes, read within timeout, from a peer allow admits (a
// stream from anyone else is reset unread), decoded into an M, checked
// by its Validate, and handed to take with its sender. stop removes the
// handler.
func ServeOneFrame[M any, PM interface {
	*M
	Validate() error
}](h host.Host, proto protocol.ID, max int, timeout time.Duration, allow func(peer.ID) bool, take func(from peer.ID, m M), log *zap.Logger) (stop func()) {
	h.SetStreamHandler(proto, func(str network.Stream) {
		defer str.Close()
		remote := str.Conn().RemotePeer()
		if !allow(remote) {
			log.Debug("a frame from a non-member", zap.Stringer("peer", remote))
			str.Reset()
			return
		}
		str.SetDeadline(time.Now().Add(timeout))
		var m M
		if err := ReadFrame(str, max, PM(&m)); err != nil {
			log.Debug("bad frame", zap.Stringer("peer", remote), zap.Error(err))
			str.Reset()
			return
		}
		take(remote, m)
	})
	return func() { h.RemoveStreamHandler(proto) }
}

// SendOneFrame sends m to p (at addrs) as one frame of protocol proto,
// written within timeout; ctx bounds the exchange. what names the
// message in errors.
func SendOneFrame(ctx context.Context, h host.Host, p peer.ID, addrs []string, proto protocol.ID, timeout time.Duration, what string, m any) error {
	str, stop, err := OpenStream(ctx, h, p, addrs, proto)
	if err != nil {
		return fmt.Errorf("%w: %s to %s: %v", ErrUnreachable, what, p, err)
	}
	defer str.Close()
	defer stop()
	str.SetDeadline(time.Now().Add(timeout))
	if err := WriteFrame(str, m); err != nil {
		return fmt.Errorf("%w: %s to %s: %v", ErrUnreachable, what, p, err)
	}
	return nil
}
