package transfer

import (
	"fmt"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"
)

// NewHost opens the libp2p host a Service carries its control messages on:
// TCP only, with relay, metrics, address discovery and resource accounting
// off. Payloads never travel over it (libp2p streams move 0.18-0.40x of raw
// TCP here), so the lean configuration costs nothing and keeps the
// goroutine count small. A nil key means a fresh identity.
func NewHost(listen string, key crypto.PrivKey) (host.Host, error) {
	opts := []libp2p.Option{
		libp2p.ListenAddrStrings(listen),
		libp2p.Transport(tcp.NewTCPTransport),
		libp2p.DisableRelay(),
		libp2p.DisableMetrics(),
		libp2p.DisableIdentifyAddressDiscovery(),
		libp2p.ResourceManager(&network.NullResourceManager{}),
	}
	if key != nil {
		opts = append(opts, libp2p.Identity(key))
	}
	h, err := libp2p.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("transfer: libp2p host on %s: %w", listen, err)
	}
	return h, nil
}
