package cache

import (
	"testing"
	"time"
)

// Repair asks settled members first, then those that joined lately (a
// node back from a crash), then suspect ones; within each group the
// object's rendezvous order holds.
func TestRepairCandidatesOrder(t *testing.T) {
	s := &Store{cfg: DefaultConfig()}
	now := time.Now()
	members := []Member{
		{Node: "settled-a", Free: 1 << 20}, {Node: "settled-b", Free: 1 << 20},
		{Node: "rejoined", Free: 1 << 20}, {Node: "suspect", Free: 1 << 20, Suspect: true},
		{Node: "full", Free: 10},
	}
	var r repairs
	r.observe(members, now.Add(-time.Hour)) // the first pass: everyone settled
	r.observe(members[:2], now.Add(-time.Minute))
	joined := r.observe(members, now) // "rejoined" and the others came back just now
	if !joined["settled-a"].IsZero() || !joined["rejoined"].Equal(now) {
		t.Fatalf("joined %v", joined)
	}
	cands := s.repairCandidates(members, joined, now)("obj", 1000, map[string]bool{"settled-b": true})
	var got []string
	for _, m := range cands {
		got = append(got, m.Node)
	}
	want := []string{"settled-a", "rejoined", "suspect"} // settled-b holds it; full has no room
	if len(got) != len(want) {
		t.Fatalf("candidates %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("candidates %v, want %v", got, want)
		}
	}
}

// Repair times run from the first pass that saw an object short of copies
// to the first that saw it whole; objects deleted meanwhile are forgotten.
func TestRepairTimes(t *testing.T) {
	var r repairs
	t0 := time.Now()
	r.shortSince("a", t0)
	r.shortSince("a", t0.Add(time.Second)) // still short: the first sighting counts
	r.shortSince("b", t0)
	r.whole("a", t0.Add(3*time.Second))
	r.whole("c", t0) // never short: no sample
	r.forget(func(id string) bool { return id != "b" })
	r.whole("b", t0.Add(time.Hour))
	if q := r.quantile(0.99); q != 3*time.Second {
		t.Fatalf("p99 %v, want 3s (one sample)", q)
	}
}
