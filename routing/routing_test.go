package routing

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

func ids(cs []Candidate) []string {
	var out []string
	for _, c := range cs {
		out = append(out, c.ID)
	}
	return out
}

func TestQueueOrder(t *testing.T) {
	now := time.Unix(1000, 0)
	p := QueuePolicy{AgingStep: 30 * time.Second, StealGrace: time.Second}
	tests := []struct {
		name      string
		cands     []Candidate
		want      []string
		wantRetry time.Time
	}{
		{
			name: "class before age",
			cands: []Candidate{
				{ID: "batch", Class: Batch, Enqueued: now.Add(-10 * time.Second)},
				{ID: "std", Class: Standard, Enqueued: now.Add(-5 * time.Second)},
				{ID: "int", Class: Interactive, Enqueued: now},
			},
			want: []string{"int", "std", "batch"},
		},
		{
			name: "oldest first within a class",
			cands: []Candidate{
				{ID: "new", Class: Standard, Enqueued: now},
				{ID: "old", Class: Standard, Enqueued: now.Add(-time.Second)},
			},
			want: []string{"old", "new"},
		},
		{
			name: "aging lifts starved batch work above fresh interactive",
			cands: []Candidate{
				{ID: "int", Class: Interactive, Enqueued: now},
				{ID: "batch", Class: Batch, Enqueued: now.Add(-90 * time.Second)},
			},
			want: []string{"batch", "int"},
		},
		{
			name: "task hinted elsewhere waits out the grace",
			cands: []Candidate{
				{ID: "theirs", Class: Interactive, Enqueued: now.Add(-100 * time.Millisecond), Hint: "other"},
				{ID: "any", Class: Batch, Enqueued: now},
			},
			want:      []string{"any"},
			wantRetry: now.Add(900 * time.Millisecond),
		},
		{
			name: "task hinted elsewhere can be stolen after the grace",
			cands: []Candidate{
				{ID: "theirs", Class: Standard, Enqueued: now.Add(-2 * time.Second), Hint: "other"},
			},
			want: []string{"theirs"},
		},
		{
			name: "earliest deadline first within a class",
			cands: []Candidate{
				{ID: "none", Class: Standard, Enqueued: now.Add(-3 * time.Second)},
				{ID: "late", Class: Standard, Enqueued: now.Add(-2 * time.Second), Deadline: now.Add(10 * time.Second)},
				{ID: "soon", Class: Standard, Enqueued: now, Deadline: now.Add(time.Second)},
			},
			want: []string{"soon", "late", "none"},
		},
		{
			name: "deadline does not jump a class",
			cands: []Candidate{
				{ID: "batch-urgent", Class: Batch, Enqueued: now, Deadline: now.Add(time.Millisecond)},
				{ID: "int", Class: Interactive, Enqueued: now},
			},
			want: []string{"int", "batch-urgent"},
		},
		{
			name: "own hint first among equals",
			cands: []Candidate{
				{ID: "plain", Class: Standard, Enqueued: now.Add(-time.Second)},
				{ID: "mine", Class: Standard, Enqueued: now, Hint: "me"},
			},
			want: []string{"mine", "plain"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, retry := p.Order(tt.cands, "me", now)
			if g, w := ids(got), tt.want; len(g) != len(w) || (len(g) > 0 && !equal(g, w)) {
				t.Fatalf("order = %v, want %v", g, w)
			}
			if !retry.Equal(tt.wantRetry) {
				t.Fatalf("retryAt = %v, want %v", retry, tt.wantRetry)
			}
		})
	}
}

func equal(a, b []string) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The per-producer quotas add up to the budget whatever the number of
// producers, so the pool as a whole never overshoots it.
func TestAdmissionQuotasSumToBudget(t *testing.T) {
	a := Admission{Slack: 1}
	for credits := 0; credits <= 9; credits++ {
		for n := 1; n <= 6; n++ {
			var producers []string
			for i := range n {
				producers = append(producers, fmt.Sprintf("den-%d", i))
			}
			budget := a.Budget(credits, n)
			sum := 0
			for _, p := range producers {
				q := a.Quota(budget, producers, p)
				if q < max(budget/n, 1) || q > max(budget/n+1, 1) {
					t.Fatalf("credits=%d n=%d: quota of %s = %d, not an even share of %d (at least 1)", credits, n, p, q, budget)
				}
				sum += q
			}
			if want := max(budget, n); sum != want {
				t.Fatalf("credits=%d n=%d: quotas add up to %d, want max(budget %d, producers %d)", credits, n, sum, budget, n)
			}
		}
	}
	// A producer that has not seen itself in the membership yet counts itself.
	if q := a.Quota(4, []string{"a", "b", "c"}, "d"); q != 1 {
		t.Fatalf("unseen producer quota = %d, want 1", q)
	}
}

func TestAdmit(t *testing.T) {
	a := Admission{Slack: 1}
	// One producer, two downstream credits: the old chain's bound.
	q := a.Quota(a.Budget(2, 1), []string{"me"}, "me")
	if q != 3 {
		t.Fatalf("quota = %d, want credits+slack = 3", q)
	}
	for mine := 0; mine < q; mine++ {
		if !a.Admit(mine, q) {
			t.Fatalf("Admit(%d, %d) refused below the quota", mine, q)
		}
	}
	if a.Admit(q, q) {
		t.Fatal("admitted at the quota")
	}
	// Four producers share the same budget: each stops at its share.
	producers := []string{"d1", "d2", "d3", "d4"}
	total := 0
	for _, p := range producers {
		qp := a.Quota(a.Budget(2, len(producers)), producers, p)
		mine := 0
		for a.Admit(mine, qp) {
			mine++
		}
		total += mine
	}
	if total != 4 {
		t.Fatalf("four producers admitted %d in all, want one each (budget 3 < 4 producers)", total)
	}
	// None starves: 13 producers before a budget of 3 each get one.
	var pool []string
	for i := range 13 {
		pool = append(pool, fmt.Sprintf("den-%02d", i))
	}
	for _, p := range pool {
		if q := a.Quota(a.Budget(2, len(pool)), pool, p); q != 1 {
			t.Fatalf("%s: quota %d in a pool of 13 before a budget of 3, want 1", p, q)
		}
	}
	if q := a.Quota(0, pool, pool[0]); q != 0 {
		t.Fatalf("no downstream: quota %d, want 0", q)
	}
	if !(Admission{Off: true}).Admit(100, 0) {
		t.Fatal("Off refused")
	}
}

// PerProducer (the default's two) gives every producer room for its
// running task and an output on its way, however few credits the next
// stage has: 13 denoise agents before one decode slot each get a quota of
// two, where a pool-wide slack gave them one (held back while their last
// latent waits).
func TestAdmissionPerProducer(t *testing.T) {
	a := DefaultAdmission()
	var pool []string
	for i := range 13 {
		pool = append(pool, fmt.Sprintf("den-%02d", i))
	}
	budget := a.Budget(1, len(pool))
	if want := 1 + a.Slack + 2*13; budget != want {
		t.Fatalf("budget %d, want credits 1 + slack %d + 2 a producer = %d", budget, a.Slack, want)
	}
	for _, p := range pool {
		if q := a.Quota(budget, pool, p); q < 2 {
			t.Fatalf("%s: quota %d, want at least 2", p, q)
		}
	}
	if got := (Admission{Slack: 1}).Budget(1, 13); got != 2 {
		t.Fatalf("no per-producer share: budget %d, want credits + slack = 2", got)
	}
	// Share is that quota, the budget counting the producers it is split
	// among: self too when the list does not hold it yet.
	for _, self := range []string{pool[0], pool[12], "den-99"} {
		n := len(pool)
		if self == "den-99" {
			n++
		}
		if got, want := a.Share(1, pool, self), a.Quota(a.Budget(1, n), pool, self); got != want {
			t.Fatalf("%s: Share %d, Quota of the budget %d", self, got, want)
		}
	}
}

func TestPickHint(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	if got := PickHint(nil, rng); got != "" {
		t.Fatalf("no targets: got %q", got)
	}
	if got := PickHint([]Target{{Node: "a"}, {Node: "b"}}, rng); got != "" {
		t.Fatalf("no credit anywhere: got %q", got)
	}
	if got := PickHint([]Target{{Node: "a"}, {Node: "b", Free: 1}}, rng); got != "b" {
		t.Fatalf("only b has credit: got %q", got)
	}
	// Two candidates: the sample always holds both, so the better one wins.
	for i := 0; i < 50; i++ {
		if got := PickHint([]Target{{Node: "far", Free: 8}, {Node: "near", Free: 1, SameHost: true}}, rng); got != "near" {
			t.Fatalf("same host should win: got %q", got)
		}
		if got := PickHint([]Target{{Node: "a", Free: 1}, {Node: "b", Free: 3}}, rng); got != "b" {
			t.Fatalf("more credit should win: got %q", got)
		}
		// A worker that granted this producer its slot beats any that
		// gossip shows free, which others see too: same host, more credit.
		if got := PickHint([]Target{{Node: "near", Free: 4, SameHost: true}, {Node: "g", Free: 1, Granted: true}, {Node: "far", Free: 8}}, rng); got != "g" {
			t.Fatalf("the granted worker should win: got %q", got)
		}
		// Queue credit counts only where no worker has a free slot, and
		// more of it wins.
		if got := PickHint([]Target{{Node: "busy", Room: 8}, {Node: "free", Free: 1}}, rng); got != "free" {
			t.Fatalf("a free slot should beat queue credit: got %q", got)
		}
		if got := PickHint([]Target{{Node: "r1", Room: 1}, {Node: "r3", Room: 3}, {Node: "none"}}, rng); got != "r3" && got != "r1" {
			t.Fatalf("queue credit only: got %q", got)
		}
		if got := PickHint([]Target{{Node: "r1", Room: 1}, {Node: "r3", Room: 3}}, rng); got != "r3" {
			t.Fatalf("more queue credit should win: got %q", got)
		}
	}
	// Many candidates: the least loaded of all is never beaten by the worst.
	targets := []Target{{Node: "w0", Free: 1}, {Node: "w1", Free: 2}, {Node: "w2", Free: 3}, {Node: "w3", Free: 4}}
	counts := map[string]int{}
	for i := 0; i < 2000; i++ {
		counts[PickHint(targets, rng)]++
	}
	if counts["w3"] <= counts["w0"] || counts["w0"] != 0 {
		t.Fatalf("power of two choices skew wrong: %v", counts)
	}
}

func TestCredits(t *testing.T) {
	c := NewCredits(2)
	if err := c.TryAcquire(); err != nil {
		t.Fatal(err)
	}
	if err := c.TryAcquire(); err != nil {
		t.Fatal(err)
	}
	if err := c.TryAcquire(); err != ErrNoCredit {
		t.Fatalf("third acquire: %v, want ErrNoCredit", err)
	}
	freed := c.Freed()
	select {
	case <-freed:
		t.Fatal("freed closed before a release")
	default:
	}
	c.Release()
	select {
	case <-freed:
	case <-time.After(time.Second):
		t.Fatal("freed not closed after release")
	}
	if c.Free() != 1 || c.InUse() != 1 || c.Total() != 2 {
		t.Fatalf("free=%d inuse=%d total=%d", c.Free(), c.InUse(), c.Total())
	}
}

func TestParseClass(t *testing.T) {
	for _, c := range Classes() {
		got, err := ParseClass(c.String())
		if err != nil || got != c {
			t.Fatalf("round trip %v: %v %v", c, got, err)
		}
	}
	if c, err := ParseClass(""); err != nil || c != Standard {
		t.Fatalf("empty = %v %v", c, err)
	}
	if _, err := ParseClass("urgent"); err == nil {
		t.Fatal("unknown class accepted")
	}
}

func TestChooseHandoff(t *testing.T) {
	for _, c := range []struct {
		mode        string
		ready, room bool
		want        Handoff
	}{
		{"p2p", false, false, HandoffP2P},
		{"store", true, true, HandoffStore},
		{"auto", true, true, HandoffP2P},
		{"auto", false, true, HandoffStore}, // no consumer with credit: relay
		{"auto", true, false, HandoffStore}, // no room to hold it for the consumer
		{"", true, true, HandoffP2P},
	} {
		if got := ChooseHandoff(c.mode, c.ready, c.room); got != c.want {
			t.Errorf("ChooseHandoff(%q, ready=%v, room=%v) = %v, want %v", c.mode, c.ready, c.room, got, c.want)
		}
	}
}

func TestFIFOIgnoresClassAndDeadline(t *testing.T) {
	now := time.Unix(1000, 0)
	p := DefaultQueuePolicy()
	p.Scheduler = FIFO
	got, _ := p.Order([]Candidate{
		{ID: "int", Class: Interactive, Enqueued: now, Deadline: now.Add(time.Millisecond)},
		{ID: "batch", Class: Batch, Enqueued: now.Add(-2 * time.Second)},
		{ID: "std", Class: Standard, Enqueued: now.Add(-time.Second)},
	}, "me", now)
	if g := ids(got); !equal(g, []string{"batch", "std", "int"}) {
		t.Fatalf("fifo order = %v", g)
	}
	if v, _ := p.Preempt([]Candidate{{ID: "int", Class: Interactive, Enqueued: now.Add(-time.Hour)}},
		[]Candidate{{ID: "b", Class: Batch, Enqueued: now}}, "me", now); v != "" {
		t.Fatalf("fifo preempted %q", v)
	}
	for _, s := range []string{"fifo", "priority", ""} {
		if _, err := ParseScheduler(s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ParseScheduler("edf"); err == nil {
		t.Fatal("unknown scheduler accepted")
	}
}

// A stream of fresh interactive work, arriving twice as fast as it is
// served so that the interactive backlog only grows, does not starve a
// batch task: once it has waited two aging steps it ranks with
// interactive work, and no interactive task that arrived after that is
// served before it.
func TestAgingWithoutStarvation(t *testing.T) {
	p := QueuePolicy{AgingStep: 10 * time.Second}
	start := time.Unix(0, 0)
	queue := []Candidate{{ID: "batch", Class: Batch, Enqueued: start}}
	tick := time.Second
	lifted := start.Add(2 * p.AgingStep)
	for i := 0; i < 1000; i++ {
		now := start.Add(time.Duration(i) * tick)
		queue = append(queue,
			Candidate{ID: fmt.Sprintf("int-%d-a", i), Class: Interactive, Enqueued: now},
			Candidate{ID: fmt.Sprintf("int-%d-b", i), Class: Interactive, Enqueued: now})
		ordered, _ := p.Order(queue, "me", now)
		served := ordered[0]
		if served.ID == "batch" {
			t.Logf("batch served after %v of a growing interactive backlog", now.Sub(start))
			return
		}
		if served.Enqueued.After(lifted) {
			t.Fatalf("at %v: %s, enqueued after the batch task was lifted, served before it", now.Sub(start), served.ID)
		}
		for j, c := range queue {
			if c.ID == served.ID {
				queue = append(queue[:j], queue[j+1:]...)
				break
			}
		}
	}
	t.Fatal("batch task starved")
}

func TestPreempt(t *testing.T) {
	now := time.Unix(1000, 0)
	p := QueuePolicy{AgingStep: 30 * time.Second, PreemptAfter: 2 * time.Second, PreemptGrace: time.Second}
	batchOld := Candidate{ID: "b-old", Class: Batch, Enqueued: now.Add(-20 * time.Second), Node: "me"}
	batchNew := Candidate{ID: "b-new", Class: Batch, Enqueued: now.Add(-time.Second), Node: "me"}
	fresh := Candidate{ID: "int-fresh", Class: Interactive, Enqueued: now.Add(-500 * time.Millisecond)}
	stale := Candidate{ID: "int-stale", Class: Interactive, Enqueued: now.Add(-3 * time.Second)}
	std := Candidate{ID: "std", Class: Standard, Enqueued: now.Add(-time.Hour)}

	if v, wake := p.Preempt([]Candidate{fresh}, []Candidate{batchOld, batchNew}, "me", now); v != "" || !wake.Equal(fresh.Enqueued.Add(2*time.Second)) {
		t.Fatalf("fresh interactive: victim %q wake %v", v, wake)
	}
	if v, _ := p.Preempt([]Candidate{stale, fresh}, []Candidate{batchOld, batchNew}, "me", now); v != "b-new" {
		t.Fatalf("victim = %q, want the least aged batch task b-new", v)
	}
	if v, _ := p.Preempt([]Candidate{stale}, []Candidate{batchOld, {ID: "s", Class: Standard, Enqueued: now, Node: "me"}}, "me", now); v != "" {
		t.Fatalf("a slot runs standard work, yet %q was preempted", v)
	}
	if v, _ := p.Preempt([]Candidate{std}, []Candidate{batchNew}, "me", now); v != "" {
		t.Fatalf("only interactive work preempts; got %q", v)
	}
	// A batch task aged up to interactive keeps its slot.
	aged := Candidate{ID: "aged", Class: Batch, Enqueued: now.Add(-2 * time.Minute), Node: "me"}
	if v, _ := p.Preempt([]Candidate{stale}, []Candidate{aged}, "me", now); v != "" {
		t.Fatalf("aged batch preempted: %q", v)
	}
	if v, _ := (QueuePolicy{}).Preempt([]Candidate{stale}, []Candidate{batchNew}, "me", now); v != "" {
		t.Fatal("PreemptAfter 0 preempted")
	}
	// Another worker's batch task is the least aged: it gives way, not me.
	other := Candidate{ID: "b-other", Class: Batch, Enqueued: now, Node: "other"}
	if v, _ := p.Preempt([]Candidate{stale}, []Candidate{batchOld, other}, "me", now); v != "" {
		t.Fatalf("me gave way (%q) for a task another worker's newer batch task is matched to", v)
	}
	if v, _ := p.Preempt([]Candidate{stale}, []Candidate{batchOld, other}, "other", now); v != "b-other" {
		t.Fatalf("other: victim %q, want b-other", v)
	}
}

// One interactive task kept waiting on a stage whose every worker runs
// batch work costs one batch task in the whole stage, not one per worker:
// each worker decides alone, from the same view, and exactly one gives
// way; two due tasks cost two. A slot freed for a due task counts as its
// own until the grace ends, so nobody gives way again for it meanwhile.
// Victims, the choice for the whole stage, names the same tasks.
func TestPreemptOneVictimPerDueTask(t *testing.T) {
	now := time.Unix(1000, 0)
	p := DefaultQueuePolicy()
	var running []Candidate
	for i := 0; i < 14; i++ {
		running = append(running, Candidate{ID: fmt.Sprintf("b%02d", i), Class: Batch, Enqueued: now.Add(-time.Duration(i) * time.Second), Node: fmt.Sprintf("w%02d", i)})
	}
	victims := func(queued, running []Candidate, now time.Time) []string {
		var out []string
		for i := 0; i < 14; i++ {
			if v, _ := p.Preempt(queued, running, fmt.Sprintf("w%02d", i), now); v != "" {
				out = append(out, v)
			}
		}
		// A central dispatcher's choice over the whole stage is what the
		// workers choose each for itself.
		matched, _ := p.Victims(queued, running, now)
		var all []string
		for _, v := range matched {
			all = append(all, v.ID)
		}
		if !equal(all, out) {
			t.Fatalf("Victims %v, the workers' own choices %v", all, out)
		}
		return out
	}
	due1 := Candidate{ID: "i1", Class: Interactive, Enqueued: now.Add(-3 * time.Second)}
	due2 := Candidate{ID: "i2", Class: Interactive, Enqueued: now.Add(-2 * time.Second)}
	if got := victims([]Candidate{due1}, running, now); !equal(got, []string{"b00"}) {
		t.Fatalf("one due task: victims %v, want [b00] (the least aged)", got)
	}
	if got := victims([]Candidate{due1, due2}, running, now); !equal(got, []string{"b00", "b01"}) {
		t.Fatalf("two due tasks: victims %v, want [b00 b01]", got)
	}
	// b00 was given back a moment ago: its worker is claiming i1.
	requeued := running[0]
	requeued.Node, requeued.Preempted = "", now.Add(-100*time.Millisecond)
	queued := []Candidate{due1, requeued}
	if got := victims(queued, running[1:], now); len(got) != 0 {
		t.Fatalf("a freed slot is on its way to i1, yet %v gave way", got)
	}
	_, wake := p.Preempt(queued, running[1:], "w01", now)
	if want := requeued.Preempted.Add(p.PreemptGrace); !wake.Equal(want) {
		t.Fatalf("wake %v, want the end of the freed slot's grace %v", wake, want)
	}
	if got := victims(append(queued, due2), running[1:], now); !equal(got, []string{"b01"}) {
		t.Fatalf("i2 due too: victims %v, want [b01]", got)
	}
	// The grace ended and i1 still waits (the slot went elsewhere): again.
	if got := victims(queued, running[1:], wake); !equal(got, []string{"b01"}) {
		t.Fatalf("after the grace: victims %v, want [b01]", got)
	}
}

func TestGiveBack(t *testing.T) {
	p := DefaultQueuePolicy()
	pushed := time.Unix(1000, 0)
	for _, c := range []struct {
		waited  time.Duration
		others  bool
		startIn time.Duration
		want    bool
	}{
		{0, true, -1, false},                      // just pushed: its worker may free a slot at once
		{p.StealGrace - 1, true, -1, false},       // still within the grace
		{p.StealGrace, true, -1, true},            // waited the grace, another worker could run it, no end in sight
		{p.StealGrace, true, p.HoldFor + 1, true}, // its slot frees later than HoldFor
		{p.StealGrace, true, p.HoldFor, false},    // its slot frees soon: kept
		{time.Minute, true, 0, false},             // due now
		{time.Minute, false, -1, false},           // the stage's only worker: it waits here as well as in the queue
		{p.StealGrace + 1, false, time.Hour, false},
	} {
		if got := p.GiveBack(pushed, pushed.Add(c.waited), c.others, c.startIn); got != c.want {
			t.Errorf("GiveBack after %v, others %v, start in %v = %v, want %v", c.waited, c.others, c.startIn, got, c.want)
		}
	}
}

// An interactive task pushed to a worker that can neither start it nor
// give way for it goes back to the queue once due for preemption, where
// the stage's preemption can serve it; not before, not if the worker has
// batch work to stop, and never a task of another class or under FIFO.
func TestStranded(t *testing.T) {
	p := DefaultQueuePolicy()
	now := time.Unix(1000, 0)
	fresh := Candidate{ID: "i", Class: Interactive, Enqueued: now.Add(-time.Second)}
	due := Candidate{ID: "i", Class: Interactive, Enqueued: now.Add(-p.PreemptAfter)}
	if back, at := p.Stranded(fresh, now, false); back || !at.Equal(fresh.Enqueued.Add(p.PreemptAfter)) {
		t.Fatalf("fresh: back %v at %v, want false at its due time", back, at)
	}
	if back, _ := p.Stranded(due, now, false); !back {
		t.Fatal("due and no batch task to stop: not given back")
	}
	if back, at := p.Stranded(due, now, true); back || !at.IsZero() {
		t.Fatal("a worker with batch work to stop gave the task back")
	}
	if back, _ := p.Stranded(Candidate{Class: Standard, Enqueued: now.Add(-time.Hour)}, now, false); back {
		t.Fatal("a standard task was given back")
	}
	fifo := p
	fifo.Scheduler = FIFO
	if back, _ := fifo.Stranded(due, now, false); back {
		t.Fatal("fifo gave a task back for preemption")
	}
}
