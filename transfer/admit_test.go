package transfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/transfer/rdma"
)

// observed gives cfg a logger that records Warn and above, for tests that
// check a refusal was logged.
func observed(cfg *Config) *observer.ObservedLogs {
	core, logs := observer.New(zapcore.WarnLevel)
	cfg.Logger = zap.New(core)
	return logs
}

// refusedLogged fails t unless a "peer refused" line names p at what.
func refusedLogged(t *testing.T, logs *observer.ObservedLogs, what string, p peer.ID) {
	t.Helper()
	for _, e := range logs.FilterMessage("peer refused").All() {
		m := e.ContextMap()
		if m["at"] == what && m["peer"] == p.String() {
			return
		}
	}
	t.Fatalf("no refusal at %s of %s logged; got %v", what, p, logs.All())
}

// A peer the producer does not admit (in the agent: not registered in
// etcd) gets no ticket, whatever payload id it names, and the refusal is
// logged with its peer id. Before Config.Admit any libp2p peer that named
// an id got a ticket and read the payload.
func TestUnadmittedPeerGetsNoTicket(t *testing.T) {
	cfg := testConfig(t)
	logs := observed(&cfg)
	var member atomic.Value // peer.ID admitted
	cfg.Admit = func(p peer.ID) bool { return p == member.Load() }
	prod := startService(t, cfg)
	outsider := startService(t, testConfig(t))
	insider := startService(t, testConfig(t))
	member.Store(insider.self)

	data := randBytes(4096, 1)
	ref, err := prod.Publish(u8Meta(4096), data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outsider.Pull(testCtx(t), ref); !errors.Is(err, ErrDenied) {
		t.Fatalf("outsider pull: %v, want ErrDenied", err)
	}
	refusedLogged(t, logs, "ticket", outsider.self)
	if _, err := insider.Pull(testCtx(t), ref); err != nil {
		t.Fatalf("member pull: %v", err)
	}
}

// A data-plane connection is refused once its handshake proves a peer id
// the producer does not admit, even one that was admitted when it got its
// ticket: a departed member cannot keep reading.
func TestUnadmittedPeerDataPlaneRefused(t *testing.T) {
	cfg := testConfig(t)
	logs := observed(&cfg)
	var allowed atomic.Bool
	allowed.Store(true)
	cfg.Admit = func(peer.ID) bool { return allowed.Load() }
	prod := startService(t, cfg)
	cons := startService(t, testConfig(t))

	if _, err := cons.requestTicket(testCtx(t), prod.self, Ref{ID: "none", Producer: prod.producer()}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("admitted ticket request: %v, want ErrNotFound", err)
	}
	allowed.Store(false)
	_, err := cons.pool.dial(testCtx(t), "k", prod.DataAddr(), prod.self)
	if !errors.Is(err, ErrDenied) {
		t.Fatalf("data dial by a peer no longer admitted: %v, want ErrDenied", err)
	}
	refusedLogged(t, logs, "data", cons.self)
}

// The producer gives a ticket only to the consumer AuthorizePayload accepts
// for that payload, judging the proof the pull carried: an admitted peer
// without the right proof is refused, and the proof reaches the producer
// as the consumer sent it.
func TestAuthorizePayloadProof(t *testing.T) {
	cfg := testConfig(t)
	logs := observed(&cfg)
	cfg.AuthorizePayload = func(ctx context.Context, id string, p peer.ID, proof []byte) error {
		if _, ok := ctx.Deadline(); !ok {
			return errors.New("no deadline")
		}
		if string(proof) != "claim-for-"+id {
			return fmt.Errorf("proof %q does not cover %s", proof, id)
		}
		return nil
	}
	prod := startService(t, cfg)
	cons := startService(t, testConfig(t))
	data := randBytes(1<<20, 2)
	ref, err := prod.Publish(u8Meta(1<<20), data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cons.Pull(testCtx(t), ref); !errors.Is(err, ErrDenied) {
		t.Fatalf("pull without proof: %v, want ErrDenied", err)
	}
	refusedLogged(t, logs, "payload", cons.self)
	if _, err := cons.Pull(WithTicketProof(testCtx(t), []byte("claim-for-other")), ref); !errors.Is(err, ErrDenied) {
		t.Fatalf("pull with another payload's proof: %v, want ErrDenied", err)
	}
	dst := make([]byte, 1<<20)
	if err := cons.PullInto(WithTicketProof(testCtx(t), []byte("claim-for-"+ref.ID)), ref, dst); err != nil {
		t.Fatalf("pull with proof: %v", err)
	}
	// A chunked pull asks for its ticket on a watched stream: same rule.
	cp, err := cons.PullChunks(testCtx(t), ref, make([]byte, 1<<20))
	if err == nil {
		for range cp.Chunks() {
		}
		err = cp.Wait()
	}
	if !errors.Is(err, ErrDenied) {
		t.Fatalf("chunked pull without proof: %v, want ErrDenied", err)
	}
}

// One consumer cannot hold more than MaxDataConnsPerPeer authenticated data
// connections; the excess one is refused with CodeBusy (ErrBusy) and logged.
func TestDataConnsPerPeerCap(t *testing.T) {
	cfg := testConfig(t)
	logs := observed(&cfg)
	cfg.MaxDataConnsPerPeer = 2
	prod := startService(t, cfg)
	cons := startService(t, testConfig(t))
	other := startService(t, testConfig(t))
	var held []*dataConn
	for i := range 2 {
		c, err := cons.pool.dial(testCtx(t), fmt.Sprint(i), prod.DataAddr(), prod.self)
		if err != nil {
			t.Fatalf("conn %d: %v", i, err)
		}
		held = append(held, c)
	}
	_, err := cons.pool.dial(testCtx(t), "x", prod.DataAddr(), prod.self)
	var re *RemoteError
	if !errors.Is(err, ErrBusy) || !errors.As(err, &re) || re.Code != CodeBusy {
		t.Fatalf("third conn: %v, want CodeBusy", err)
	}
	refusedLogged(t, logs, "data", cons.self)
	// Another peer is not affected, and a closed connection frees its slot.
	if _, err := other.pool.dial(testCtx(t), "o", prod.DataAddr(), prod.self); err != nil {
		t.Fatalf("other peer: %v", err)
	}
	cons.pool.discard(held[0])
	eventually(t, "a freed slot", func() bool {
		c, err := cons.pool.dial(testCtx(t), "y", prod.DataAddr(), prod.self)
		if err == nil {
			cons.pool.discard(c)
		}
		return err == nil
	})
}

// The producer serves at most MaxDataConns connections in all, counting
// ones that have not finished (or even begun) their handshake: raw TCP
// connections that say nothing cannot exhaust it beyond the cap, and the
// excess is refused before any handshake work, with CodeBusy.
func TestDataConnsTotalCap(t *testing.T) {
	cfg := testConfig(t)
	logs := observed(&cfg)
	cfg.MaxDataConns = 3
	prod := startService(t, cfg)
	cons := startService(t, testConfig(t))
	for range 3 {
		nc, err := net.Dial("tcp", prod.DataAddr())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
	}
	// The three raw connections are accepted asynchronously; a dial before
	// they are counted may get through, so keep trying until one is busy.
	eventually(t, "a dial past the cap refused as busy", func() bool {
		c, err := cons.pool.dial(testCtx(t), "x", prod.DataAddr(), prod.self)
		if err == nil {
			cons.pool.discard(c)
		}
		return errors.Is(err, ErrBusy)
	})
	if len(logs.FilterMessage("peer refused").FilterField(zap.String("reason", "connection cap")).All()) == 0 {
		t.Fatal("cap refusal not logged")
	}
}

// An RDMA queue pair is connected only for an admitted peer.
func TestRDMAUnadmittedPeerNoQP(t *testing.T) {
	fab := rdma.NewFabric()
	cfg := arenaConfig(t, shmDir(t), 1<<20)
	logs := observed(&cfg)
	cfg.Transport = TransportRDMA
	cfg.openRDMA = fab.Open
	cfg.Admit = func(peer.ID) bool { return false }
	prod := startService(t, cfg)
	cons := rdmaService(t, fab, 1<<20)
	cons.h.Peerstore().AddAddrs(prod.self, prod.h.Addrs(), time.Minute)
	_, err := cons.qpTo(testCtx(t), prod.self, []byte("no ticket"))
	if err == nil {
		t.Fatal("queue pair connected for a peer the producer does not admit")
	}
	t.Logf("qpTo: %v", err)
	refusedLogged(t, logs, "rdma", cons.self)
	prod.rdma.mu.Lock()
	n := len(prod.rdma.served)
	prod.rdma.mu.Unlock()
	if n != 0 {
		t.Fatalf("producer keeps %d served queue pairs", n)
	}
}

// Refusals are logged at most refusalBurst times a second; the next line
// carries how many were not.
func TestRefusalLogRateLimited(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	now := time.Unix(1000, 0)
	r := refusalLog{log: zap.New(core), now: func() time.Time { return now }}
	for range 1000 {
		r.refuse("ticket", "p", "not admitted")
	}
	if n := logs.Len(); n != refusalBurst {
		t.Fatalf("%d lines logged in one second, want %d", n, refusalBurst)
	}
	now = now.Add(time.Second)
	r.refuse("ticket", "p", "not admitted")
	last := logs.All()[logs.Len()-1].ContextMap()
	if last["suppressed"] != int64(1000-refusalBurst) {
		t.Fatalf("suppressed = %v, want %d", last["suppressed"], 1000-refusalBurst)
	}
}
