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

// Who owns a worker's free slots: the dispatcher whose task freed it, by
// its own ledger; else a dispatcher with work waiting, with the queue
// credit, briefly; else one producer ahead of work. An owner keeps them
// until its promise lapses.
func TestGrantDecisions(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	idle := SlotView{Free: 1, Queue: 2, Producers: []string{"enc-0", "enc-1"}, Fed: "enc-1"}

	if g, want := GrantFreed(idle, "enc-0", rng), (SlotGrant{To: "enc-0", Free: 1, TTL: ReturnTTL, Returned: true}); g != want {
		t.Fatalf("a pushed task's end: %+v; want %+v", g, want)
	}
	if g, want := GrantFreed(idle, "", rng), (SlotGrant{To: "enc-1", Free: 1, TTL: GrantTTL}); g != want {
		t.Fatalf("a claimed task's end, nobody waiting: %+v; want %+v (its producer, ahead of work)", g, want)
	}
	if g := GrantFreed(SlotView{Producers: idle.Producers}, "enc-0", rng); g.To != "" {
		t.Fatalf("no slot to grant (held back by admission), yet granted %+v", g)
	}
	seen := map[string]int{}
	anyone := idle
	anyone.Fed = ""
	for range 200 {
		seen[GrantIdle(anyone, rng).To]++
	}
	if seen["enc-0"] < 60 || seen["enc-1"] < 60 {
		t.Fatalf("no feeder: producers granted %v times of 200, want each about half", seen)
	}

	waiting := idle
	waiting.Waiting = []string{"enc-0", "api-3"}
	waiting.Fed = "" // the producer is not waiting
	if g := GrantIdle(waiting, rng); g.To == "" || g.Free != 3 || g.TTL != WaitingTTL || g.Returned {
		t.Fatalf("work waiting: %+v; want a waiting dispatcher granted the slot and the queue credit for WaitingTTL", g)
	}
	waiting.Fed = "api-3"
	if g := GrantIdle(waiting, rng); g.To != "api-3" {
		t.Fatalf("work waiting at the fed dispatcher: granted %q", g.To)
	}
	for _, owner := range []SlotGrant{
		{To: "enc-1", Free: 1, TTL: GrantTTL},                  // a producer's, ahead of work
		{To: "enc-0", Free: 1, TTL: WaitingTTL},                // a waiting dispatcher's
		{To: "enc-0", Free: 1, TTL: ReturnTTL, Returned: true}, // its ledger returns it
	} {
		held := waiting
		held.Owner = owner
		if g := GrantIdle(held, rng); g.To != "" {
			t.Fatalf("owner %+v: granted %+v; want it kept", owner, g)
		}
	}

	// Queue credit goes to a dispatcher with work waiting, and only then.
	if g := GrantQueue(idle, rng); g.To != "" {
		t.Fatalf("nobody waiting: queue credit granted to %q", g.To)
	}
	if g := GrantQueue(waiting, rng); g.To != "api-3" || g.Free != 2 || g.TTL != WaitingTTL {
		t.Fatalf("queue credit: %+v; want 2 to api-3 for WaitingTTL", g)
	}
	if g := GrantQueue(SlotView{Waiting: waiting.Waiting}, rng); g.To != "" {
		t.Fatalf("no queue credit, yet granted %+v", g)
	}
}
