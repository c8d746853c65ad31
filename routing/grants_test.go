package routing

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestGrantsLapseAndSpend(t *testing.T) {
	g := NewGrants()
	now := time.Now()
	g.Grant("w1", "decode", 2, now.Add(GrantTTL))
	if n := g.Free("w1", "decode", now); n != 2 {
		t.Fatalf("free %d, want 2", n)
	}
	if n := g.Free("w1", "denoise", now); n != 0 {
		t.Fatalf("another stage's free %d, want 0", n)
	}
	if !g.Take("w1", "decode", now) || !g.Take("w1", "decode", now) {
		t.Fatal("two credits granted, a take refused")
	}
	if g.Take("w1", "decode", now) || g.Free("w1", "decode", now) != 0 {
		t.Fatal("a third take against two credits")
	}
	g.Grant("w1", "decode", 1, now.Add(GrantTTL))
	g.Grant("w1", "decode", 3, now.Add(GrantTTL)) // replaces, does not add
	if n := g.Free("w1", "decode", now); n != 3 {
		t.Fatalf("free after a second grant %d, want 3", n)
	}
	if n := g.Free("w1", "decode", now.Add(GrantTTL)); n != 0 || g.Take("w1", "decode", now.Add(GrantTTL)) {
		t.Fatalf("a lapsed grant still holds %d", n)
	}
	g.Grant("w2", "decode", 1, now.Add(GrantTTL))
	g.Grant("w2", "decode", 0, now.Add(GrantTTL)) // a grant of nothing withdraws
	if g.Free("w2", "decode", now) != 0 {
		t.Fatal("a withdrawn grant holds")
	}
}

func TestGrantToAffinityElseOneAtRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	producers := []string{"a", "b", "c", "d"}
	for range 50 {
		if to := GrantTo(producers, "c", rng); to != "c" {
			t.Fatalf("granted to %q, want c, the producer of the task that ended", to)
		}
	}
	seen := map[string]int{}
	for range 400 {
		seen[GrantTo(producers, "gone", rng)]++
	}
	for _, p := range producers {
		if seen[p] < 60 {
			t.Errorf("%s chosen %d of 400 times with no feeder among the producers", p, seen[p])
		}
	}
	if to := GrantTo(nil, "a", rng); to != "" {
		t.Errorf("no producers: %q", to)
	}
}

// A pushed task's end gives one credit back, adding to what the table
// holds, up to the worker's slots, for ReturnTTL; a lapsed entry counts
// for nothing.
func TestGrantsReturn(t *testing.T) {
	g := NewGrants()
	now := time.Now()
	g.Return("w", "decode", 2, now)
	g.Return("w", "decode", 2, now)
	g.Return("w", "decode", 2, now)
	if n := g.Free("w", "decode", now); n != 2 {
		t.Fatalf("three returns to a 2-slot worker hold %d, want 2", n)
	}
	g.Grant("w", "denoise", 1, now.Add(time.Millisecond))
	later := now.Add(time.Second)
	g.Return("w", "denoise", 4, later)
	if n := g.Free("w", "denoise", later); n != 1 {
		t.Fatalf("a return after a lapsed grant holds %d, want 1", n)
	}
	if n := g.Free("w", "denoise", later.Add(ReturnTTL-time.Millisecond)); n != 1 {
		t.Fatalf("a return holds %d just before ReturnTTL, want 1", n)
	}
	if n := g.Free("w", "denoise", later.Add(ReturnTTL)); n != 0 {
		t.Fatalf("a return still holds %d after ReturnTTL", n)
	}
}
