package bench

import (
	"github.com/libp2p/go-libp2p/core/host"

	"github.com/latentmesh/latentmesh/transfer"
)

// newHost starts a loopback libp2p host for the benchmark's transfer
// services: their libp2p traffic is one ticket exchange per pull.
func newHost() (host.Host, error) {
	return transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil)
}
