package testbed

import (
	"context"
	"os"
	"testing"
	"time"
)

// startEtcdCluster starts a 3-member etcd for the test, as
// startEtcdProcess does one member.
func startEtcdCluster(t *testing.T, ip string) *EtcdCluster {
	t.Helper()
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("%v (run it as root)", err)
		}
		t.Fatal(err)
	}
	cfg := DefaultEtcdClusterConfig()
	cfg.Dir = t.TempDir()
	if ip != "" {
		cfg.IP = ip
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartTimeout)
	defer cancel()
	c, err := StartEtcdCluster(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// The cluster keeps serving with its leader killed, refuses writes without
// a majority, and a restarted member rejoins from its data directory.
func TestEtcdClusterQuorum(t *testing.T) {
	c := startEtcdCluster(t, "")
	cli, err := NewEtcdClient(c.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := context.Background()
	put := func(v string, timeout time.Duration) error {
		pctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		_, err := cli.Put(pctx, "k", v)
		return err
	}
	if err := put("1", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	leader, err := c.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c.Kill(leader)
	// The first puts may fail while the others elect a new leader; one
	// succeeds once they have.
	eventually(t, 20*time.Second, func() error { return put("2", 2*time.Second) })
	other := (leader + 1) % c.Len()
	c.Kill(other)
	if err := put("3", 2*time.Second); err == nil {
		t.Fatal("put succeeded with one of three members up")
	}
	for _, i := range []int{leader, other} {
		if err := c.Restart(i); err != nil {
			t.Fatal(err)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.WaitHealthy(wctx); err != nil {
		t.Fatal(err)
	}
	if err := put("4", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "4" {
		t.Fatalf("get after restarts: %v %v", resp, err)
	}
}
