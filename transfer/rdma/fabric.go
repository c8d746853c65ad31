package rdma

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"go.uber.org/zap"
)

// Fabric is an in-memory stand-in for RDMA hardware, for tests of the code
// above this package: every Device opened on one Fabric registers Go memory
// in a shared table, and a READ posted on any of their queue pairs copies
// from the region its rkey names, in this process. Queue-pair states,
// completions, flushes and Close behave as the verbs path does; nothing
// crosses a network and no device is needed.
type Fabric struct {
	v *memVerbs
}

// NewFabric returns an empty fabric.
func NewFabric() *Fabric { return &Fabric{v: newMemVerbs()} }

// Open opens a Device on the fabric, as Open does on hardware.
func (f *Fabric) Open(cfg Config, log *zap.Logger) (*Device, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return newDevice(cfg, log, f.v, deviceLimits{}), nil
}

// ClosedQPs counts the queue pairs closed on the fabric so far.
func (f *Fabric) ClosedQPs() int {
	f.v.mu.Lock()
	defer f.v.mu.Unlock()
	return f.v.closedQPs
}

// memVerbs implements verbs in memory (see Fabric): memory regions are Go
// slices found by key, and a posted READ copies between them. Events
// records the order in which resources are released.
type memVerbs struct {
	mu        sync.Mutex // guards the fields below
	regions   map[uint32][]byte
	remote    map[uint32]bool // keys registered for remote read
	nextKey   uint32
	nextQPN   uint32
	events    []string
	closedQPs int

	// Behaviour of queue pairs created from now on.
	stall   bool  // hold completions until the QP is moved to ERR
	reverse bool  // complete each posted batch in reverse order
	failWR  int64 // complete this wr id with an error; -1: none
	postCap int   // accept at most this many WRs in total; 0: unlimited
	qps     []*memQP
}

func newMemVerbs() *memVerbs {
	return &memVerbs{regions: make(map[uint32][]byte), remote: make(map[uint32]bool), nextKey: 100, nextQPN: 0x10, failWR: -1}
}

func (f *memVerbs) name() string { return "fake0" }

func (f *memVerbs) regMR(buf []byte, remote bool) (region, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextKey++
	key := f.nextKey
	f.regions[key] = buf
	f.remote[key] = remote
	return region{
		addr: uint64(key) << 32, // a fake address space: one 4 GiB window per key
		lkey: key,
		rkey: key,
		dereg: func() error {
			f.mu.Lock()
			delete(f.regions, key)
			delete(f.remote, key)
			f.events = append(f.events, fmt.Sprintf("dereg %d", key))
			f.mu.Unlock()
			return nil
		},
	}, nil
}

// resolve returns the bytes of [addr, addr+n) in the region with key;
// with remote, only a region registered for remote read resolves.
func (f *memVerbs) resolve(key uint32, addr uint64, n int64, remote bool) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	buf, ok := f.regions[key]
	if !ok || addr>>32 != uint64(key) || remote && !f.remote[key] {
		return nil, false
	}
	off := int64(addr & (1<<32 - 1))
	if off+n > int64(len(buf)) {
		return nil, false
	}
	return buf[off : off+n], true
}

func (f *memVerbs) newQP(cfg Config) (queue, QPInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextQPN++
	q := &memQP{
		f: f, qpn: f.nextQPN, stall: f.stall, reverse: f.reverse, failWR: f.failWR, postCap: f.postCap,
		wake: make(chan struct{}, 1),
	}
	f.qps = append(f.qps, q)
	return q, QPInfo{LID: 1, QPN: q.qpn, MTU: 5, Port: cfg.Port}, nil
}

func (f *memVerbs) close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, "close device")
	return nil
}

type memQP struct {
	f       *memVerbs
	qpn     uint32
	stall   bool
	reverse bool
	failWR  int64
	postCap int
	wake    chan struct{}

	mu             sync.Mutex // guards the fields below
	mods           []Transition
	held           []uint64 // stalled WR ids
	ready          []completion
	outstanding    int
	maxOutstanding int
	posted         int
}

func (q *memQP) modify(t Transition) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.mods = append(q.mods, t)
	if t.To == StateError {
		for _, id := range q.held {
			q.ready = append(q.ready, completion{id: id, err: fmt.Errorf("%w: wr %d: WR flushed", ErrCompletion, id)})
		}
		q.held = nil
		q.signal()
	}
	return nil
}

func (q *memQP) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *memQP) post(t readTarget, wrs []WR) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var batch []completion
	for i, w := range wrs {
		if q.postCap > 0 && q.posted == q.postCap {
			q.ready = append(q.ready, reversed(batch, q.reverse)...)
			q.signal()
			return i, fmt.Errorf("send queue full")
		}
		q.posted++
		q.outstanding++
		q.maxOutstanding = max(q.maxOutstanding, q.outstanding)
		if q.stall {
			q.held = append(q.held, w.ID)
			continue
		}
		c := completion{id: w.ID}
		src, okR := q.f.resolve(t.rkey, w.RemoteAddr, w.Len, true)
		dst, okL := q.f.resolve(t.lkey, t.localBase+uint64(w.LocalOff), w.Len, false)
		switch {
		case int64(w.ID) == q.failWR:
			c.err = fmt.Errorf("%w: wr %d: remote operation error", ErrCompletion, w.ID)
		case !okR:
			c.err = fmt.Errorf("%w: wr %d: remote access error", ErrCompletion, w.ID)
		case !okL:
			c.err = fmt.Errorf("%w: wr %d: local protection error", ErrCompletion, w.ID)
		default:
			copy(dst, src)
		}
		batch = append(batch, c)
	}
	q.ready = append(q.ready, reversed(batch, q.reverse)...)
	q.signal()
	return len(wrs), nil
}

func reversed(cs []completion, rev bool) []completion {
	if rev {
		slices.Reverse(cs)
	}
	return cs
}

func (q *memQP) poll(ctx context.Context, out []completion) (int, error) {
	for {
		q.mu.Lock()
		if len(q.ready) > 0 {
			n := copy(out, q.ready)
			q.ready = q.ready[n:]
			q.outstanding -= n
			q.mu.Unlock()
			return n, nil
		}
		q.mu.Unlock()
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-q.wake:
		}
	}
}

func (q *memQP) close() error {
	q.f.mu.Lock()
	q.f.closedQPs++
	q.f.events = append(q.f.events, fmt.Sprintf("close qp %d", q.qpn))
	q.f.mu.Unlock()
	return nil
}

func (q *memQP) snapshot() (mods []Transition, maxOut, outstanding int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return slices.Clone(q.mods), q.maxOutstanding, q.outstanding
}
