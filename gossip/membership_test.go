package gossip

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// checkView reports why m's view is not exactly the given ids, all
// registered and alive.
func checkView(m *Membership, ids ...string) error {
	peers := m.Peers()
	var got []string
	for _, p := range peers {
		got = append(got, p.Record.ID)
		if !p.Registered || !p.Alive {
			return fmt.Errorf("%s sees %s registered=%v alive=%v", m.Self().Record.ID, p.Record.ID, p.Registered, p.Alive)
		}
	}
	if !slices.Equal(got, ids) {
		return fmt.Errorf("%s sees %v, want %v", m.Self().Record.ID, got, ids)
	}
	return nil
}

func TestThreeNodesDiscoverAndGossipMeta(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, nil)
	b := startNode(t, cli, prefix, "b", []string{RoleDenoise}, nil)
	c := startNode(t, cli, prefix, "c", []string{RoleDenoise, RoleDecode}, nil)
	nodes := []*Membership{a, b, c}

	eventually(t, 10*time.Second, func() error {
		for _, m := range nodes {
			if err := checkView(m, "a", "b", "c"); err != nil {
				return err
			}
			for _, p := range m.Peers() {
				if !slices.Equal(p.Meta.Roles, p.Record.Roles) || p.Meta.Version != MetaVersion {
					return fmt.Errorf("%s sees %s meta %+v, record roles %v", m.Self().Record.ID, p.Record.ID, p.Meta, p.Record.Roles)
				}
			}
		}
		return nil
	})

	// The record carries the gossip port memberlist actually bound.
	p, ok := a.Peer("c")
	if !ok {
		t.Fatal("a does not know c")
	}
	if _, port, err := net.SplitHostPort(p.Record.GossipAddr); err != nil || port == "0" {
		t.Fatalf("c's gossip addr %q", p.Record.GossipAddr)
	}
	if p.Record.GossipAddr != c.Self().Record.GossipAddr || !slices.Equal(p.Record.Roles, c.Self().Record.Roles) {
		t.Fatalf("a sees c at %q, c is at %q", p.Record.GossipAddr, c.Self().Record.GossipAddr)
	}

	events, unsubscribe := b.Subscribe()
	defer unsubscribe()
	// Many quick updates coalesce; peers converge on the last one.
	for i := 1; i <= 50; i++ {
		if err := a.UpdateMeta(NodeMeta{
			Roles:   []string{RoleEncode},
			Free:    StageCredits{Encode: uint32(i)},
			Queued:  3,
			Running: 1,
			Load:    0.5,
		}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 5*time.Second, func() error {
		for _, m := range []*Membership{b, c} {
			p, _ := m.Peer("a")
			if p.Meta.Free.Encode != 50 || p.Meta.Queued != 3 || p.Meta.Load != 0.5 {
				return fmt.Errorf("%s sees a's meta %+v", m.Self().Record.ID, p.Meta)
			}
		}
		return nil
	})
	waitEvent(t, events, EventUpdated, "a", 5*time.Second)
	if got := a.Self().Meta.Free.Encode; got != 50 {
		t.Fatalf("a's own meta says %d free encode credits", got)
	}
}

func TestCloseDeregistersAtOnce(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, nil)
	b := startNode(t, cli, prefix, "b", []string{RoleDenoise}, nil)
	c := startNode(t, cli, prefix, "c", []string{RoleDecode}, nil)
	eventually(t, 10*time.Second, func() error {
		for _, m := range []*Membership{a, b, c} {
			if err := checkView(m, "a", "b", "c"); err != nil {
				return err
			}
		}
		return nil
	})
	events, unsubscribe := a.Subscribe()
	defer unsubscribe()

	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil { // idempotent
		t.Fatalf("second close: %v", err)
	}
	select {
	case <-c.Done():
	default:
		t.Fatal("Done not closed after Close")
	}
	if c.Lease() != 0 {
		t.Fatalf("lease %x after close", c.Lease())
	}
	resp, err := cli.Get(context.Background(), prefix+"/nodes/c")
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("c's record after close: %v, %v", resp, err)
	}
	waitEvent(t, events, EventDeregistered, "c", 5*time.Second)
	eventually(t, 5*time.Second, func() error {
		for _, m := range []*Membership{a, b} {
			if err := checkView(m, "a", "b"); err != nil {
				return err
			}
			if p, ok := m.Peer("c"); ok && p.Alive {
				return fmt.Errorf("%s still sees c alive in memberlist", m.Self().Record.ID)
			}
		}
		return nil
	})
}

func TestLeaseLossReregisters(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, nil)
	b := startNode(t, cli, prefix, "b", []string{RoleDenoise}, nil)
	old := a.Lease()
	if old == 0 {
		t.Fatal("no lease after Start")
	}
	changed := a.LeaseChanged()

	// Another client revokes a's lease, as an operator or a peer would.
	if _, err := cli.Revoke(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(5 * time.Second):
		t.Fatal("LeaseChanged did not fire after the lease was revoked")
	}
	eventually(t, 5*time.Second, func() error {
		if l := a.Lease(); l == 0 || l == old {
			return fmt.Errorf("lease %x (old %x)", l, old)
		}
		return nil
	})
	lease := a.Lease()
	resp, err := cli.Get(context.Background(), prefix+"/nodes/a")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("a's record: %v, %v", resp, err)
	}
	if got := clientv3.LeaseID(resp.Kvs[0].Lease); got != lease {
		t.Fatalf("record under lease %x, a holds %x", got, lease)
	}
	var rec NodeRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil || rec.GossipAddr != a.Self().Record.GossipAddr {
		t.Fatalf("record %+v, %v", rec, err)
	}
	eventually(t, 5*time.Second, func() error { return checkView(b, "a", "b") })
}

func TestDuplicateIDRefused(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	startNode(t, cli, prefix, "a", nil, nil)

	cfg := DefaultLocalConfig()
	cfg.Prefix = prefix
	dup, err := New(cfg, cli, NodeRecord{ID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	defer dup.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := dup.Start(ctx); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("Start with a live duplicate id = %v, want ErrDuplicateID", err)
	}
	if err := dup.Start(context.Background()); !errors.Is(err, ErrStarted) {
		t.Fatalf("second Start = %v, want ErrStarted", err)
	}
}

// TestDeadPeerRevoked crashes a bare memberlist peer (no leave) whose
// record lives on a lease the test keeps alive: the node must suspect it,
// declare it dead and, with RevokeDeadPeers, revoke its lease.
func TestDeadPeerRevoked(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	b := startNode(t, cli, prefix, "b", []string{RoleDenoise}, func(c *Config) { c.RevokeDeadPeers = true })
	events, unsubscribe := b.Subscribe()
	defer unsubscribe()

	mc := DefaultLocalConfig().Memberlist
	mc.Name = "ghost"
	mc.Label = prefix // gossip labels its packets with the mesh's prefix
	mc.BindAddr, mc.BindPort = "127.0.0.1", 0
	mc.LogOutput = io.Discard
	ghost, err := memberlist.Create(mc)
	if err != nil {
		t.Fatal(err)
	}
	defer ghost.Shutdown()
	ghostAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(mc.BindPort))

	ctx := context.Background()
	g, err := cli.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	kctx, kcancel := context.WithCancel(ctx)
	defer kcancel()
	ka, err := cli.KeepAlive(kctx, g.ID)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for range ka {
		}
	}()
	rec, _ := json.Marshal(NodeRecord{ID: "ghost", GossipAddr: ghostAddr})
	if _, err := cli.Put(ctx, prefix+"/nodes/ghost", string(rec), clientv3.WithLease(g.ID)); err != nil {
		t.Fatal(err)
	}
	// b joins the ghost because its record appeared.
	waitEvent(t, events, EventAlive, "ghost", 5*time.Second)

	ghost.Shutdown() // crash: no leave message
	waitEvent(t, events, EventSuspect, "ghost", 5*time.Second)
	ev := waitEvent(t, events, EventDead, "ghost", 10*time.Second)
	if ev.Peer.Alive {
		t.Fatal("dead event with Alive peer")
	}
	waitEvent(t, events, EventDeregistered, "ghost", 5*time.Second)
	ttl, err := cli.TimeToLive(ctx, g.ID)
	if err != nil || ttl.TTL != -1 {
		t.Fatalf("ghost's lease after death: %+v, %v", ttl, err)
	}
	if err := checkView(b, "b"); err != nil {
		t.Fatal(err)
	}
}

func TestLifecycle(t *testing.T) {
	cli := startEtcd(t)
	cfg := DefaultLocalConfig()
	cfg.Prefix = testPrefix(t)
	m, err := New(cfg, cli, NodeRecord{ID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	events, _ := m.Subscribe()
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := <-events; ok {
		t.Fatal("subscription open after Close")
	}
	if err := m.Start(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Start after Close = %v, want ErrClosed", err)
	}
	<-m.Done()
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestNewValidates(t *testing.T) {
	cli := startEtcd(t)
	good := NodeRecord{ID: "a", Roles: []string{RoleEncode}}
	for _, tc := range []struct {
		name string
		edit func(*Config, *NodeRecord)
		want error
	}{
		{"empty prefix", func(c *Config, _ *NodeRecord) { c.Prefix = "" }, ErrInvalidConfig},
		{"relative prefix", func(c *Config, _ *NodeRecord) { c.Prefix = "mesh" }, ErrInvalidConfig},
		{"short ttl", func(c *Config, _ *NodeRecord) { c.LeaseTTL = time.Millisecond }, ErrInvalidConfig},
		{"hostname bind", func(c *Config, _ *NodeRecord) { c.GossipBind = "localhost:0" }, ErrInvalidConfig},
		{"bad advertise", func(c *Config, _ *NodeRecord) { c.GossipAdvertise = "1.2.3.4" }, ErrInvalidConfig},
		{"nil memberlist", func(c *Config, _ *NodeRecord) { c.Memberlist = nil }, ErrInvalidConfig},
		{"foreign delegate", func(c *Config, _ *NodeRecord) { c.Memberlist.Events = &memberlist.ChannelEventDelegate{} }, ErrInvalidConfig},
		{"nil logger", func(c *Config, _ *NodeRecord) { c.Logger = nil }, ErrInvalidConfig},
		{"prefix too long for a label", func(c *Config, _ *NodeRecord) { c.Prefix = "/" + strings.Repeat("p", 255) }, ErrInvalidConfig},
		{"memberlist keyring", func(c *Config, _ *NodeRecord) { c.Memberlist.SecretKey = make([]byte, 32) }, ErrInvalidConfig},
		{"missing keyring file", func(c *Config, _ *NodeRecord) { c.KeyringFile = "/nonexistent/keyring.json" }, ErrInvalidKeyring},
		{"no log limit", func(c *Config, _ *NodeRecord) { c.LogLimit = 0 }, ErrInvalidConfig},
		{"no keyring check", func(c *Config, _ *NodeRecord) { c.KeyringCheck = 0 }, ErrInvalidConfig},
		{"no event buffer", func(c *Config, _ *NodeRecord) { c.EventBuffer = 0 }, ErrInvalidConfig},
		{"retry max below min", func(c *Config, _ *NodeRecord) { c.RetryMax = c.RetryMin / 2 }, ErrInvalidConfig},
		{"empty id", func(_ *Config, r *NodeRecord) { r.ID = "" }, ErrInvalidRecord},
		{"slash in id", func(_ *Config, r *NodeRecord) { r.ID = "a/b" }, ErrInvalidRecord},
		{"unknown role", func(_ *Config, r *NodeRecord) { r.Roles = []string{"upscale"} }, ErrInvalidRecord},
		{"repeated role", func(_ *Config, r *NodeRecord) { r.Roles = []string{RoleDecode, RoleDecode} }, ErrInvalidRecord},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, rec := DefaultLocalConfig(), good
			tc.edit(&cfg, &rec)
			if _, err := New(cfg, cli, rec); !errors.Is(err, tc.want) {
				t.Fatalf("New = %v, want %v", err, tc.want)
			}
		})
	}
	// New copies the memberlist config: later edits by the caller do not leak in.
	cfg := DefaultLocalConfig()
	m, err := New(cfg, cli, good)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	cfg.Memberlist.ProbeInterval = time.Hour
	if m.cfg.Memberlist.ProbeInterval == time.Hour {
		t.Fatal("memberlist config shared with caller")
	}
	if _, err := New(DefaultConfig(), nil, good); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("nil client: %v", err)
	}
}

// ByPeerID finds a registered node by its libp2p peer id, whether or not
// memberlist counts it alive, and forgets it once its record leaves etcd:
// the agent's admission check (who may use the data plane) rests on it.
func TestByPeerIDFollowsRegistration(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, nil)
	b := startNode(t, cli, prefix, "b", []string{RoleDecode}, nil)
	eventually(t, 10*time.Second, func() error {
		if r, ok := a.ByPeerID("12D3KooWb"); !ok || r.ID != "b" {
			return fmt.Errorf("a does not find b by peer id: %+v %v", r, ok)
		}
		return nil
	})
	if _, ok := a.ByPeerID("12D3KooWnobody"); ok {
		t.Fatal("an unregistered peer id found")
	}
	if _, ok := a.ByPeerID(""); ok {
		t.Fatal("the empty peer id found")
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() error {
		if _, ok := a.ByPeerID("12D3KooWb"); ok {
			return fmt.Errorf("b still found after it deregistered")
		}
		return nil
	})
}

// Peers is built once per change of the view: two calls with nothing
// changed in between share one list, and a meta update shows at once.
func TestPeersCachedUntilChange(t *testing.T) {
	cli := startEtcd(t)
	m := startNode(t, cli, testPrefix(t), "a", []string{RoleEncode}, nil)
	eventually(t, 10*time.Second, func() error { return checkView(m, "a") })
	a, b := m.Peers(), m.Peers()
	if len(a) == 0 || &a[0] != &b[0] {
		t.Fatalf("two calls with no change built two lists (%d peers)", len(a))
	}
	meta := m.Self().Meta
	meta.Running = 7
	if err := m.UpdateMeta(meta); err != nil {
		t.Fatal(err)
	}
	c := m.Peers()
	if &c[0] == &a[0] || c[0].Meta.Running != 7 {
		t.Fatalf("after a meta update Peers shows Running %d from the old list: %v", c[0].Meta.Running, &c[0] == &a[0])
	}
}
