package routing

import (
	"testing"
	"time"
)

// A promise holds one producer until it lapses or a slot is taken; a slot
// taken by anyone but its holder names the holder to take it back from.
func TestSlotBookPromise(t *testing.T) {
	b := NewSlotBook()
	now := time.Unix(1000, 0)
	ahead := SlotGrant{To: "enc-1", Free: 1, TTL: GrantTTL}
	if g, _ := b.Promised(now); g.To != "" {
		t.Fatalf("a new book promised its slots to %q", g.To)
	}
	b.Promise(ahead, now)
	if g, until := b.Promised(now.Add(time.Second)); g != ahead || !until.Equal(now.Add(GrantTTL)) {
		t.Fatalf("promised by %+v until %v, want %+v until %v", g, until, ahead, now.Add(GrantTTL))
	}
	if g, _ := b.Promised(now.Add(GrantTTL)); g.To != "" {
		t.Fatalf("a lapsed promise still held, to %q", g.To)
	}

	b.Promise(ahead, now)
	revoke, done := b.Take("enc-1", now.Add(time.Millisecond))
	if revoke != "" {
		t.Fatalf("the holder's own push spent the promise, yet %q is to be told", revoke)
	}
	if g, _ := b.Promised(now.Add(time.Millisecond)); g.To != "" {
		t.Fatalf("a spent promise still held, to %q", g.To)
	}
	done(now.Add(time.Second), true)

	b.Promise(ahead, now.Add(2*time.Second))
	if revoke, _ := b.Take("enc-2", now.Add(2*time.Second)); revoke != "enc-1" {
		t.Fatalf("a slot taken by another's task: revoke %q, want enc-1", revoke)
	}
	b.Promise(ahead, now)
	if revoke, _ := b.Take("enc-2", now.Add(GrantTTL)); revoke != "" {
		t.Fatalf("a lapsed promise needs no revoke, got %q", revoke)
	}
}

// startIn estimates a waiting task's start from how long tasks held a slot
// here: the busy slots free in the order they are due, each serving the
// next task, and an unknown mean or no busy slot cannot tell.
func TestSlotBookStartIn(t *testing.T) {
	b := NewSlotBook()
	now := time.Unix(1000, 0)
	_, done := b.Take("", now)
	if got := b.StartIn(0, now); got >= 0 {
		t.Fatalf("no task ended yet: start in %v, want unknown", got)
	}
	done(now.Add(4*time.Second), true) // mean 4 s
	if got := b.StartIn(0, now.Add(4*time.Second)); got >= 0 {
		t.Fatalf("no slot busy: start in %v, want unknown (something else holds it)", got)
	}
	t0 := now.Add(10 * time.Second)
	_, d1 := b.Take("", t0)
	_, d2 := b.Take("", t0.Add(time.Second))
	at := t0.Add(3 * time.Second) // slot 1 due in 1 s, slot 2 in 2 s
	for k, want := range []time.Duration{time.Second, 2 * time.Second, 5 * time.Second, 6 * time.Second} {
		if got := b.StartIn(k, at); got != want {
			t.Errorf("task %d waiting: start in %v, want %v", k, got, want)
		}
	}
	if got := b.StartIn(0, t0.Add(time.Minute)); got != 0 {
		t.Errorf("slots overdue: start in %v, want 0", got)
	}
	d1(t0.Add(4*time.Second), true)  // held 4 s: the mean stays
	d2(t0.Add(13*time.Second), true) // held 12 s: the mean moves an eighth of the way
	if want := 4*time.Second + (12*time.Second-4*time.Second)/slotMeanWeight; b.mean != want {
		t.Errorf("mean %v, want %v", b.mean, want)
	}
	d2(t0.Add(time.Hour), true) // a second call does nothing
	if want := 4*time.Second + (12*time.Second-4*time.Second)/slotMeanWeight; b.mean != want {
		t.Errorf("a slot freed twice moved the mean to %v", b.mean)
	}
	// A task stopped early (preempted, drained, failed) frees its slot
	// and teaches nothing.
	was := b.mean
	_, d3 := b.Take("", t0.Add(time.Minute))
	d3(t0.Add(time.Minute+time.Millisecond), false)
	if b.mean != was || len(b.busy) != 0 {
		t.Errorf("a task stopped after 1 ms: mean %v (was %v), %d slots busy", b.mean, was, len(b.busy))
	}
}

// A dispatcher that declines a grant made for work waiting ends the
// promise of it (and only of such a grant), and is left out until gossip
// shows it anew.
func TestSlotBookDecline(t *testing.T) {
	b := NewSlotBook()
	now := time.Unix(1000, 0)
	b.Promise(SlotGrant{To: "enc-1", Free: 1, TTL: GrantTTL}, now)
	if b.Decline("enc-1", now) {
		t.Fatal("a grant ahead of work was ended by a decline")
	}
	b.Promise(SlotGrant{To: "enc-2", Free: 1, TTL: WaitingTTL, Waiting: true}, now)
	if b.Decline("enc-1", now.Add(time.Millisecond)) {
		t.Fatal("another's decline ended the promise")
	}
	if !b.Decline("enc-2", now.Add(time.Millisecond)) {
		t.Fatal("the declined promise held")
	}
	if g, _ := b.Promised(now.Add(time.Millisecond)); g.To != "" {
		t.Fatalf("promised to %q after the decline", g.To)
	}
	if !b.Declined("enc-2", now) {
		t.Fatal("a dispatcher that declined after gossip last showed it is not left out")
	}
	if b.Declined("enc-2", now.Add(time.Second)) {
		t.Fatal("gossip showed it anew since, yet it is left out")
	}
	if !Declines(true, false) || Declines(true, true) || Declines(false, false) {
		t.Fatal("Declines: only a grant for work waiting, with none waiting, is declined")
	}
}
