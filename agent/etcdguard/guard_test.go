package etcdguard

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// startEtcd starts an empty embedded etcd on addr.
func startEtcd(t *testing.T, addr string) *etcdembed.Server {
	t.Helper()
	cfg := etcdembed.DefaultConfig()
	cfg.ClientURL = "http://" + addr
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartTimeout)
	defer cancel()
	s, err := etcdembed.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// An etcd replaced by an empty one at the same address: the first ordered
// response shows the revision went backwards, every open watch gets a
// compaction response, and a watch from a revision of the old etcd is
// answered the same way at once instead of waiting for a revision the new
// etcd may never reach.
func TestReplacedEtcdEndsWatches(t *testing.T) {
	addr := freeAddr(t)
	old := startEtcd(t, addr)
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{addr}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	g := Install(cli, zaptest.NewLogger(t))
	if Install(cli, nil) != g {
		t.Fatal("a second Install wrapped the client again")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var last int64
	for range 20 {
		resp, err := cli.Put(ctx, "k", "v")
		if err != nil {
			t.Fatal(err)
		}
		last = resp.Header.Revision
	}
	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	wch := cli.Watch(ctx, "k", clientv3.WithRev(last+1))

	old.Close()
	fresh := startEtcd(t, addr)
	defer fresh.Close()
	resets := make(chan struct{}, 1)
	g.OnReset(func() { resets <- struct{}{} })

	// A write with the old etcd's lease fails; the read after it is the
	// first ordered answer of the new etcd, with a lower revision.
	pctx, pcancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = cli.Put(pctx, "k2", "v", clientv3.WithLease(lease.ID))
	pcancel()
	if !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatalf("put with the old etcd's lease: %v, want lease not found", err)
	}
	if _, err := cli.Get(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-resets:
	case <-time.After(10 * time.Second):
		t.Fatal("no reset noticed")
	}
	if g.Resets() != 1 {
		t.Fatalf("%d resets, want 1", g.Resets())
	}
	select {
	case wr, ok := <-wch:
		if !ok || !errors.Is(wr.Err(), rpctypes.ErrCompacted) {
			t.Fatalf("open watch got %+v (open %v), want a compaction", wr, ok)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the open watch was not ended")
	}
	// A watch from the old etcd's revision is refused at once.
	select {
	case wr := <-cli.Watch(ctx, "k", clientv3.WithRev(last+1)):
		if !errors.Is(wr.Err(), rpctypes.ErrCompacted) {
			t.Fatalf("watch from the old etcd's revision got %+v", wr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a watch from the old etcd's revision waits")
	}
	// Grants and watches from the new etcd's revisions work.
	gctx, gcancel := context.WithTimeout(ctx, 10*time.Second)
	defer gcancel()
	if _, err := cli.Grant(gctx, 60); err != nil {
		t.Fatalf("grant on the new etcd: %v", err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	w := cli.Watch(ctx, "k", clientv3.WithRev(resp.Header.Revision+1))
	if _, err := cli.Put(ctx, "k", "new"); err != nil {
		t.Fatal(err)
	}
	select {
	case wr := <-w:
		if wr.Err() != nil || len(wr.Events) != 1 || string(wr.Events[0].Kv.Value) != "new" {
			t.Fatalf("watch on the new etcd: %+v", wr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no event from the new etcd")
	}
	if g.Resets() != 1 {
		t.Fatalf("%d resets after the new etcd served, want 1", g.Resets())
	}
}

// Unguarded gives a KV that reaches etcd around the guard, for a client on
// a connection and for etcd's in-process client, which has none (a KV made
// on its missing connection panics at its first call).
func TestUnguarded(t *testing.T) {
	srv := startEtcd(t, freeAddr(t))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in := srv.Client(nil)
	defer in.Close()
	Install(in, zaptest.NewLogger(t))
	kv := Unguarded(in)
	if _, ok := kv.(*guardKV); ok {
		t.Fatal("the in-process client's unguarded KV is the guard")
	}
	if _, err := kv.Txn(clientv3.WithRequireLeader(ctx)).Then(clientv3.OpGet("/x", clientv3.WithCountOnly())).Commit(); err != nil {
		t.Fatalf("in-process client: %v", err)
	}
	net, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer net.Close()
	Install(net, zaptest.NewLogger(t))
	if _, err := Unguarded(net).Get(ctx, "/x"); err != nil {
		t.Fatalf("networked client: %v", err)
	}
}
