package jobs

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
)

// fakeClock is a settable now.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// fakeProbe answers each probe with err, settable while Run runs.
type fakeProbe struct {
	mu    sync.Mutex
	err   error
	calls int
}

func (p *fakeProbe) probe(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	return p.err
}

func (p *fakeProbe) set(err error) {
	p.mu.Lock()
	p.err = err
	p.mu.Unlock()
}

func testHealth(t *testing.T, probe func(context.Context) error) (*Health, *fakeClock) {
	clk := &fakeClock{t: time.Unix(1700000000, 0)}
	h := NewHealth(HealthConfig{SlowAfter: 250 * time.Millisecond, ProbeEvery: time.Second, ProbeTimeout: time.Second},
		probe, zaptest.NewLogger(t))
	h.now = clk.now
	return h, clk
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Down on the first unavailable answer, up on the next answer; refusals
// and the caller's own deadline say nothing. Each change closes Changed.
func TestHealthObserve(t *testing.T) {
	h, clk := testHealth(t, nil)
	changed := h.Changed()
	for _, err := range []error{nil, rpctypes.ErrPermissionDenied, context.DeadlineExceeded, ErrFenced} {
		h.Observe(err)
		if h.Err() != nil || closed(changed) {
			t.Fatalf("after Observe(%v): Err %v, changed %v: want up, unchanged", err, h.Err(), closed(changed))
		}
	}
	h.Observe(rpctypes.ErrNoLeader)
	clk.advance(1500 * time.Millisecond)
	err := h.Err()
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "no leader") || !strings.Contains(err.Error(), "1.5s") {
		t.Fatalf("Err = %v, want ErrUnavailable saying why and for how long", err)
	}
	if !closed(changed) {
		t.Fatal("Changed not closed when etcd went down")
	}
	changed = h.Changed()
	h.Observe(rpctypes.ErrTimeout) // already down: no change
	if closed(changed) {
		t.Fatal("Changed closed without a change")
	}
	h.Observe(nil)
	if h.Err() != nil || !closed(changed) {
		t.Fatalf("after an answer: Err %v, changed %v; want up, changed", h.Err(), closed(changed))
	}
}

// A tracked call is cancelled, with the reason, the moment etcd is found
// down; one tracked while down is cancelled at once; done reports the
// call's outcome.
func TestHealthTrackCancelsWhenDown(t *testing.T) {
	h, _ := testHealth(t, nil)
	call, done := h.Track(context.Background())
	wait, doneWait := h.TrackWait(context.Background())
	h.Observe(rpctypes.ErrNoLeader)
	for _, ctx := range []context.Context{call, wait} {
		if ctx.Err() == nil || !errors.Is(context.Cause(ctx), ErrUnavailable) {
			t.Fatalf("tracked context: %v (cause %v), want cancelled for the outage", ctx.Err(), context.Cause(ctx))
		}
	}
	done(context.Canceled)
	doneWait(context.Canceled)
	late, doneLate := h.Track(context.Background())
	if !errors.Is(context.Cause(late), ErrUnavailable) {
		t.Fatalf("tracked while down: cause %v, want the outage", context.Cause(late))
	}
	doneLate(nil)

	h.Observe(nil)
	ok, done := h.Track(context.Background())
	done(rpctypes.ErrTimeoutDueToLeaderFail)
	if !errors.Is(h.Err(), ErrUnavailable) {
		t.Fatalf("a call that timed out on etcd: Err %v, want down", h.Err())
	}
	if !errors.Is(context.Cause(ok), context.Canceled) || errors.Is(context.Cause(ok), ErrUnavailable) {
		t.Fatalf("a finished call's context: cause %v, want plainly cancelled", context.Cause(ok))
	}
	// A long poll's success is not news of etcd now (a watch event may be
	// old); a call's is.
	h.Observe(nil)
	_, doneWait = h.TrackWait(context.Background())
	_, done = h.Track(context.Background())
	h.Observe(rpctypes.ErrNoLeader)
	doneWait(nil)
	if h.Err() == nil {
		t.Fatal("a long poll's success brought etcd up")
	}
	done(nil)
	if err := h.Err(); err != nil {
		t.Fatalf("a call's success: Err %v, want up", err)
	}
}

// Probes are due only while down, or while a call (not a long poll) has
// waited past SlowAfter; then one every ProbeEvery.
func TestHealthProbeSchedule(t *testing.T) {
	p := &fakeProbe{}
	h, clk := testHealth(t, p.probe)
	due := func() (time.Duration, bool) {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.nextProbeLocked(clk.now())
	}
	want := func(what string, wait time.Duration, ok bool) {
		t.Helper()
		if w, d := due(); d != ok || (ok && w != wait) {
			t.Fatalf("%s: next probe in %v (due %v), want %v (due %v)", what, w, d, wait, ok)
		}
	}
	want("idle", 0, false)
	_, doneWait := h.TrackWait(context.Background())
	want("a long poll", 0, false)
	_, done := h.Track(context.Background())
	want("a call", 250*time.Millisecond, true)
	clk.advance(100 * time.Millisecond)
	_, done2 := h.Track(context.Background())
	want("a second call", 150*time.Millisecond, true)
	clk.advance(150 * time.Millisecond)
	want("a slow call", 0, true)
	h.probeOnce(context.Background())
	if p.calls != 1 || h.Err() != nil {
		t.Fatalf("%d probes, Err %v", p.calls, h.Err())
	}
	want("a call still waiting", time.Second, true)
	done(nil)
	done2(nil)
	want("the calls answered", 0, false)

	p.set(rpctypes.ErrNoLeader)
	h.probeOnce(context.Background())
	if !errors.Is(h.Err(), ErrUnavailable) {
		t.Fatalf("probe found no leader: Err %v", h.Err())
	}
	want("down", time.Second, true)
	clk.advance(2 * time.Second)
	want("down, probe overdue", -time.Second, true)
	p.set(nil)
	h.probeOnce(context.Background())
	if h.Err() != nil {
		t.Fatalf("probe answered: Err %v", h.Err())
	}
	want("up again", 0, false)
	doneWait(nil)
}

// What each probe answer makes of the health.
func TestHealthProbeAnswers(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		down string // "" for up
	}{
		{"a leader", nil, ""},
		{"no leader", rpctypes.ErrGRPCNoLeader, "no leader"},
		{"no answer", context.DeadlineExceeded, "no answer within 50ms"},
		{"refused", rpctypes.ErrGRPCPermissionDenied, ""}, // it answered, past the leader check
	} {
		t.Run(c.name, func(t *testing.T) {
			h, _ := testHealth(t, func(ctx context.Context) error {
				if errors.Is(c.err, context.DeadlineExceeded) {
					<-ctx.Done() // a frozen member: the probe's own deadline ends it
					return ctx.Err()
				}
				return c.err
			})
			h.cfg.ProbeTimeout = 50 * time.Millisecond
			if c.down == "" {
				h.Observe(rpctypes.ErrNoLeader) // start down: the probe must bring it up
			}
			h.probeOnce(context.Background())
			err := h.Err()
			switch {
			case c.down == "" && err != nil:
				t.Fatalf("Err %v, want up", err)
			case c.down != "" && (!errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), c.down)):
				t.Fatalf("Err %v, want down saying %q", err, c.down)
			}
		})
	}
}

// Run, end to end with a fake probe: a call that waits on a member without
// a leader is cancelled once the probe says so, and Run brings etcd up at
// the first probe that finds a leader again.
func TestHealthRun(t *testing.T) {
	p := &fakeProbe{err: rpctypes.ErrGRPCNoLeader}
	h := NewHealth(HealthConfig{SlowAfter: time.Millisecond, ProbeEvery: time.Millisecond, ProbeTimeout: time.Second},
		p.probe, zaptest.NewLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { h.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
	}()
	deadline := time.After(30 * time.Second) // a hang, not a measure
	call, done := h.Track(context.Background())
	select {
	case <-call.Done():
	case <-deadline:
		t.Fatal("a call waiting on a member without a leader was not cancelled")
	}
	done(context.Cause(call))
	if !errors.Is(context.Cause(call), ErrUnavailable) || h.Err() == nil {
		t.Fatalf("cause %v, Err %v: want the outage", context.Cause(call), h.Err())
	}
	changed := h.Changed()
	p.set(nil)
	select {
	case <-changed:
	case <-deadline:
		t.Fatal("etcd never came back up")
	}
	if h.Err() != nil {
		t.Fatalf("Err %v after the leader came back", h.Err())
	}
}

// LeaderProbe against a real etcd with a leader.
func TestLeaderProbe(t *testing.T) {
	_, cli := startSmallEtcd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := LeaderProbe(cli, "/latentmesh/test/health")(ctx); err != nil {
		t.Fatalf("probe of an etcd with a leader: %v", err)
	}
	dead, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:1"}, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	pctx, pcancel := context.WithTimeout(ctx, time.Second)
	defer pcancel()
	if err := LeaderProbe(dead, "/latentmesh/test/health")(pctx); err == nil {
		t.Fatal("a probe of an etcd nobody serves succeeded")
	}
}

func TestFinished(t *testing.T) {
	f := NewFinished(2)
	f.Note(Job{ID: "running", State: Running})
	if _, ok := f.Get("running"); ok {
		t.Fatal("kept a job that is not finished")
	}
	for _, id := range []string{"a", "b", "a", "c"} {
		f.Note(Job{ID: id, State: Succeeded})
	}
	if _, ok := f.Get("a"); ok {
		t.Fatal("kept more than 2: the oldest should be gone")
	}
	for _, id := range []string{"b", "c"} {
		if j, ok := f.Get(id); !ok || j.State != Succeeded {
			t.Fatalf("%s: %+v %v", id, j, ok)
		}
	}
	f.Forget("c")
	if _, ok := f.Get("c"); ok {
		t.Fatal("kept a forgotten job")
	}
}
