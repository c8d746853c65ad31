// Package p2ptest holds what the tests of the agents' libp2p protocols
// (progress, credit grants) share: a loopback libp2p host, its addresses
// as a node record lists them, and a message as a frame. Tests only.
package p2ptest

import (
	"bytes"
	"testing"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"

	"github.com/latentmesh/latentmesh/transfer"
)

// NewHost starts a libp2p host on loopback TCP, closed when the test ends.
func NewHost(t testing.TB) host.Host {
	t.Helper()
	h, err := libp2p.New(libp2p.ListenAddrStrings("/ip4/127.0.0.1/tcp/0"),
		libp2p.Transport(tcp.NewTCPTransport), libp2p.DisableRelay())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// Addrs are h's listen addresses as strings.
func Addrs(h host.Host) []string {
	var out []string
	for _, a := range h.Addrs() {
		out = append(out, a.String())
	}
	return out
}

// Frame is v as transfer.WriteFrame writes it.
func Frame(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := transfer.WriteFrame(&buf, v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
