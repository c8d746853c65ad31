package testbed

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// A delayed client's writes (puts, writing transactions) wait the delay;
// its reads, and transactions that only read, do not.
func TestDelayEtcdWrites(t *testing.T) {
	srv, err := etcdembed.Start(context.Background(), etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cli := srv.Client(nil)
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
