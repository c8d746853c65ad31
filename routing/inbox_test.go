package routing

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"
)

func TestPick(t *testing.T) {
	p := DefaultQueuePolicy()
	now := time.Unix(1000, 0)
	pushed := []Pushed{
		{Candidate: Candidate{ID: "std", Class: Standard, Enqueued: now.Add(-time.Second), Hint: "w"}},
		{Candidate: Candidate{ID: "inter", Class: Interactive, Enqueued: now, Hint: "w"}},
		{Candidate: Candidate{ID: "later", Class: Interactive, Enqueued: now.Add(-time.Minute), Hint: "w"}, NotBefore: now.Add(3 * time.Second)},
		{Candidate: Candidate{ID: "theirs", Class: Interactive, Enqueued: now, Hint: "v"}},
	}
	pick, full, wake := p.Pick(pushed, "w", now, nil)
	if pick != 1 || full {
		t.Fatalf("picked %d (full %v), want the interactive one: a backed-off task and another's within its grace wait", pick, full)
	}
	if want := now.Add(p.StealGrace); !wake.Equal(want) {
		t.Fatalf("wake %v, want the steal grace's end %v, before the backoff's", wake, want)
	}
	// The interactive task's output has no room: the next that has starts.
	pick, full, _ = p.Pick(pushed, "w", now, func(i int) bool { return i != 1 })
	if pick != 0 || full {
		t.Fatalf("picked %d (full %v), want the standard one", pick, full)
	}
	// None has room: the worker is blocked, not idle.
	pick, full, _ = p.Pick(pushed, "w", now, func(int) bool { return false })
	if pick != -1 || !full {
		t.Fatalf("picked %d (full %v), want none, blocked", pick, full)
	}
	// Nothing eligible yet: idle, with the time to look again.
	pick, full, wake = p.Pick(pushed[2:3], "w", now, func(int) bool { return false })
	if pick != -1 || full || !wake.Equal(now.Add(3*time.Second)) {
		t.Fatalf("picked %d (full %v, wake %v), want none until the backoff ends", pick, full, wake)
	}
	if pick, full, wake := p.Pick(nil, "w", now, nil); pick != -1 || full || !wake.IsZero() {
		t.Fatalf("an empty inbox: %d %v %v", pick, full, wake)
	}
}

// Pick's choice is Order's first, over random inboxes: the worker starts
// what a queue scan would take first.
func TestPickIsOrdersFirst(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	now := time.Unix(1000, 0)
	for _, p := range []QueuePolicy{DefaultQueuePolicy(), {Scheduler: FIFO}} {
		for range 500 {
			pushed := make([]Pushed, rng.IntN(6))
			cands := make([]Candidate, 0, len(pushed))
			for i := range pushed {
				c := Candidate{
					ID:       strconv.Itoa(i),
					Class:    Class(rng.IntN(3)),
					Enqueued: now.Add(-time.Duration(rng.IntN(4)) * 20 * time.Second), // ties too
					Hint:     []string{"", "w", "v"}[rng.IntN(3)],
				}
				if rng.IntN(4) == 0 {
					c.Deadline = now.Add(time.Duration(rng.IntN(3)) * time.Minute)
				}
				pushed[i] = Pushed{Candidate: c}
				cands = append(cands, c)
			}
			ordered, _ := p.Order(cands, "w", now)
			pick, _, _ := p.Pick(pushed, "w", now, nil)
			switch {
			case len(ordered) == 0 && pick != -1:
				t.Fatalf("picked %d from %+v; Order takes none", pick, cands)
			case len(ordered) > 0 && (pick < 0 || pushed[pick].ID != ordered[0].ID):
				t.Fatalf("picked %d from %+v; Order's first is %s", pick, cands, ordered[0].ID)
			}
		}
	}
}

func TestReturns(t *testing.T) {
	p := DefaultQueuePolicy()
	now := time.Unix(1000, 0)
	old := now.Add(-time.Minute)
	book := NewSlotBook() // no task ended yet: it cannot tell when a slot frees
	std := func(id string, pushed time.Time) Pushed {
		return Pushed{Candidate: Candidate{ID: id, Class: Standard, Enqueued: pushed}, At: pushed}
	}
	young := std("young", now.Add(-p.StealGrace/2))
	due := std("due", now.Add(-p.StealGrace))
	offered := std("offered", old)
	offered.Offered = true
	back, next := p.Returns([]Pushed{young, offered, due}, now, true, false, book)
	if len(back) != 1 || back[0] != (Return{Index: 2}) {
		t.Fatalf("gave back %+v, want the claim past its grace, not the young one nor the offer", back)
	}
	if want := young.At.Add(p.StealGrace); !next.Equal(want) {
		t.Fatalf("next look %v, want the young claim's grace end %v", next, want)
	}
	// The stage's only worker keeps it, and looks again.
	back, next = p.Returns([]Pushed{due}, now, false, false, book)
	if len(back) != 0 || !next.Equal(now.Add(LookAgain)) {
		t.Fatalf("only worker: gave back %+v, next %v", back, next)
	}
	// Interactive work due for preemption on a worker that has no batch
	// task to give way with goes back, stranded; one that could give way
	// keeps it (its preemption serves it).
	inter := Pushed{Candidate: Candidate{ID: "inter", Class: Interactive, Enqueued: now.Add(-p.PreemptAfter)}, At: now}
	if back, _ := p.Returns([]Pushed{inter}, now, false, false, book); len(back) != 1 || !back[0].Stranded {
		t.Fatalf("stranded interactive claim: %+v", back)
	}
	if back, _ := p.Returns([]Pushed{inter}, now, true, true, book); len(back) != 0 {
		t.Fatalf("a worker that can give way gave back %+v", back)
	}

	// A slot clock: one busy slot, 400 ms a task, 100 ms in. The oldest
	// claim starts in 300 ms and is kept (HoldFor 1 s); the third oldest
	// would wait 1.1 s and goes back. The order is by push, not by place.
	busy := NewSlotBook()
	_, done := busy.Take("", now.Add(-time.Second))
	done(now.Add(-600*time.Millisecond), true) // learnt: 400 ms
	busy.Take("", now.Add(-100*time.Millisecond))
	a, b, c := std("a", old), std("b", old.Add(time.Millisecond)), std("c", old.Add(2*time.Millisecond))
	back, next = p.Returns([]Pushed{c, a, b}, now, true, false, busy)
	if len(back) != 1 || back[0].Index != 0 {
		t.Fatalf("gave back %+v, want the third oldest (index 0)", back)
	}
	if !next.Equal(now.Add(LookAgain)) {
		t.Fatalf("next look %v, want within a second for the kept ones", next)
	}
}

// Spare hands an idle peer the claim its worker would start last, never an
// offered one, and an idle worker keeps the one it starts now.
func TestSpare(t *testing.T) {
	p := DefaultQueuePolicy()
	now := time.Unix(1000, 0)
	at := func(id string, c Class, age time.Duration) Pushed {
		return Pushed{Candidate: Candidate{ID: id, Class: c, Enqueued: now.Add(-age), Hint: "w"}, At: now.Add(-age)}
	}
	inter, batch, std := at("i", Interactive, time.Second), at("b", Batch, 3*time.Second), at("s", Standard, 2*time.Second)
	if got := p.Spare([]Pushed{inter, batch, std}, "w", now, true); got != 1 {
		t.Fatalf("spared %d, want the batch claim (1), started last", got)
	}
	offered := batch
	offered.Offered = true
	if got := p.Spare([]Pushed{inter, offered, std}, "w", now, true); got != 2 {
		t.Fatalf("spared %d, want the standard claim (2): the offered batch one is not its to hand over", got)
	}
	if got := p.Spare([]Pushed{inter}, "w", now, false); got != -1 {
		t.Fatalf("an idle worker spared %d of its one claim", got)
	}
	if got := p.Spare([]Pushed{inter}, "w", now, true); got != 0 {
		t.Fatalf("a busy worker spared %d, want its one claim", got)
	}
	if got := p.Spare(nil, "w", now, true); got != -1 {
		t.Fatalf("spared %d of nothing", got)
	}
}
