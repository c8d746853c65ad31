package transfer

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func hostWith(t *testing.T, cfg HostConfig) host.Host {
	t.Helper()
	h, err := NewHostWith(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// A peer the host does not admit is disconnected right after the security
// handshake: it cannot open a ticket stream, so a pull fails, and the
// refusal is logged with its peer id. An admitted peer connects.
func TestHostGaterRefusesUnadmitted(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	var mu sync.Mutex
	admitted := map[peer.ID]bool{}
	hc := DefaultHostConfig("/ip4/127.0.0.1/tcp/0", nil)
	hc.Logger = zap.New(core)
	hc.Admit = func(p peer.ID) bool {
		mu.Lock()
		defer mu.Unlock()
		return admitted[p]
	}
	ph := hostWith(t, hc)
	prod, err := New(testConfig(t), ph)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	ref, err := prod.Publish(u8Meta(64), randBytes(64, 1))
	if err != nil {
		t.Fatal(err)
	}

	outsider := startService(t, testConfig(t))
	if _, err := outsider.Pull(testCtx(t), ref); err == nil || !errors.Is(err, ErrUnreachable) {
		t.Fatalf("outsider pull: %v, want ErrUnreachable (connection refused)", err)
	}
	if n := len(ph.Network().ConnsToPeer(outsider.self)); n != 0 {
		t.Fatalf("producer keeps %d connections to the outsider", n)
	}
	var found bool
	for _, e := range logs.FilterMessage("peer refused").All() {
		found = found || e.ContextMap()["peer"] == outsider.self.String()
	}
	if !found {
		t.Fatalf("refusal of %s not logged: %v", outsider.self, logs.All())
	}

	member := startService(t, testConfig(t))
	mu.Lock()
	admitted[member.self] = true
	mu.Unlock()
	if _, err := member.Pull(testCtx(t), ref); err != nil {
		t.Fatalf("member pull: %v", err)
	}
}

// One peer cannot hold more than StreamsPerPeer inbound streams open: the
// rest are reset by the resource manager, so a peer opening thousands of
// half-written streams holds a bounded number of handlers and buffers.
func TestHostCapsStreamsPerPeer(t *testing.T) {
	const limit = 16
	hc := DefaultHostConfig("/ip4/127.0.0.1/tcp/0", nil)
	hc.StreamsPerPeer = limit
	srv := hostWith(t, hc)
	release := make(chan struct{})
	var mu sync.Mutex
	open, most := 0, 0
	srv.SetStreamHandler(ProtocolID, func(s network.Stream) {
		mu.Lock()
		open++
		most = max(most, open)
		mu.Unlock()
		<-release
		mu.Lock()
		open--
		mu.Unlock()
		s.Reset()
	})
	defer close(release)

	cli := newHost(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := cli.Connect(ctx, peer.AddrInfo{ID: srv.ID(), Addrs: srv.Addrs()}); err != nil {
		t.Fatal(err)
	}
	var failed int
	for range 4 * limit {
		s, err := cli.NewStream(ctx, srv.ID(), ProtocolID)
		if err == nil {
			_, err = s.Write([]byte{0, 0, 0, 9, 1}) // a frame header, never finished
		}
		if err != nil {
			failed++
			continue
		}
		defer s.Reset()
	}
	// Streams the server accepted reach the handler; give them time to.
	time.Sleep(200 * time.Millisecond)
	var inbound int
	srv.Network().ResourceManager().ViewPeer(cli.ID(), func(s network.PeerScope) error {
		inbound = s.Stat().NumStreamsInbound
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if most > limit || inbound > limit {
		t.Fatalf("server held %d handlers (%d inbound streams) from one peer, limit %d", most, inbound, limit)
	}
	if most == 0 {
		t.Fatal("no stream reached the handler")
	}
	t.Logf("opened %d streams: %d handlers at most, %d failed at the client", 4*limit, most, failed)
}
