package gossip

import (
	"net"
	"testing"
	"time"
)

// The hostile frames themselves (memberlist's wire format written out by
// hand) are built by testbed/attack, shared with the multi-process
// hostile-input test.

// sendStream writes frame to a fresh TCP connection to addr and closes it.
func sendStream(t *testing.T, addr string, frame []byte) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write(frame); err != nil {
		t.Logf("write to %s: %v", addr, err) // the node may hang up early
	}
}

// sendPacket sends frame as one UDP datagram to addr.
func sendPacket(t *testing.T, addr string, frame []byte) {
	t.Helper()
	c, err := net.Dial("udp", addr)
	if err != nil {
		t.Fatalf("dial udp %s: %v", addr, err)
	}
	defer c.Close()
	if _, err := c.Write(frame); err != nil {
		t.Fatalf("send udp to %s: %v", addr, err)
	}
}
