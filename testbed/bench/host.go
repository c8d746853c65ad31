package bench

import (
	"fmt"
	"net"

	"github.com/libp2p/go-libp2p/core/host"

	"github.com/latentmesh/latentmesh/transfer"
)

// newHost starts a libp2p host on ip for a benchmark's transfer service:
// its libp2p traffic is one ticket exchange per pull.
func newHost(ip string) (host.Host, error) {
	a := net.ParseIP(ip)
	if a == nil || a.To4() == nil {
		return nil, fmt.Errorf("bench: listen ip %q is not an IPv4 address", ip)
	}
	return transfer.NewHost("/ip4/"+a.String()+"/tcp/0", nil)
}

// loopback is where the consumer of a benchmark listens: the producer runs
// on the same host.
const loopback = "127.0.0.1"
