package routing

import (
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

func TestAdmit(t *testing.T) {
	a := Admission{Slack: 1}
	tests := []struct {
		queued, free, inflight int
		want                   bool
	}{
		{0, 0, 0, true},  // an empty pipeline can always start one
		{1, 0, 0, false}, // nobody to decode and one already waiting
		{0, 0, 1, false}, // one in flight will fill the slack
		{2, 2, 0, true},
		{2, 2, 1, false},
		{0, 4, 3, true},
	}
	for _, tt := range tests {
		if got := a.Admit(tt.queued, tt.free, tt.inflight); got != tt.want {
			t.Errorf("Admit(%d,%d,%d) = %v, want %v", tt.queued, tt.free, tt.inflight, got, tt.want)
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
