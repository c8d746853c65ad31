package main

import (
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// notifySocket is a NOTIFY_SOCKET as systemd listens on it: every
// datagram an agent sends, with when it came.
type notifySocket struct {
	path string
	msgs chan notification
}

type notification struct {
	at    time.Time
	state string
}

// listenNotify opens a notify socket in a temporary directory; it closes
// with the test.
func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	s := &notifySocket{path: path, msgs: make(chan notification, 4096)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return // closed by the cleanup
			}
			select {
			case s.msgs <- notification{at: time.Now(), state: string(buf[:n])}:
			default: // a test that stopped reading: nothing to block on
			}
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return s
}

// next waits up to timeout for the first notification holding want and
// returns it, with the ones before it.
func (s *notifySocket) next(t *testing.T, want string, timeout time.Duration) (notification, []notification) {
	t.Helper()
	var before []notification
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		select {
		case n := <-s.msgs:
			if hasState(n.state, want) {
				return n, before
			}
			before = append(before, n)
		case <-deadline.C:
			t.Fatalf("no %s from the agent within %v; got %q", want, timeout, states(before))
		}
	}
}

// during returns the notifications that arrive within d.
func (s *notifySocket) during(d time.Duration) []notification {
	var got []notification
	end := time.NewTimer(d)
	defer end.Stop()
	for {
		select {
		case n := <-s.msgs:
			got = append(got, n)
		case <-end.C:
			return got
		}
	}
}

// hasState reports whether a datagram holds the assignment or prefix want
// ("READY=1", "STATUS=wedged") on one of its lines.
func hasState(state, want string) bool {
	for line := range strings.SplitSeq(state, "\n") {
		if strings.HasPrefix(line, want) {
			return true
		}
	}
	return false
}

func states(ns []notification) []string {
	out := make([]string, len(ns))
	for i, n := range ns {
		out[i] = n.state
	}
	return out
}

// The agent under systemd (Type=notify, WatchdogSec=), in this process on
// an embedded etcd: READY=1 first, once its node record is in etcd, with a
// STATUS= saying what it serves; WATCHDOG=1 while it runs; STOPPING=1 when
// it drains; exit 0. TestSystemdUnitLifecycle runs the binary through an
// etcd outage, a wedged loop and SIGTERM.
func TestAgentNotifiesSystemd(t *testing.T) {
	dir := t.TempDir()
	sock := listenNotify(t)
	t.Setenv("NOTIFY_SOCKET", sock.path)
	t.Setenv("WATCHDOG_USEC", "400000") // pings every 200 ms
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))

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

	ready, before := sock.next(t, "READY=1", 30*time.Second)
	if len(before) > 0 {
		t.Fatalf("notifications before READY=1: %q (a watchdog ping before the agent is started)", states(before))
	}
	if !hasState(ready.state, "STATUS=serving the built-in engine") {
		t.Fatalf("first notification %q, want READY=1 with the status", ready.state)
	}
	resp, err := cli.Get(context.Background(), "/latentmesh/default/nodes/notify-1")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("READY=1 before the node was registered: %v %v", resp, err)
	}
	for range 3 {
		sock.next(t, "WATCHDOG=1", 10*time.Second)
	}
	stop() // as SIGTERM does
	sock.next(t, "STOPPING=1", 30*time.Second)
	select {
	case rc := <-done:
		if rc != 0 {
			t.Fatalf("agent exited %d", rc)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("agent did not exit after its drain")
	}
}
