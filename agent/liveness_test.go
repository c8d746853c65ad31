package agent

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
)

var _ gossip.Heartbeat = (*heartbeat)(nil)

// A loop that waits is alive however long it waits; one that beats within
// the bound is alive; one out of any wait past the bound is wedged, and
// the error names it. Pull loops stopped by a drain are not watched.
func TestLivenessCheck(t *testing.T) {
	var clock atomic.Int64
	clock.Store(time.Unix(1000, 0).UnixNano())
	now := func() time.Time { return time.Unix(0, clock.Load()) }
	advance := func(d time.Duration) { clock.Add(int64(d)) }
	const stuck = 20 * time.Second
	l := newLiveness([]jobs.Stage{jobs.Encode, jobs.Denoise}, stuck, now)

	if err := l.check(true); err != nil {
		t.Fatalf("loops not started yet: %v, want alive", err)
	}
	for _, h := range []*heartbeat{l.session, l.pull[jobs.Encode], l.pull[jobs.Denoise]} {
		h.Beat()
		h.Wait()
	}
	advance(time.Hour) // an idle agent, or one riding out a long etcd outage
	if err := l.check(true); err != nil {
		t.Fatalf("every loop waiting for an hour: %v, want alive", err)
	}

	// The session's turns during an outage: each beats within the bound.
	for range 10 {
		l.session.Beat()
		advance(stuck / 2)
	}
	if err := l.check(true); err != nil {
		t.Fatalf("session beating every %v: %v, want alive", stuck/2, err)
	}
	l.session.Wait()

	l.pull[jobs.Denoise].Beat()
	advance(stuck)
	if err := l.check(true); err != nil {
		t.Fatalf("pull loop busy exactly the bound: %v, want alive", err)
	}
	advance(time.Millisecond)
	err := l.check(true)
	if err == nil || !strings.Contains(err.Error(), "pull denoise loop wedged") {
		t.Fatalf("pull loop out of a wait for %v: %v, want it named wedged", stuck+time.Millisecond, err)
	}
	if err := l.check(false); err != nil {
		t.Fatalf("pull loops stopped by a drain: %v, want them not watched", err)
	}

	l.pull[jobs.Denoise].Wait()
	l.session.Beat()
	advance(2 * stuck)
	for _, pulling := range []bool{true, false} {
		err := l.check(pulling)
		if err == nil || !strings.Contains(err.Error(), "etcd session wedged") {
			t.Fatalf("session out of a wait for %v (pulling %v): %v, want it named wedged", 2*stuck, pulling, err)
		}
	}
}

// The bound covers a turn's etcd calls: four of the longer timeout.
func TestStuckAfterDefault(t *testing.T) {
	cfg := DefaultConfig()
	if got := stuckAfter(cfg); got != 20*time.Second || got <= 2*cfg.Gossip.RequestTimeout+cfg.Gossip.RetryMax {
		t.Fatalf("stuckAfter(DefaultConfig()) = %v, want 20s, past a re-registration turn (%v)", got, 2*cfg.Gossip.RequestTimeout+cfg.Gossip.RetryMax)
	}
}
