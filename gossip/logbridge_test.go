package gossip

import (
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestLogLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := logLimiter{limit: 3, every: 10 * time.Second, now: func() time.Time { return now }}
	var passed, held int
	step := func(n int) {
		for range n {
			ok, h := l.allow()
			if ok {
				passed++
			}
			held += h
		}
	}
	step(5)
	if passed != 3 || held != 0 {
		t.Fatalf("first interval: %d passed, %d reported held; want 3, 0", passed, held)
	}
	now = now.Add(9 * time.Second)
	step(2)
	if passed != 3 {
		t.Fatalf("%d passed within the interval, want 3", passed)
	}
	now = now.Add(time.Second) // a new interval: the 4 held back are reported
	step(1)
	if passed != 4 || held != 4 {
		t.Fatalf("second interval: %d passed, %d reported held; want 4, 4", passed, held)
	}
	step(4)
	if n := l.take(); n != 2 {
		t.Fatalf("take = %d, want 2", n)
	}
	if n := l.take(); n != 0 {
		t.Fatalf("second take = %d, want 0", n)
	}
}

// TestLogBridgeBoundsLines floods the bridge as a stream of bad packets
// would: a bounded number of lines reach the log, lines below the log
// level do not use up the bound, and the suspicion line still marks the
// peer even when it is not written.
func TestLogBridgeBoundsLines(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := DefaultLocalConfig()
	cfg.Logger = zap.New(core)
	cfg.LogLimit, cfg.LogLimitEvery = 5, time.Hour
	// New does not touch etcd; the client is never used.
	m, err := New(cfg, &clientv3.Client{}, NodeRecord{ID: "a"})
	if err != nil {
		t.Fatal(err)
	}
	m.members["b"] = &member{alive: true}
	for i := range 100 {
		fmt.Fprintf(m.logs, "[DEBUG] memberlist: Stream connection from=10.0.0.1:%d\n", i)
	}
	for i := range 1000 {
		fmt.Fprintf(m.logs, "[ERR] memberlist: failed to receive: bad packet %d\n", i)
	}
	fmt.Fprintf(m.logs, "[INFO] memberlist: Suspect b has failed, no acks received\n")
	if p, _ := m.Peer("b"); !p.Suspect {
		t.Error("suspicion line held back and not acted on")
	}
	if n := logs.Len(); n != 5 {
		t.Errorf("%d lines written, want 5", n)
	}
	m.Close()
	held := logs.FilterMessage("memberlist log lines suppressed").All()
	if len(held) != 1 || held[0].ContextMap()["lines"] != int64(996) {
		t.Errorf("suppressed count %v, want one of 996", held)
	}
	if logs.FilterLevelExact(zapcore.ErrorLevel).Len() != 5 {
		t.Errorf("levels not kept: %v", logs.All())
	}
}

// memberlist's lines for messages it drops undecoded become one clear,
// structured line naming the sender and why; other lines pass as they are.
func TestLogBridgeNamesRefusals(t *testing.T) {
	for _, c := range []struct {
		line, reason, from string
	}{
		{"[ERR] memberlist: Decrypt packet failed: no installed keys could decrypt the message from=127.0.0.1:7946",
			"wrong gossip key: none of this node's keys decrypts it", "127.0.0.1:7946"},
		{"[ERR] memberlist: failed to receive: no installed keys could decrypt the message from=10.0.0.2:41234",
			"wrong gossip key: none of this node's keys decrypts it", "10.0.0.2:41234"},
		{"[ERR] memberlist: failed to receive: encryption is configured but remote state is not encrypted from=10.0.0.3:1",
			"not encrypted, and this node's gossip is", "10.0.0.3:1"},
		{"[ERR] memberlist: Decrypt packet failed: unsupported encryption version 4 from=10.0.0.4:1",
			"not encrypted (or corrupt), and this node's gossip is", "10.0.0.4:1"},
		{"[ERR] memberlist: failed to receive: remote state is encrypted and encryption is not configured from=10.0.0.5:1",
			"encrypted, and this node has no gossip key", "10.0.0.5:1"},
		{`[ERR] memberlist: discarding packet with unacceptable label "/other": from=10.0.0.6:1`,
			"another mesh's label (etcd prefix)", "10.0.0.6:1"},
		{"[ERR] memberlist: Failed to read remote state: EOF from=10.0.0.7:1", "", ""},
	} {
		core, logs := observer.New(zapcore.InfoLevel)
		b := &logBridge{m: &Membership{ctx: t.Context()}, log: zap.New(core),
			limit: logLimiter{limit: 10, every: time.Hour, now: time.Now}}
		fmt.Fprintln(b, c.line)
		all := logs.All()
		if len(all) != 1 {
			t.Fatalf("%q: %d lines", c.line, len(all))
		}
		e := all[0]
		if c.reason == "" {
			if e.Message == "gossip message refused" || e.Level != zapcore.ErrorLevel {
				t.Errorf("%q logged as %s %q", c.line, e.Level, e.Message)
			}
			continue
		}
		m := e.ContextMap()
		if e.Message != "gossip message refused" || e.Level != zapcore.WarnLevel || m["reason"] != c.reason || m["from"] != c.from {
			t.Errorf("%q logged as %s %q %v", c.line, e.Level, e.Message, m)
		}
	}
}
