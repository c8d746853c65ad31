package gossip

import (
	"context"
	"fmt"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// startEtcd runs a one-member etcd on loopback random ports with a temp
// data dir for the duration of the test and returns a client to it.
func startEtcd(t *testing.T) *clientv3.Client {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Name = "gossip-test"
	cfg.Dir = t.TempDir()
	curl, _ := url.Parse("http://127.0.0.1:0")
	purl, _ := url.Parse("http://127.0.0.1:0")
	cfg.ListenClientUrls = []url.URL{*curl}
	cfg.AdvertiseClientUrls = []url.URL{*curl}
	cfg.ListenPeerUrls = []url.URL{*purl}
	cfg.AdvertisePeerUrls = []url.URL{*purl}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "error"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		t.Fatalf("etcd: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("etcd not ready after 30s")
	}
	return newClient(t, "http://"+e.Clients[0].Addr().String())
}

func newClient(t *testing.T, endpoint string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{endpoint},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

var prefixSeq atomic.Int64

// testPrefix gives each test its own mesh in the shared etcd.
func testPrefix(t *testing.T) string {
	return fmt.Sprintf("/latentmesh/test-%d", prefixSeq.Add(1))
}

// startNode builds and starts a Membership on loopback with the local
// config; edit adjusts the config first. It is closed at cleanup.
func startNode(t *testing.T, cli *clientv3.Client, prefix, id string, roles []string, edit func(*Config)) *Membership {
	t.Helper()
	cfg := DefaultLocalConfig()
	cfg.Prefix = prefix
	cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)).Named(id)
	if edit != nil {
		edit(&cfg)
	}
	m, err := New(cfg, cli, NodeRecord{
		ID:        id,
		PeerID:    "12D3KooW" + id,
		DataAddr:  "127.0.0.1:9000",
		Roles:     roles,
		Host:      "testhost",
		Version:   "test",
		StartedAt: time.Now().UTC().Truncate(time.Second),
	})
	if err != nil {
		t.Fatalf("new %s: %v", id, err)
	}
	t.Cleanup(func() { m.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Start(ctx); err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	return m
}

// eventually retries cond every 20 ms until it holds or timeout passes,
// then fails with the last reason cond gave.
func eventually(t *testing.T, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not true after %v: %v", timeout, err)
		}
		<-tick.C
	}
}

// waitEvent reads ch until an event of type want about peer id arrives.
func waitEvent(t *testing.T, ch <-chan Event, want EventType, id string, timeout time.Duration) Event {
	t.Helper()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Fatalf("subscription closed waiting for %v of %s", want, id)
			}
			if ev.Type == want && ev.Peer.Record.ID == id {
				return ev
			}
		case <-timer.C:
			t.Fatalf("no %v event for %s within %v", want, id, timeout)
		}
	}
}
