package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"unsafe"

	"go.uber.org/zap"
)

var (
	// ErrNoDevice is returned (wrapped, with the reason) by Open when no RDMA
	// device can be used: the build lacks the rdma tag, no device is present,
	// the named device is missing or its port is not active. The caller falls
	// back to tcp.
	ErrNoDevice = errors.New("rdma: no RDMA device")
	// ErrClosed is returned for use of a closed Device, MR or QP.
	ErrClosed = errors.New("rdma: closed")
	// ErrBadConfig is returned (wrapped) by Config.Validate and Open.
	ErrBadConfig = errors.New("rdma: bad config")
	// ErrBadMessage is returned (wrapped) for a QPInfo or MemInfo that does not
	// decode or does not make sense.
	ErrBadMessage = errors.New("rdma: bad message")
	// ErrOutOfRange is returned (wrapped) for a read outside the local or the
	// remote region.
	ErrOutOfRange = errors.New("rdma: read out of range")
	// ErrNotConnected is returned by Read before Connect has succeeded.
	ErrNotConnected = errors.New("rdma: queue pair not connected")
	// ErrQPFailed wraps the error of a read that failed or was cancelled. The
	// queue pair is then in the error state for good: close it and connect a
	// new one.
	ErrQPFailed = errors.New("rdma: queue pair failed")
	// ErrCompletion is wrapped by a work completion with an error status; the
	// message carries the ibv_wc_status string.
	ErrCompletion = errors.New("rdma: work completion error")
)

// Available reports whether this build and host can use RDMA, and if not, why.
// It only enumerates devices; Open can still fail, for example on a port that
// is down.
func Available() (bool, string) {
	return available()
}

// verbs is what a Device needs from the verbs library; the cgo build
// implements it over libibverbs and tests use a loopback fake.
type verbs interface {
	name() string
	// regMR registers buf for local write and, with remote, remote read.
	regMR(buf []byte, remote bool) (region, error)
	// newQP creates an RC queue pair in RESET with its own completion queue
	// and completion channel. The QPInfo carries everything but the PSN.
	newQP(cfg Config) (queue, QPInfo, error)
	close() error
}

// region is a registered memory region.
type region struct {
	addr       uint64
	lkey, rkey uint32
	dereg      func() error
}

// queue is what a QP needs from a verbs queue pair.
type queue interface {
	modify(t Transition) error
	// post posts wrs as signalled RDMA READs and returns how many were posted.
	post(t readTarget, wrs []WR) (int, error)
	// poll waits, without spinning a core, until at least one completion is
	// available or ctx ends, and fills out with up to len(out) of them.
	poll(ctx context.Context, out []completion) (int, error)
	close() error
}

// readTarget is what a posted READ needs besides its WR.
type readTarget struct {
	localBase  uint64 // address of the local region; a WR lands at localBase+LocalOff
	lkey, rkey uint32
}

// completion is one work completion; err wraps ErrCompletion on a bad status.
type completion struct {
	id  uint64
	err error
}

// Device is an open RDMA device with its protection domain. It owns the memory
// regions and queue pairs made from it and closes them in Close.
type Device struct {
	cfg Config
	log *zap.Logger
	v   verbs

	mu     sync.Mutex // guards the fields below
	closed bool
	mrs    map[*MR]struct{}
	qps    map[*QP]struct{}
}

// Open opens the device cfg names (the first when cfg.Device is ""), checks
// that cfg.Port is active and allocates a protection domain. cfg is validated,
// copied and clamped to the device's limits. When RDMA cannot be used the
// error wraps ErrNoDevice. log may be nil.
func Open(cfg Config, log *zap.Logger) (*Device, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	v, lim, err := openVerbs(cfg)
	if err != nil {
		return nil, err
	}
	return newDevice(cfg, log, v, lim), nil
}

func newDevice(cfg Config, log *zap.Logger, v verbs, lim deviceLimits) *Device {
	if log == nil {
		log = zap.NewNop()
	}
	cfg = cfg.clampTo(lim)
	d := &Device{
		cfg: cfg,
		log: log.Named("rdma"),
		v:   v,
		mrs: make(map[*MR]struct{}),
		qps: make(map[*QP]struct{}),
	}
	d.log.Info("device open",
		zap.String("device", v.name()),
		zap.Uint8("port", cfg.Port),
		zap.Int("mtu", cfg.MTU),
		zap.Int("queue_depth", cfg.QueueDepth),
		zap.Int64("max_wr", cfg.MaxWR),
		zap.Int("read_atomic", cfg.ReadAtomic),
		zap.Stringer("poll", cfg.Poll))
	return d
}

// Config returns the device's configuration after clamping to its limits.
func (d *Device) Config() Config { return d.cfg }

// Name is the verbs device name.
func (d *Device) Name() string { return d.v.name() }

// RegisterMemory registers buf with the device for local write and remote
// read, so it can be the destination of Read and the source a peer reads.
//
// buf must not be Go heap memory: the NIC reads and writes it after this call
// returns, which the cgo pointer rules forbid for Go memory, and the Go
// garbage collector would not know the NIC still uses it. Pass memory mapped
// with mmap (the agent's arena) and keep it mapped until the MR is closed.
func (d *Device) RegisterMemory(buf []byte) (*MR, error) {
	return d.register(buf, true)
}

// RegisterLocal registers buf for local write only: the destination of
// Reads, which no peer can read through its rkey. The same rules on buf as
// for RegisterMemory apply.
func (d *Device) RegisterLocal(buf []byte) (*MR, error) {
	return d.register(buf, false)
}

func (d *Device) register(buf []byte, remote bool) (*MR, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("rdma: register empty buffer")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	reg, err := d.v.regMR(buf, remote)
	if err != nil {
		return nil, fmt.Errorf("rdma: register %d bytes at %p: %w", len(buf), unsafe.Pointer(unsafe.SliceData(buf)), err)
	}
	m := &MR{d: d, buf: buf, reg: reg}
	d.mrs[m] = struct{}{}
	return m, nil
}

// NewQP creates an RC queue pair in RESET. Send its Info to the peer over the
// control channel and pass the peer's to Connect.
func (d *Device) NewQP() (*QP, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	qv, info, err := d.v.newQP(d.cfg)
	if err != nil {
		return nil, fmt.Errorf("rdma: create queue pair: %w", err)
	}
	info.V = WireVersion
	info.PSN = rand.Uint32() & maxQPN
	if err := info.Validate(); err != nil {
		_ = qv.close()
		return nil, fmt.Errorf("rdma: local port cannot be addressed (gid index %d): %w", d.cfg.GIDIndex, err)
	}
	life, stop := context.WithCancel(context.Background())
	q := &QP{
		d:     d,
		cfg:   d.cfg,
		local: info,
		q:     qv,
		life:  life,
		stop:  stop,
		comps: make([]completion, d.cfg.QueueDepth),
	}
	d.qps[q] = struct{}{}
	return q, nil
}

// Close closes the device's queue pairs, then its memory regions, then the
// protection domain and the device. It waits for in-flight reads, which it
// cancels. Close is idempotent.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	qps := make([]*QP, 0, len(d.qps))
	for q := range d.qps {
		qps = append(qps, q)
	}
	mrs := make([]*MR, 0, len(d.mrs))
	for m := range d.mrs {
		mrs = append(mrs, m)
	}
	d.mu.Unlock()

	var errs []error
	for _, q := range qps {
		errs = append(errs, q.Close())
	}
	for _, m := range mrs {
		errs = append(errs, m.Close())
	}
	errs = append(errs, d.v.close())
	return errors.Join(errs...)
}

func (d *Device) forgetMR(m *MR) {
	d.mu.Lock()
	delete(d.mrs, m)
	d.mu.Unlock()
}

func (d *Device) forgetQP(q *QP) {
	d.mu.Lock()
	delete(d.qps, q)
	d.mu.Unlock()
}

// MR is a registered memory region.
type MR struct {
	d   *Device
	buf []byte
	reg region

	mu     sync.RWMutex // held shared by each Read into the region, exclusively by Close
	closed bool
}

// Bytes is the registered memory.
func (m *MR) Bytes() []byte { return m.buf }

// Len is the length of the region in bytes.
func (m *MR) Len() int64 { return int64(len(m.buf)) }

// MemInfo is what a peer needs to read this region: send it in the ticket.
func (m *MR) MemInfo() MemInfo {
	return MemInfo{Addr: m.reg.addr, RKey: m.reg.rkey, Len: uint64(len(m.buf))}
}

// Close deregisters the region, waiting for reads into it to finish. Peers
// reading it from then on get a remote access error. Close is idempotent.
func (m *MR) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	err := m.reg.dereg()
	m.mu.Unlock()
	m.d.forgetMR(m)
	if err != nil {
		return fmt.Errorf("rdma: deregister memory: %w", err)
	}
	return nil
}

// QP is a reliable-connected queue pair with its own completion queue. Reads
// on one QP run one at a time; use several QPs for parallel reads.
type QP struct {
	d     *Device
	cfg   Config
	local QPInfo
	q     queue
	life  context.Context // cancelled by Close to abort an in-flight Read
	stop  context.CancelFunc

	mu     sync.Mutex // serialises Connect, Read and Close; guards the fields below
	state  QPState
	failed error
	closed bool
	comps  []completion
}

// Info is this queue pair's half of the connection exchange.
func (q *QP) Info() QPInfo { return q.local }

// Connect moves the queue pair from RESET through INIT and RTR to RTS,
// connected to the peer that sent remote. If a step fails the queue pair is
// unusable; close it.
func (q *QP) Connect(remote QPInfo) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return ErrClosed
	}
	if q.state != StateReset || q.failed != nil {
		return fmt.Errorf("rdma: connect: queue pair is %v, want %v", q.state, StateReset)
	}
	ts, err := Transitions(q.cfg, q.local, remote)
	if err != nil {
		return err
	}
	for _, t := range ts {
		if err := q.q.modify(t); err != nil {
			q.failed = fmt.Errorf("rdma: modify queue pair %v -> %v: %w", t.From, t.To, err)
			return q.failed
		}
		q.state = t.To
	}
	return nil
}

// Read reads n bytes at remoteOff of the peer's region remote into local at
// localOff with one-sided RDMA READs, and returns when all have landed.
//
// On failure or cancellation the queue pair is moved to the error state and
// Read waits (at most Config.DrainTimeout) until the NIC has given back every
// posted work request, so local is no longer written once Read returns. The
// error then wraps ErrQPFailed and the cause; the queue pair must be replaced.
func (q *QP) Read(ctx context.Context, local *MR, localOff int64, remote MemInfo, remoteOff, n int64) error {
	return q.ReadChunks(ctx, local, localOff, remote, remoteOff, n, 0, nil)
}

// ReadChunks is Read for a payload of chunks of chunkLen bytes (the last may
// be shorter; <= 0 means one chunk): onChunk, when not nil, is called with
// chunk k as soon as its bytes have landed, in completion order, before
// ReadChunks returns. onChunk runs on the reading goroutine and must not call
// into q.
func (q *QP) ReadChunks(ctx context.Context, local *MR, localOff int64, remote MemInfo, remoteOff, n, chunkLen int64, onChunk func(k int)) error {
	if local == nil {
		return fmt.Errorf("rdma: read into nil memory region")
	}
	local.mu.RLock()
	defer local.mu.RUnlock()
	if local.closed {
		return fmt.Errorf("rdma: read into closed memory region: %w", ErrClosed)
	}
	if local.d != q.d {
		return fmt.Errorf("rdma: memory region registered with another device")
	}
	if err := checkRead(local.Len(), localOff, remote, remoteOff, n); err != nil {
		return err
	}

	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.closed:
		return ErrClosed
	case q.failed != nil:
		return fmt.Errorf("%w: %w", ErrQPFailed, q.failed)
	case q.state != StateRTS:
		return fmt.Errorf("%w: state %v", ErrNotConnected, q.state)
	}
	wrs := PlanChunks(remote.Addr+uint64(remoteOff), localOff, n, q.cfg.MaxWR, chunkLen)
	tr, err := NewTracker(wrs, chunkLen, q.cfg.QueueDepth)
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(q.life, func() { cancel(ErrClosed) })
	defer stop()

	t := readTarget{localBase: local.reg.addr, lkey: local.reg.lkey, rkey: remote.RKey}
	if err := q.driveLocked(rctx, t, tr, onChunk); err != nil {
		q.failed = err
		return fmt.Errorf("%w: %w", ErrQPFailed, err)
	}
	return nil
}

// driveLocked posts the tracker's work requests, keeping the queue full, and
// consumes completions until every request has completed or one fails.
func (q *QP) driveLocked(ctx context.Context, t readTarget, tr *Tracker, onChunk func(int)) error {
	var failure error
	for failure == nil && !tr.Done() {
		if batch := tr.Postable(); len(batch) > 0 {
			k, err := q.q.post(t, batch)
			tr.Posted(k)
			if err != nil {
				failure = fmt.Errorf("rdma: post work requests (%d of %d posted): %w", k, len(batch), err)
				break
			}
		}
		n, err := q.q.poll(ctx, q.comps)
		if err != nil {
			if ctx.Err() != nil {
				err = context.Cause(ctx)
			}
			failure = err
			break
		}
		for _, c := range q.comps[:n] {
			landed, err := tr.Complete(c.id)
			if failure == nil {
				failure = errors.Join(c.err, err)
			}
			if failure == nil && onChunk != nil {
				for _, k := range landed {
					onChunk(k)
				}
			}
		}
	}
	if failure == nil {
		return nil
	}
	return q.abortLocked(failure, tr)
}

// abortLocked moves the queue pair to ERR, which makes the NIC flush every
// outstanding work request, and waits for those completions so no READ can
// land in the local region after the caller's Read has returned.
func (q *QP) abortLocked(failure error, tr *Tracker) error {
	if err := q.q.modify(errorTransition(q.state)); err != nil {
		failure = errors.Join(failure, fmt.Errorf("rdma: move queue pair to error: %w", err))
	}
	q.state = StateError
	ctx, cancel := context.WithTimeout(context.Background(), q.cfg.DrainTimeout)
	defer cancel()
	for tr.Outstanding() > 0 {
		n, err := q.q.poll(ctx, q.comps)
		if err != nil {
			q.d.log.Error("work requests not flushed",
				zap.Int("outstanding", tr.Outstanding()),
				zap.Duration("waited", q.cfg.DrainTimeout),
				zap.Error(err))
			return errors.Join(failure, fmt.Errorf("rdma: %d work requests still outstanding after %v: %w",
				tr.Outstanding(), q.cfg.DrainTimeout, err))
		}
		for _, c := range q.comps[:n] {
			_, _ = tr.Complete(c.id) // flushed: the status is WR_FLUSH_ERR
		}
	}
	return failure
}

// Close destroys the queue pair and its completion queue, cancelling and
// waiting for an in-flight Read. Close is idempotent.
func (q *QP) Close() error {
	q.stop()
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return nil
	}
	q.closed = true
	err := q.q.close()
	q.mu.Unlock()
	q.d.forgetQP(q)
	if err != nil {
		return fmt.Errorf("rdma: destroy queue pair: %w", err)
	}
	return nil
}

// checkRead validates a read of n bytes into a local region of localLen bytes
// at localOff, from remote at remoteOff.
func checkRead(localLen, localOff int64, remote MemInfo, remoteOff, n int64) error {
	if err := remote.Validate(); err != nil {
		return err
	}
	switch {
	case n <= 0:
		return fmt.Errorf("%w: length %d", ErrOutOfRange, n)
	case localOff < 0 || localOff > localLen || n > localLen-localOff:
		return fmt.Errorf("%w: local [%d, +%d) of %d bytes", ErrOutOfRange, localOff, n, localLen)
	case remoteOff < 0 || uint64(remoteOff) > remote.Len || uint64(n) > remote.Len-uint64(remoteOff):
		return fmt.Errorf("%w: remote [%d, +%d) of %d bytes", ErrOutOfRange, remoteOff, n, remote.Len)
	}
	return nil
}
