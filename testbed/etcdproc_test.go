package testbed

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

// startEtcdProcess starts an external etcd with its default flags plus
// extra. It skips only where etcd is missing and this user could not install
// it; as root, scripts/install-deps.sh installs it, so missing is a failure.
func startEtcdProcess(t *testing.T, extra ...string) *EtcdProcess {
	t.Helper()
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("%v (run it as root)", err)
		}
		t.Fatal(err)
	}
	cfg := DefaultEtcdProcessConfig()
	cfg.Dir = t.TempDir()
	cfg.ExtraArgs = extra
	ctx, cancel := context.WithTimeout(context.Background(), cfg.StartTimeout)
	defer cancel()
	e, err := StartEtcdProcess(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	return e
}

func TestEtcdProcessDefaults(t *testing.T) {
	e := startEtcdProcess(t)
	cli, err := NewEtcdClient(e.Endpoints(), nil) // client limits far above etcd's
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("get = %v, %v", resp, err)
	}

	// etcd's default --max-request-bytes is 1.5 MiB: a value under it fits,
	// one over it is refused by etcd, and one over the gRPC limit (the
	// request limit plus 512 KiB) is refused before etcd sees it.
	if _, err := cli.Put(ctx, "big", strings.Repeat("x", 1400<<10)); err != nil {
		t.Fatalf("put 1.4 MiB: %v, want it under etcd's default limit", err)
	}
	_, err = cli.Put(ctx, "big", strings.Repeat("x", 1792<<10))
	if !errors.Is(err, rpctypes.ErrRequestTooLarge) || !strings.Contains(err.Error(), "request is too large") {
		t.Fatalf("put 1.75 MiB: %v, want %v", err, rpctypes.ErrRequestTooLarge)
	}
	_, err = cli.Put(ctx, "big", strings.Repeat("x", 2<<20))
	// (Matched as text: this module does not import grpc directly.)
	if err == nil || !strings.Contains(err.Error(), "received message larger than max") {
		t.Fatalf("put 2 MiB: %v, want etcd's gRPC limit to refuse it", err)
	}

	dir := e.DataDir()
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("data dir %s: %v", dir, err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("data dir %s after Close: %v, want it gone", dir, err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestEtcdProcessKillThenClose(t *testing.T) {
	e := startEtcdProcess(t)
	e.Kill()
	if err := e.Close(); err != nil {
		t.Fatalf("Close after Kill: %v, want nil (the kill was asked for)", err)
	}
	if _, err := os.Stat(e.DataDir()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("data dir after Close: %v, want it gone", err)
	}
}

func TestEtcdProcessStartFailureShowsOutput(t *testing.T) {
	if _, err := EtcdBinaryAvailable(); err != nil && os.Geteuid() != 0 {
		t.Skipf("%v (run it as root)", err)
	}
	cfg := DefaultEtcdProcessConfig()
	cfg.Dir = t.TempDir()
	cfg.ExtraArgs = []string{"--no-such-flag"}
	_, err := StartEtcdProcess(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "no-such-flag") {
		t.Fatalf("start with a bad flag: %v, want an error quoting etcd's output", err)
	}
	if left, _ := os.ReadDir(cfg.Dir); len(left) != 0 {
		t.Fatalf("failed start left %d entries in %s", len(left), cfg.Dir)
	}
}
