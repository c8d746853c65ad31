package testbed

import (
	"context"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// A delayed client's writes (puts, writing transactions) wait the delay;
// its reads, and transactions that only read, do not.
func TestDelayEtcdWrites(t *testing.T) {
	cli := embeddedClient(t)
	const d = 50 * time.Millisecond
	DelayEtcdWrites(cli, d)
	ctx := context.Background()
	timed := func(f func() error) time.Duration {
		t.Helper()
		start := time.Now()
		if err := f(); err != nil {
			t.Fatal(err)
		}
		return time.Since(start)
	}
	if took := timed(func() error { _, err := cli.Put(ctx, "k", "v"); return err }); took < d {
		t.Fatalf("a put took %v, want at least %v", took, d)
	}
	if took := timed(func() error { _, err := cli.Txn(ctx).Then(clientv3.OpPut("k", "w")).Commit(); return err }); took < d {
		t.Fatalf("a writing transaction took %v, want at least %v", took, d)
	}
	// What is not delayed, by what the wrapper decides (a read's time
	// would say nothing on a loaded machine).
	rt := cli.Txn(ctx).Then(clientv3.OpGet("k")).(*slowTxn)
	wt := cli.Txn(ctx).If(clientv3.Compare(clientv3.Version("k"), ">", 0)).Else(clientv3.OpDelete("k")).(*slowTxn)
	if rt.writes || !wt.writes {
		t.Fatalf("a reading transaction counted as writing: %v; a transaction writing in its else branch: %v", rt.writes, wt.writes)
	}
	if _, ok := cli.KV.(*slowKV); !ok {
		t.Fatal("the client's KV is not the delaying one")
	}
}

// A shut gate holds writes back unsent: one whose context ends fails and
// leaves nothing in etcd, one still waiting goes once the gate opens;
// reads pass a shut gate.
func TestGateEtcdWrites(t *testing.T) {
	cli := embeddedClient(t)
	gate := GateEtcdWrites(cli)
	ctx := context.Background()
	gate.Shut()
	tctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err := cli.Txn(tctx).Then(clientv3.OpPut("dropped", "v")).Commit()
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a write through a shut gate: %v, want the deadline", err)
	}
	if r, err := cli.Get(ctx, "dropped"); err != nil || len(r.Kvs) != 0 {
		t.Fatalf("a write that timed out at the gate reached etcd: %v %v", r, err)
	}
	went := make(chan error, 1)
	go func() { _, err := cli.Put(ctx, "held", "v"); went <- err }()
	select {
	case err := <-went:
		t.Fatalf("a put went through a shut gate: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	gate.Open()
	if err := <-went; err != nil {
		t.Fatal(err)
	}
	if r, err := cli.Get(ctx, "held"); err != nil || len(r.Kvs) != 1 {
		t.Fatalf("the held put did not land once the gate opened: %v %v", r, err)
	}
	gate.Open() // opening an open gate is harmless
	gate.Shut()
	gate.Shut()
	gate.Open()
	if _, err := cli.Put(ctx, "after", "v"); err != nil {
		t.Fatal(err)
	}
}

// embeddedClient is a client of an embedded etcd of the test's own.
func embeddedClient(t *testing.T) *clientv3.Client {
	t.Helper()
	srv, err := etcdembed.Start(context.Background(), etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	return srv.Client(nil)
}
