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
