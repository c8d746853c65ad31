package etcdembed

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The in-process client is the same etcd: writes, watches, leases and
// transactions as through gRPC, and the observer sees each request.
func TestInProcessClient(t *testing.T) {
	ctx, s := startServer(t)
	var mu sync.Mutex
	methods := map[string]int{}
	var txnLost int
	cli := s.Client(func(method string, req, resp any, err error) {
		mu.Lock()
		defer mu.Unlock()
		methods[method]++
		if r, ok := resp.(*pb.TxnResponse); ok && err == nil && !r.Succeeded {
			txnLost++
		}
	})
	defer cli.Close()
	remote, err := clientv3.New(clientv3.Config{Endpoints: s.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer remote.Close()

	wch := remote.Watch(ctx, "k/", clientv3.WithPrefix())
	lease, err := cli.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "k/a", "1", clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	select {
	case wr := <-wch:
		if len(wr.Events) != 1 || string(wr.Events[0].Kv.Value) != "1" || wr.Events[0].Kv.Lease != int64(lease.ID) {
			t.Fatalf("a remote watcher saw %+v", wr.Events)
		}
	case <-ctx.Done():
		t.Fatal("a remote watcher saw nothing of an in-process put")
	}
	// A transaction that loses its comparison, and one that wins.
	resp, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision("k/a"), "=", 0)).Then(clientv3.OpPut("k/a", "2")).Commit()
	if err != nil || resp.Succeeded {
		t.Fatalf("txn on an existing key: %+v %v", resp, err)
	}
	own := cli.Watch(ctx, "k/b")
	if _, err := remote.Put(ctx, "k/b", "3"); err != nil {
		t.Fatal(err)
	}
	select {
	case wr := <-own:
		if len(wr.Events) != 1 || string(wr.Events[0].Kv.Value) != "3" {
			t.Fatalf("the in-process watcher saw %+v", wr.Events)
		}
	case <-ctx.Done():
		t.Fatal("the in-process watcher saw nothing of a remote put")
	}
	if _, err := cli.Revoke(ctx, lease.ID); err != nil {
		t.Fatal(err)
	}
	if g, err := remote.Get(ctx, "k/a"); err != nil || len(g.Kvs) != 0 {
		t.Fatalf("k/a after its lease was revoked: %v %v", g, err)
	}
	if _, err := cli.AlarmList(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for m, want := range map[string]int{
		"/etcdserverpb.KV/Put": 1, "/etcdserverpb.KV/Txn": 1, "/etcdserverpb.Lease/LeaseGrant": 1,
		"/etcdserverpb.Lease/LeaseRevoke": 1, "/etcdserverpb.Maintenance/Alarm": 1,
	} {
		if methods[m] != want {
			t.Errorf("observer saw %s %d times, want %d (all: %v)", m, methods[m], want, methods)
		}
	}
	if txnLost != 1 {
		t.Errorf("observer saw %d lost transactions, want 1", txnLost)
	}
}

// BenchmarkPut compares a sequential put through the in-process client
// with one over loopback gRPC, in the same run:
//
//	go test -run '^$' -bench Put ./agent/etcdembed/
func BenchmarkPut(b *testing.B) {
	ctx := context.Background()
	s, err := Start(ctx, DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	remote, err := clientv3.New(clientv3.Config{Endpoints: s.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer remote.Close()
	inproc := s.Client(nil)
	defer inproc.Close()
	for _, c := range []struct {
		name string
		cli  *clientv3.Client
	}{{"grpc", remote}, {"inprocess", inproc}} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := c.cli.Put(ctx, "bench", "v"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A burst of watch cancellations on the in-process client (a Store
// forgetting many records at once) leaves its watch stream working: clientv3
// sends the cancellations from the loop that also reads the responses,
// which an unbuffered in-process pipe deadlocks (etcd issues 18879, 20716).
func TestInProcessWatchCancelStorm(t *testing.T) {
	ctx, s := startServer(t)
	cli := s.Client(nil)
	defer cli.Close()
	const watches = 300
	cancels := make([]context.CancelFunc, watches)
	for i := range cancels {
		wctx, wcancel := context.WithCancel(ctx)
		cancels[i] = wcancel
		wch := cli.Watch(wctx, fmt.Sprintf("storm/%d", i), clientv3.WithCreatedNotify())
		if wr := <-wch; !wr.Created {
			t.Fatalf("watch %d: %+v", i, wr)
		}
	}
	for _, c := range cancels {
		c()
	}
	// The stream still creates watches and delivers their events.
	wch := cli.Watch(ctx, "storm/after")
	if _, err := cli.Put(ctx, "storm/after", "x"); err != nil {
		t.Fatal(err)
	}
	select {
	case wr := <-wch:
		if len(wr.Events) != 1 || string(wr.Events[0].Kv.Value) != "x" {
			t.Fatalf("after the storm a watch saw %+v", wr)
		}
	case <-ctx.Done():
		t.Fatal("after a storm of cancellations a new watch saw nothing: the stream is stuck")
	}
}

// startServer starts a server for one test, closed when it ends, and
// returns it with a context that bounds the test.
func startServer(t *testing.T) (context.Context, *Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	s, err := Start(ctx, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return ctx, s
}
