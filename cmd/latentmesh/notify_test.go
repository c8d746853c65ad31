package main

import (
	"context"
	"io"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// The agent under systemd (Type=notify): READY=1 once its node record is
// in etcd, with a STATUS= saying what it serves; STOPPING=1 when it drains.
func TestAgentNotifiesSystemd(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)

	srv, err := etcdembed.Start(context.Background(), etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	done := make(chan int, 1)
	go func() {
		done <- runAgent(ctx, []string{
			"--etcd-endpoints", strings.Join(srv.Endpoints(), ","), "--node-id", "notify-1",
			"--state-dir", filepath.Join(dir, "state"), "--http", "127.0.0.1:0", "--admin", "127.0.0.1:0",
			"--p2p-listen", "/ip4/127.0.0.1/tcp/0", "--data-listen", "127.0.0.1:0", "--gossip-bind", "127.0.0.1:0",
			"--arena-size", "64MiB", "--lease-ttl", "2s", "--drain-timeout", "1s",
		}, io.Discard, io.Discard)
	}()

	read := func(what string) string {
		t.Helper()
		buf := make([]byte, 4096)
		_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("waiting for %s from the agent: %v", what, err)
		}
		return string(buf[:n])
	}
	ready := read("READY=1")
	if !strings.Contains(ready, "READY=1") || !strings.Contains(ready, "STATUS=serving the built-in engine") {
		t.Fatalf("first notification %q, want READY=1 with the status", ready)
	}
	resp, err := cli.Get(context.Background(), "/latentmesh/default/nodes/notify-1")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("READY=1 before the node was registered: %v %v", resp, err)
	}
	stop() // as SIGTERM does
	if stopping := read("STOPPING=1"); !strings.Contains(stopping, "STOPPING=1") {
		t.Fatalf("notification on stop %q, want STOPPING=1", stopping)
	}
	select {
	case rc := <-done:
		if rc != 0 {
			t.Fatalf("agent exited %d", rc)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("agent did not exit after its drain")
	}
}
