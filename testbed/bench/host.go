package bench

import (
	"fmt"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"
)

// newHost starts a TCP-only loopback libp2p host with everything optional
// off: the benchmark's libp2p traffic is one ticket exchange per pull.
func newHost() (host.Host, error) {
	h, err := libp2p.New(
		libp2p.ListenAddrStrings("/ip4/127.0.0.1/tcp/0"),
		libp2p.Transport(tcp.NewTCPTransport),
		libp2p.DisableRelay(),
		libp2p.DisableMetrics(),
		libp2p.DisableIdentifyAddressDiscovery(),
		libp2p.ResourceManager(&network.NullResourceManager{}),
	)
	if err != nil {
		return nil, fmt.Errorf("bench: libp2p host: %w", err)
	}
	return h, nil
}
