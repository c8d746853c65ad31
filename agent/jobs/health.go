package jobs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// HealthConfig tunes Health.
type HealthConfig struct {
	// SlowAfter is how long a client request may wait on etcd before
	// Health probes whether etcd still has a leader.
	SlowAfter time.Duration
	// ProbeEvery is the pause between probes while etcd is down, and
	// while a request keeps waiting.
	ProbeEvery time.Duration
	// ProbeTimeout bounds one probe: one not answered within it finds
	// etcd down.
	ProbeTimeout time.Duration
}

// DefaultHealthConfig is the agent's: an outage is known a quarter second
// after etcd's member has lost its leader (its election timeout, 1 to 2 s
// with etcd's defaults), and its end a quarter second after a new leader.
func DefaultHealthConfig() HealthConfig {
	return HealthConfig{
		SlowAfter:    250 * time.Millisecond, // a healthy etcd answers in milliseconds
		ProbeEvery:   250 * time.Millisecond, // four local reads a second, and only during an outage or a slow request
		ProbeTimeout: time.Second,            // a local read takes a millisecond; a frozen or cut-off member never answers
	}
}

func (c HealthConfig) withDefaults() HealthConfig {
	d := DefaultHealthConfig()
	if c.SlowAfter <= 0 {
		c.SlowAfter = d.SlowAfter
	}
	if c.ProbeEvery <= 0 {
		c.ProbeEvery = d.ProbeEvery
	}
	if c.ProbeTimeout <= 0 {
		c.ProbeTimeout = d.ProbeTimeout
	}
	return c
}

// Health is what an agent knows of etcd's ability to serve it: up until a
// call that needed quorum fails as unavailable (its member has no leader,
// no answer in time, no connection), then down until etcd answers such a
// call again or a probe finds a leader. While it is down the client API
// refuses writes at once and serves reads without quorum, instead of
// letting each request wait out its deadline for the same answer.
//
// It sends etcd nothing while etcd answers promptly: it probes only while
// down, to see etcd back, and while a client request has waited longer
// than SlowAfter, to learn that etcd lost its leader before the request's
// deadline says so. The probe (LeaderProbe) is a read the member answers
// by itself, refused at once by a member that has no leader.
type Health struct {
	cfg   HealthConfig
	probe func(context.Context) error
	log   *zap.Logger
	now   func() time.Time
	kick  chan struct{} // wakes Run: etcd went down, or a first call began; buffered 1

	mu        sync.Mutex // guards the fields below
	down      error      // nil while up; else wraps ErrUnavailable, saying why
	since     time.Time  // when down last changed
	changed   chan struct{}
	calls     map[*call]struct{} // client requests waiting on etcd now
	lastProbe time.Time
	refusals  int // probes etcd refused (not unavailable), logged once
}

// call is one tracked client request.
type call struct {
	start  time.Time
	cancel context.CancelCauseFunc
	slow   bool // a call that should answer promptly; a long poll waits by design
}

// NewHealth starts up; Run does the probing. probe is one health check of
// etcd (LeaderProbe). Unset fields of cfg take their defaults; log may be nil.
func NewHealth(cfg HealthConfig, probe func(context.Context) error, log *zap.Logger) *Health {
	if log == nil {
		log = zap.NewNop()
	}
	return &Health{
		cfg:     cfg.withDefaults(),
		probe:   probe,
		log:     log.Named("etcdhealth"),
		now:     time.Now,
		kick:    make(chan struct{}, 1),
		since:   time.Now(),
		changed: make(chan struct{}),
		calls:   map[*call]struct{}{},
	}
}

// LeaderProbe is the probe Health needs: a read of key that cli's member
// answers from its own data, sent with WithRequireLeader, so a member
// without a leader refuses it at once (etcd checks before it serves). It
// is a transaction because the client retries a refused range read until
// its deadline and sends a transaction once. It goes through its own KV,
// around etcdguard: the guard takes a transaction's answer as linearizable.
// key needs read access only; nothing writes it. A client with no gRPC
// connection (etcd's in-process client, which the embedded etcd's agents
// use) has no connection to make a KV on: LeaderProbeKV takes the KV to
// use (etcdguard.Unguarded makes one either way).
func LeaderProbe(cli *clientv3.Client, key string) func(context.Context) error {
	return LeaderProbeKV(clientv3.NewKV(cli), key)
}

// LeaderProbeKV is LeaderProbe through kv.
func LeaderProbeKV(kv clientv3.KV, key string) func(context.Context) error {
	return func(ctx context.Context) error {
		_, err := kv.Txn(clientv3.WithRequireLeader(ctx)).
			Then(clientv3.OpGet(key, clientv3.WithSerializable(), clientv3.WithCountOnly())).
			Commit()
		return err
	}
}

// Err is nil while etcd is up, else an error wrapping ErrUnavailable that
// says why. It costs no etcd call.
func (h *Health) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.down == nil {
		return nil
	}
	return fmt.Errorf("%w (for %v)", h.down, h.now().Sub(h.since).Round(100*time.Millisecond))
}

// Changed returns a channel closed at the next change of Err between nil
// and an error.
func (h *Health) Changed() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.changed
}

// Observe takes the outcome of an etcd call that needed quorum (a write, a
// linearizable read, an alarm list): nil means etcd is up, an error that
// IsUnavailable means it is down, any other error (a refusal, the caller
// giving up) says nothing.
func (h *Health) Observe(err error) {
	switch {
	case err == nil:
		h.setUp()
	case IsUnavailable(err):
		h.setDown(err)
	}
}

// Track registers a client request about to call etcd, which should answer
// promptly. The returned context is cancelled, with a cause wrapping
// ErrUnavailable, as soon as etcd is found down, so the request need not
// wait out its deadline; while the request waits past SlowAfter, Health
// probes. done takes the call's outcome, as Observe does.
func (h *Health) Track(parent context.Context) (ctx context.Context, done func(err error)) {
	return h.track(parent, true)
}

// TrackWait is Track for a long poll: it is cancelled the same way, but
// waiting is what it is for, so it starts no probe, and its success says
// nothing of etcd now (a watch event may be old).
func (h *Health) TrackWait(parent context.Context) (ctx context.Context, done func(err error)) {
	return h.track(parent, false)
}

func (h *Health) track(parent context.Context, slow bool) (context.Context, func(error)) {
	ctx, cancel := context.WithCancelCause(parent)
	c := &call{start: h.now(), cancel: cancel, slow: slow}
	h.mu.Lock()
	if h.down != nil {
		cancel(h.down)
		h.mu.Unlock()
		return ctx, func(error) {}
	}
	_, oldest := h.oldestSlowLocked()
	h.calls[c] = struct{}{}
	h.mu.Unlock()
	if slow && !oldest {
		h.wake() // a later call never brings the next probe forward
	}
	return ctx, func(err error) {
		h.mu.Lock()
		delete(h.calls, c)
		h.mu.Unlock()
		cancel(nil)
		if err != nil || slow {
			h.Observe(err)
		}
	}
}

// Run probes etcd while it is down and while a call is slow, until ctx is
// done. The caller owns the goroutine.
func (h *Health) Run(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for ctx.Err() == nil {
		h.mu.Lock()
		wait, due := h.nextProbeLocked(h.now())
		h.mu.Unlock()
		if due && wait <= 0 {
			h.probeOnce(ctx)
			continue
		}
		var tc <-chan time.Time
		if due {
			t.Reset(wait)
			tc = t.C
		}
		select {
		case <-ctx.Done():
		case <-h.kick:
		case <-tc:
		}
		t.Stop()
	}
}

// nextProbeLocked says whether a probe is due and in how long: every
// ProbeEvery while down; while up, SlowAfter after the oldest slow call
// began and then every ProbeEvery while it waits.
func (h *Health) nextProbeLocked(now time.Time) (wait time.Duration, due bool) {
	next := h.lastProbe.Add(h.cfg.ProbeEvery)
	if h.down == nil {
		start, ok := h.oldestSlowLocked()
		if !ok {
			return 0, false
		}
		if s := start.Add(h.cfg.SlowAfter); s.After(next) {
			next = s
		}
	}
	return next.Sub(now), true
}

// oldestSlowLocked is when the oldest slow call began.
func (h *Health) oldestSlowLocked() (time.Time, bool) {
	var oldest time.Time
	found := false
	for c := range h.calls {
		if c.slow && (!found || c.start.Before(oldest)) {
			oldest, found = c.start, true
		}
	}
	return oldest, found
}

// probeOnce runs the probe and sets the state from its answer.
func (h *Health) probeOnce(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, h.cfg.ProbeTimeout)
	err := h.probe(pctx)
	timedOut := pctx.Err() != nil
	cancel()
	if ctx.Err() != nil {
		return
	}
	h.mu.Lock()
	h.lastProbe = h.now()
	h.mu.Unlock()
	switch {
	case err == nil:
		h.setUp()
	case IsUnavailable(err):
		h.setDown(fmt.Errorf("%w: health probe: %v", ErrUnavailable, err))
	case timedOut:
		h.setDown(fmt.Errorf("%w: health probe: no answer within %v", ErrUnavailable, h.cfg.ProbeTimeout))
	default:
		// Refused (permission denied, say): etcd answered, and answers a
		// request that needs a leader only once the leader check passed.
		h.mu.Lock()
		h.refusals++
		first := h.refusals == 1
		h.mu.Unlock()
		if first {
			h.log.Warn("etcd refused the health probe; taking the answer as up", zap.Error(err))
		}
		h.setUp()
	}
}

// setDown marks etcd down for err and cancels the tracked calls.
func (h *Health) setDown(err error) {
	if !errors.Is(err, ErrUnavailable) {
		err = fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	h.mu.Lock()
	if h.down != nil {
		h.mu.Unlock()
		return
	}
	h.down, h.since = err, h.now()
	close(h.changed)
	h.changed = make(chan struct{})
	calls := h.calls
	h.calls = map[*call]struct{}{}
	h.mu.Unlock()
	h.log.Warn("etcd unreachable: refusing submissions until it answers", zap.Int("requests_cancelled", len(calls)), zap.Error(err))
	for c := range calls {
		c.cancel(err)
	}
	h.wake()
}

// setUp marks etcd up.
func (h *Health) setUp() {
	h.mu.Lock()
	if h.down == nil {
		h.mu.Unlock()
		return
	}
	downFor := h.now().Sub(h.since)
	h.down, h.since = nil, h.now()
	close(h.changed)
	h.changed = make(chan struct{})
	h.mu.Unlock()
	h.log.Info("etcd answers again: taking submissions", zap.Duration("down_for", downFor))
}

func (h *Health) wake() {
	select {
	case h.kick <- struct{}{}:
	default: // Run is already due to look
	}
}
