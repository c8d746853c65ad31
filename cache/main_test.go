package cache

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// One embedded etcd serves every test of the package, each under its own
// prefix; it starts on first use, so fuzz workers never pay for it.
var testEtcd struct {
	once sync.Once
	srv  *etcdembed.Server
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if testEtcd.srv != nil {
		testEtcd.srv.Close()
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

func etcdEndpoints(t testing.TB) []string {
	t.Helper()
	testEtcd.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		testEtcd.srv, testEtcd.err = etcdembed.Start(ctx, etcdembed.DefaultConfig())
	})
	if testEtcd.err != nil {
		t.Fatalf("embedded etcd: %v", testEtcd.err)
	}
	return testEtcd.srv.Endpoints()
}

var prefixSeq atomic.Int64

// node is one agent of a test mesh: its host, transfer service and Store.
type node struct {
	name  string
	h     host.Host
	x     *transfer.Service
	s     *Store
	spill string
}

// cluster is an in-process mesh of Stores on one etcd, with a member list
// the test controls: kill removes a node from it and closes the node.
type cluster struct {
	t      testing.TB
	cc     clusterConfig
	cli    *clientv3.Client
	prefix string
	nodes  []*node // every node ever started, in order

	mu sync.Mutex
	// mu guards live and extra.
	live  map[string]*node
	extra []Member // members listed that are no node of the cluster (a stuck peer)
}

// clusterConfig shapes a test mesh.
type clusterConfig struct {
	nodes   int
	mem     int64         // MemoryCapacity of every node
	disk    int64         // SpillCapacity of every node (0: no disk tier)
	tune    func(*Config) // adjusts every node's Config
	orphans Orphans       // passed to every Store
	arena   int64         // arena bytes; 0: 16 MiB
	xtune   func(*transfer.Config)
	client  func(*clientv3.Client) // adjusts the etcd client before any Store uses it
}

// testStoreConfig is DefaultConfig with the short periods of a test.
func testStoreConfig(t testing.TB, prefix, name string) Config {
	cfg := DefaultConfig()
	cfg.Prefix = prefix
	cfg.Node = name
	cfg.StageTimeout = 2 * time.Second
	cfg.RequestTimeout = 10 * time.Second
	cfg.MaintainEvery = 300 * time.Millisecond
	cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)).Named(name)
	return cfg
}

func newCluster(t testing.TB, cc clusterConfig) *cluster {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   etcdEndpoints(t),
		DialTimeout: 5 * time.Second,
		Logger:      zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)).Named("etcdclient"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if cc.client != nil {
		cc.client(cli)
	}
	c := &cluster{t: t, cli: cli, prefix: fmt.Sprintf("/cachetest/%d", prefixSeq.Add(1)), live: map[string]*node{}}
	t.Cleanup(c.close)
	c.cc = cc
	for i := range cc.nodes {
		n := c.newNode(fmt.Sprintf("n%d", i), "")
		c.nodes = append(c.nodes, n)
		c.mu.Lock()
		c.live[n.name] = n
		c.mu.Unlock()
	}
	for _, n := range c.nodes {
		n.s.Start()
	}
	return c
}

// newNode builds node name (not started), with its disk tier in spill
// ("" makes a new one when the cluster has disks).
func (c *cluster) newNode(name, spill string) *node {
	t, cc := c.t, c.cc
	t.Helper()
	n := &node{name: name}
	var err error
	if n.h, err = transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil); err != nil {
		t.Fatal(err)
	}
	xcfg := transfer.DefaultConfig()
	xcfg.Arena = arena.DefaultTestConfig()
	if cc.arena > 0 {
		xcfg.Arena.Size = cc.arena
	}
	xcfg.IOTimeout = 5 * time.Second
	xcfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)).Named(n.name)
	if cc.xtune != nil {
		cc.xtune(&xcfg)
	}
	if n.x, err = transfer.New(xcfg, n.h); err != nil {
		n.h.Close()
		t.Fatal(err)
	}
	cfg := testStoreConfig(t, c.prefix, n.name)
	cfg.MemoryCapacity = cc.mem
	if cc.disk > 0 {
		n.spill = spill
		if n.spill == "" {
			n.spill = t.TempDir()
		}
		cfg.SpillDir, cfg.SpillCapacity = n.spill, cc.disk
	}
	if cc.tune != nil {
		cc.tune(&cfg)
	}
	if n.s, err = New(cfg, c.cli, n.x, n.h, c.members, cc.orphans); err != nil {
		n.x.Close()
		n.h.Close()
		t.Fatal(err)
	}
	return n
}

// restart starts a node killed before under its name, on its disk tier, as
// an agent restarted after a crash (with a new peer id and addresses).
func (c *cluster) restart(name string) *node {
	c.t.Helper()
	old := c.node(name)
	c.mu.Lock()
	if c.live[name] != nil {
		c.mu.Unlock()
		c.t.Fatalf("restart %s: still alive", name)
	}
	c.mu.Unlock()
	n := c.newNode(name, old.spill)
	for i, x := range c.nodes {
		if x == old {
			c.nodes[i] = n
		}
	}
	c.mu.Lock()
	c.live[name] = n
	c.mu.Unlock()
	n.s.Start()
	return n
}

// members is the member list every Store of the cluster sees.
func (c *cluster) members() []Member {
	c.mu.Lock()
	live := make([]*node, 0, len(c.live))
	for _, n := range c.live {
		live = append(live, n)
	}
	c.mu.Unlock()
	slices.SortFunc(live, func(a, b *node) int { return cmpString(a.name, b.name) })
	c.mu.Lock()
	out := append(make([]Member, 0, len(live)+len(c.extra)), c.extra...)
	c.mu.Unlock()
	for _, n := range live {
		mem, disk := n.s.Free()
		m := Member{Node: n.name, PeerID: n.h.ID().String(), Host: n.x.HostID(), Free: mem + disk}
		for _, a := range n.h.Addrs() {
			m.P2PAddrs = append(m.P2PAddrs, a.String())
		}
		out = append(out, m)
	}
	return out
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// node returns the node named name.
func (c *cluster) node(name string) *node {
	c.t.Helper()
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	c.t.Fatalf("no node %q", name)
	return nil
}

// alive lists the live nodes, in start order.
func (c *cluster) alive() []*node {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*node
	for _, n := range c.nodes {
		if c.live[n.name] != nil {
			out = append(out, n)
		}
	}
	return out
}

// kill takes a node out of the member list, then closes it as a crash
// would look to the others: its copies and its host are gone.
func (c *cluster) kill(name string) {
	c.t.Helper()
	c.mu.Lock()
	n := c.live[name]
	delete(c.live, name)
	c.mu.Unlock()
	if n == nil {
		c.t.Fatalf("kill %s: not alive", name)
	}
	n.stop()
}

func (n *node) stop() {
	n.s.Close()
	n.x.Close()
	n.h.Close()
}

func (c *cluster) close() {
	c.mu.Lock()
	live := c.live
	c.live = map[string]*node{}
	c.mu.Unlock()
	for _, n := range c.nodes {
		if live[n.name] != nil {
			n.stop()
		}
	}
	c.cli.Close()
}

// kick runs a maintenance pass on every live node.
func (c *cluster) kick() {
	for _, n := range c.alive() {
		n.s.Kick()
	}
}

// rawRecord reads the etcd value of id, or nil when there is none.
func (c *cluster) rawRecord(ctx context.Context, id string) *clientv3.GetResponse {
	c.t.Helper()
	resp, err := c.cli.Get(ctx, ObjectKey(c.prefix, id))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp
}

// testCtx bounds a test's calls.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond with a bounded backoff until it returns nil, and
// fails the test with cond's last error once d has passed.
func eventually(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	wait := 5 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not true after %v: %v", what, d, err)
		}
		time.Sleep(wait)
		wait = min(2*wait, 100*time.Millisecond)
	}
}

// pattern returns n deterministic, non-repeating-looking bytes.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
	return b
}

// spillFiles lists the spill files in dir.
func spillFiles(t *testing.T, dir string) []string {
	t.Helper()
	if dir == "" {
		return nil
	}
	fs, err := filepath.Glob(filepath.Join(dir, "*", "*.spill")) // <dir>/<node>/
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// holderNodes lists the node names of rec's holders.
func holderNodes(rec Record) []string {
	var out []string
	for _, h := range rec.Holders {
		out = append(out, h.Node)
	}
	return out
}

// wantStats waits until node n's LocalStats satisfy ok.
func wantStats(t *testing.T, n *node, what string, ok func(LocalStats) bool) {
	t.Helper()
	eventually(t, 10*time.Second, n.name+": "+what, func() error {
		if st := n.s.LocalStats(); !ok(st) {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// notFound checks that err is ErrNotFound.
func notFound(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("%s: err = %v, want ErrNotFound", what, err)
	}
}
