package transfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	ma "github.com/multiformats/go-multiaddr"
	"github.com/zeebo/xxh3"
	"go.uber.org/zap"
)

// Chunk is one chunk of a payload that has landed in the destination buffer.
// Data is a view into that buffer, not a copy.
type Chunk struct {
	Index int
	Data  []byte
	// Sums are the block checksums Data was verified against as it
	// landed (tcp with Config.ChecksumTCP), one per 256 KiB block; nil
	// when the chunk came without them (shm, rdma, this service's own
	// payload, or a range the producer could not checksum). A copy
	// published again hands them to Pending.ChunkCopied so that it is
	// not hashed twice.
	Sums []uint64
}

// ChunkPull is a pull in progress that yields chunks as they land.
type ChunkPull struct {
	ch   chan Chunk
	done chan struct{}
	err  error // written before done is closed
}

// Chunks yields each chunk once, in the order chunks land (roughly index
// order; striping may interleave neighbours). It is closed when the pull ends.
// It is buffered for every chunk, so a slow reader never stalls the pull.
func (p *ChunkPull) Chunks() <-chan Chunk { return p.ch }

// Wait blocks until the pull ends and returns its error. A chunk yielded
// before an error is intact: it passed its own checksum when it had one.
func (p *ChunkPull) Wait() error {
	<-p.done
	return p.err
}

// Pull fetches a payload into a fresh heap buffer. When this service is the
// producer of a payload held on the heap it returns the published buffer
// itself, which must not be modified; one held in the arena is copied.
func (s *Service) Pull(ctx context.Context, ref Ref) ([]byte, error) {
	if err := ref.Meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return nil, err
	}
	if !s.enter() { // Close waits for us before it unmaps what we copy from
		return nil, ErrClosed
	}
	defer s.wg.Done()
	if ref.Producer.PeerID == s.self.String() {
		return s.pullLocal(ctx, ref, nil, nil)
	}
	dst := make([]byte, ref.Meta.Bytes())
	if err := s.pull(ctx, ref, dst, nil); err != nil {
		return nil, err
	}
	return dst, nil
}

// PullInto fetches a payload into dst, which must be exactly
// ref.Meta.Bytes() long. On error dst holds unspecified bytes.
func (s *Service) PullInto(ctx context.Context, ref Ref, dst []byte) error {
	if err := s.checkDst(ref, dst); err != nil {
		return err
	}
	if !s.enter() { // Close waits for us before it unmaps what we copy from
		return ErrClosed
	}
	defer s.wg.Done()
	if ref.Producer.PeerID == s.self.String() {
		_, err := s.pullLocal(ctx, ref, dst, nil)
		return err
	}
	return s.pull(ctx, ref, dst, nil)
}

// BlockSums are the block checksums a pull received with a payload's bytes,
// per chunk (nil for a chunk that came without them: over shm, or from a
// range the producer could not checksum). PublishCopy takes them so a copy
// need not be hashed again.
type BlockSums [][]uint64

// sumSinkKey carries a *sumSink in a pull's context.
type sumSinkKey struct{}

// sumSink collects the block checksums a tcp pull verified.
type sumSink struct {
	mu sync.Mutex
	// mu guards the fields below.
	sums   BlockSums
	filled []int // per chunk, the blocks whose checksums were put
}

func newSumSink(meta TensorMeta) *sumSink {
	n := max(meta.Chunks(), 1)
	return &sumSink{sums: make(BlockSums, n), filled: make([]int, n)}
}

// put records the checksums of span sp (block-aligned within its chunk).
func (k *sumSink) put(meta TensorMeta, sp span, sums []uint64) {
	_, cs := meta.ChunkRange(0)
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.sums[sp.chunk] == nil {
		k.sums[sp.chunk] = make([]uint64, (cs+sumBlock-1)/sumBlock)
	}
	k.filled[sp.chunk] += copy(k.sums[sp.chunk][(sp.off-int64(sp.chunk)*cs)/sumBlock:], sums)
}

// chunk returns chunk c's checksums when every block of it was verified,
// else nil.
func (k *sumSink) chunk(c int) []uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.sums[c] == nil || k.filled[c] != len(k.sums[c]) {
		return nil
	}
	return k.sums[c]
}

// all returns the checksums of every chunk, nil for a chunk not wholly
// verified.
func (k *sumSink) all() BlockSums {
	k.mu.Lock()
	defer k.mu.Unlock()
	for c := range k.sums {
		if k.filled[c] != len(k.sums[c]) {
			k.sums[c] = nil
		}
	}
	return k.sums
}

// PullCopy is PullInto for a payload that will be published again with
// PublishCopy (a Store copy): it also returns the block checksums that came
// with the bytes, so the copy is not hashed again before it is served.
func (s *Service) PullCopy(ctx context.Context, ref Ref, dst []byte) (BlockSums, error) {
	sink := newSumSink(ref.Meta)
	if err := s.PullInto(context.WithValue(ctx, sumSinkKey{}, sink), ref, dst); err != nil {
		return nil, err
	}
	return sink.all(), nil
}

// PullChunks starts fetching a payload into dst and yields each chunk as it
// lands, so work can start on chunk 0 while later chunks are still being
// produced or transferred. Cancel ctx to abandon the pull.
func (s *Service) PullChunks(ctx context.Context, ref Ref, dst []byte) (*ChunkPull, error) {
	if err := s.checkDst(ref, dst); err != nil {
		return nil, err
	}
	if !s.enter() {
		return nil, ErrClosed
	}
	p := &ChunkPull{ch: make(chan Chunk, ref.Meta.Chunks()), done: make(chan struct{})}
	sink := newSumSink(ref.Meta) // what a tcp pull verified, handed on with each chunk
	ctx = context.WithValue(ctx, sumSinkKey{}, sink)
	onChunk := func(k int) {
		off, n := ref.Meta.ChunkRange(k)
		p.ch <- Chunk{Index: k, Data: dst[off : off+n], Sums: sink.chunk(k)}
	}
	go func() {
		defer s.wg.Done()
		if ref.Producer.PeerID == s.self.String() {
			_, p.err = s.pullLocal(ctx, ref, dst, onChunk)
		} else {
			p.err = s.pull(ctx, ref, dst, onChunk)
		}
		close(p.ch)
		close(p.done)
	}()
	return p, nil
}

func (s *Service) checkDst(ref Ref, dst []byte) error {
	if err := ref.Meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return err
	}
	if int64(len(dst)) != ref.Meta.Bytes() {
		return fmt.Errorf("%w: %d bytes for a %d-byte payload", ErrBufferSize, len(dst), ref.Meta.Bytes())
	}
	return nil
}

// pullLocal serves a pull of our own payload without a network hop: with dst
// nil it returns the published buffer (a heap copy of it when it lives in the
// arena, which Release may reuse), else it copies into dst.
func (s *Service) pullLocal(ctx context.Context, ref Ref, dst []byte, onChunk func(int)) ([]byte, error) {
	start := time.Now()
	e := s.reg.get(ref.ID)
	if e == nil {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, ref.ID)
	}
	if e.meta.Bytes() != ref.Meta.Bytes() || e.meta.Chunks() != ref.Meta.Chunks() {
		return nil, fmt.Errorf("%w: ref meta does not match payload %s", ErrBadMeta, ref.ID)
	}
	if err := e.pin(); err != nil {
		return nil, err
	}
	defer e.unpin()
	if dst == nil && e.owner != nil {
		dst = make([]byte, len(e.buf))
	}
	for k := range e.ready {
		off, n := e.meta.ChunkRange(k)
		if err := e.waitRange(ctx, s.stop, off, n); err != nil {
			return nil, err
		}
		if dst != nil {
			copy(dst[off:off+n], e.buf[off:off+n])
		}
		if onChunk != nil {
			onChunk(k)
		}
	}
	s.countPull(ctx, TransportLocal, e.meta.Bytes(), start)
	if dst == nil {
		return e.buf, nil
	}
	return dst, nil
}

// span is one byte range a pull requests, inside chunk chunk.
type span struct {
	off, n int64
	chunk  int
}

// plan splits a payload into the ranges requested, in order: each chunk (the
// whole payload when it is not chunked) into up to Conns stripes of at least
// MinStripe bytes, aligned to sumBlock so the producer can send the block
// checksums. Workers take spans in order, so the stripes of chunk 0 travel in
// parallel and chunk 0 lands first.
func (s *Service) plan(meta TensorMeta) []span {
	nc := meta.Chunks()
	_, cs := meta.ChunkRange(0)
	stripes := int64(s.cfg.Conns)
	if lim := (cs + s.cfg.MinStripe - 1) / s.cfg.MinStripe; lim < stripes {
		stripes = lim
	}
	stripes = max(stripes, 1)
	step := max((cs/stripes+sumBlock-1)/sumBlock*sumBlock, sumBlock)
	out := make([]span, 0, int64(nc)*((cs+step-1)/step))
	for k := range nc {
		base := int64(k) * cs
		for o := int64(0); o < cs; o += step {
			out = append(out, span{off: base + o, n: min(step, cs-o), chunk: k})
		}
	}
	return out
}

// pull fetches ref from a remote producer into dst over the transport
// TransportFor picks.
func (s *Service) pull(ctx context.Context, ref Ref, dst []byte, onChunk func(int)) error {
	if s.isClosed() {
		return ErrClosed
	}
	start := time.Now()
	pid, err := peer.Decode(ref.Producer.PeerID)
	if err != nil {
		return fmt.Errorf("%w: producer peer id %q: %v", ErrBadMeta, ref.Producer.PeerID, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.life, cancel)()

	t, err := s.transportFor(ref)
	if err != nil {
		return err
	}
	switch t {
	case TransportShm:
		err = s.pullShm(ctx, pid, ref, dst, onChunk)
	case TransportRDMA:
		err = s.pullRDMA(ctx, pid, ref, dst, onChunk)
	default:
		t, err = TransportTCP, s.pullTCP(ctx, pid, ref, dst, onChunk)
	}
	var fb *fallbackError
	if errors.As(err, &fb) {
		if s.cfg.Transport != TransportAuto {
			return fb.err
		}
		s.log.Debug("transport fallback to tcp", zap.String("transport", t), zap.String("payload", ref.ID), zap.Error(fb.err))
		t, err = TransportTCP, s.pullTCP(ctx, pid, ref, dst, onChunk)
	}
	if err == nil {
		s.countPull(ctx, t, ref.Meta.Bytes(), start)
	}
	return err
}

// storePullKey marks a context whose pulls serve the Store (copies,
// re-replication, reads of stored files): Stats counts them apart from the
// pulls that hand payloads between stages.
type storePullKey struct{}

// ForStore returns ctx marked so that pulls made with it are counted in
// Stats.StorePulls instead of Stats.Pulls.
func ForStore(ctx context.Context) context.Context {
	return context.WithValue(ctx, storePullKey{}, true)
}

type pullObserverKey struct{}

// WithPullObserver returns ctx marked so that each pull made with it that
// completes calls f with the transport that carried it ("local", "shm",
// "rdma", "tcp"): a task's stage record names how its input came.
func WithPullObserver(ctx context.Context, f func(transport string)) context.Context {
	return context.WithValue(ctx, pullObserverKey{}, f)
}

// countPull counts a completed pull of n bytes that began at start.
func (s *Service) countPull(ctx context.Context, transport string, n int64, start time.Time) {
	if f, ok := ctx.Value(pullObserverKey{}).(func(string)); ok {
		f(transport)
	}
	if ctx.Value(storePullKey{}) != nil {
		s.storePulls.add(transport, n, time.Since(start))
		return
	}
	s.pulls.add(transport, n, time.Since(start))
}

// fallbackError is a transport failing before any byte moved, in a way tcp
// may not (the payload or the destination is outside an arena, the shm
// socket or queue pair cannot be set up): auto mode then pulls by tcp.
type fallbackError struct{ err error }

func (e *fallbackError) Error() string { return e.err.Error() }
func (e *fallbackError) Unwrap() error { return e.err }

// pullTCP fetches ref into dst, striping spans over pooled connections and
// verifying each block's checksum as it lands.
func (s *Service) pullTCP(ctx context.Context, pid peer.ID, ref Ref, dst []byte, onChunk func(int)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tk := &ticketHolder{s: s, pid: pid, ref: ref}
	resp := s.issuedFor(ctx, ref, false) // the producer waits for each range, ready or not
	if resp != nil {
		tk.ticket, tk.issued = resp.Ticket, resp.Ticket
	} else {
		var err error
		if resp, err = tk.fetch(ctx); err != nil {
			return err
		}
	}
	if resp.Meta.Bytes() != ref.Meta.Bytes() || resp.Meta.Chunks() != ref.Meta.Chunks() {
		return fmt.Errorf("%w: producer meta %v does not match ref %v", ErrBadMeta, resp.Meta, ref.Meta)
	}
	if s.cfg.ChecksumTCP && ref.Checksum != 0 && resp.Checksum != 0 && resp.Checksum != ref.Checksum {
		return fmt.Errorf("%w: payload %s: producer holds checksum %x, ref says %x", ErrCorrupt, ref.ID, resp.Checksum, ref.Checksum)
	}
	addr := resp.DataAddr

	spans := s.plan(ref.Meta)
	nc := ref.Meta.Chunks()
	// left[k] counts the spans of chunk k still to land; unverified[k] is
	// set when one of them came without block checksums.
	left := make([]atomic.Int32, nc)
	unverified := make([]atomic.Bool, nc)
	for _, sp := range spans {
		left[sp.chunk].Add(1)
	}
	needWhole := s.cfg.ChecksumTCP && ref.Checksum != 0
	sink, _ := ctx.Value(sumSinkKey{}).(*sumSink) // PullCopy wants the checksums
	var deferred atomic.Bool                      // some chunk waits for the whole-payload checksum
	workers := min(s.cfg.Conns, len(spans))
	var next atomic.Int64
	var firstErr error
	var errOnce sync.Once
	work := func() {
		var c *dataConn
		defer func() {
			if c != nil {
				s.pool.put(c)
			}
		}()
		for {
			i := int(next.Add(1) - 1)
			if i >= len(spans) || ctx.Err() != nil {
				return
			}
			sp := spans[i]
			var err error
			var verified bool
			c, verified, err = s.fetchSpan(ctx, c, addr, pid, tk, sp, dst)
			if err != nil {
				errOnce.Do(func() { firstErr = err; cancel() })
				return
			}
			if !verified && s.cfg.ChecksumTCP {
				unverified[sp.chunk].Store(true)
			}
			if verified && sink != nil && c.sumsBlock == sumBlock {
				sink.put(ref.Meta, sp, c.sumsSeen)
			}
			if left[sp.chunk].Add(-1) != 0 || onChunk == nil {
				continue
			}
			if unverified[sp.chunk].Load() && needWhole {
				deferred.Store(true)
				continue
			}
			onChunk(sp.chunk)
		}
	}
	if workers == 1 {
		work()
	} else {
		var wg sync.WaitGroup
		for range workers {
			wg.Go(work)
		}
		wg.Wait()
	}
	if firstErr != nil {
		return firstErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	anyUnverified := false
	for k := range unverified {
		anyUnverified = anyUnverified || unverified[k].Load()
	}
	if needWhole && anyUnverified {
		if got := xxh3.Hash(dst); got != ref.Checksum {
			return fmt.Errorf("%w: payload %s checksum %x, want %x", ErrCorrupt, ref.ID, got, ref.Checksum)
		}
	}
	if deferred.Load() {
		for k := range unverified {
			if unverified[k].Load() {
				onChunk(k)
			}
		}
	}
	return nil
}

// fetchSpan fetches one span on c (dialling when c is nil) and returns the
// connection to keep using, or nil when it was discarded. A pooled connection
// the producer has since closed, and an expired ticket, are each retried once.
func (s *Service) fetchSpan(ctx context.Context, c *dataConn, addr string, pid peer.ID, tk *ticketHolder, sp span, dst []byte) (*dataConn, bool, error) {
	retriedConn, retriedTicket := false, false
	for {
		reused := c != nil && c.used
		if c == nil {
			var err error
			if c, reused, err = s.pool.get(ctx, addr, pid); err != nil {
				return nil, false, err
			}
		}
		t := tk.current()
		started, verified, err := s.fetch(ctx, c, t, sp.off, dst[sp.off:sp.off+sp.n])
		if err == nil {
			c.used = true
			return c, verified, nil
		}
		// After an error the stream is in an unknown state, or the producer
		// has closed it (remote errors): never reuse it.
		s.pool.discard(c)
		c = nil
		var re *RemoteError
		remote := errors.As(err, &re)
		switch {
		case ctx.Err() != nil:
			return nil, false, fmt.Errorf("transfer: pull %s: %w", tk.ref.ID, ctx.Err())
		case remote && (errors.Is(err, ErrTicketExpired) || tk.wasIssued(t)) && !retriedTicket:
			// An issued ticket refused for any reason (expired, a restarted
			// producer's, another consumer's) is replaced by one asked for.
			retriedTicket = true
			if _, err := tk.refresh(ctx, t); err != nil {
				return nil, false, err
			}
		case !remote && !started && reused && !retriedConn:
			retriedConn = true
		default:
			return nil, false, err
		}
	}
}

// fetch sends one request on c and reads the answer into dst, verifying
// each block against its checksum as it lands when the producer sent them
// (verified then reports it). started reports whether the producer had begun
// answering, after which c is unusable on error.
func (s *Service) fetch(ctx context.Context, c *dataConn, t []byte, off int64, dst []byte) (started, verified bool, err error) {
	stop := context.AfterFunc(ctx, c.cancel)
	defer stop()
	c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
	c.wbuf = appendRequest(c.wbuf[:0], request{Offset: uint64(off), Length: uint64(len(dst)), Ticket: t})
	if _, err := c.Write(c.wbuf); err != nil {
		return false, false, fmt.Errorf("%w: %s: write request: %w", ErrUnreachable, c.addr, err)
	}
	for {
		if _, err := io.ReadFull(c, c.rbuf[:1]); err != nil {
			return false, false, fmt.Errorf("%w: %s: read status: %w", ErrUnreachable, c.addr, err)
		}
		switch c.rbuf[0] {
		case statusWait:
			c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
			continue
		case statusErr:
			return false, false, readErrStatus(c)
		case statusOK:
		default:
			return true, false, fmt.Errorf("%w: status byte %d", ErrProtocol, c.rbuf[0])
		}
		break
	}
	block, sums, err := c.readSums(int64(len(dst)))
	if err != nil {
		return true, false, err
	}
	check := s.cfg.ChecksumTCP && len(sums) > 0
	if len(sums) == 0 {
		block = ioBlock
	}
	dl := deadline{set: c.setDeadline, timeout: s.cfg.IOTimeout}
	// Read pieces of several blocks (fewer syscalls and window-update
	// ACKs than block-sized reads), then verify each block while it is in cache.
	piece := max(block, readPiece/block*block)
	for got := int64(0); got < int64(len(dst)); {
		k := min(int64(len(dst))-got, piece)
		dl.progress()
		b := dst[got : got+k]
		if _, err := io.ReadFull(c, b); err != nil {
			return true, false, c.midStream(fmt.Sprintf("read at %d of %d bytes", got, len(dst)), err)
		}
		for bo := int64(0); check && bo < k; bo += block {
			i := (got + bo) / block
			if x := xxh3.Hash(b[bo:min(k, bo+block)]); x != sums[i] {
				return true, false, fmt.Errorf("%w: range at %d: block at %d: checksum %x, want %x", ErrCorrupt, off, got+bo, x, sums[i])
			}
		}
		got += k
	}
	if check {
		c.sumsSeen, c.sumsBlock = sums, block
	}
	return true, check, nil
}

// readPiece is how many bytes one read asks for: four checksum blocks. Reads
// of one 256 KiB block cost about 11% more CPU per pull (more recvmsg calls
// and window-update ACKs; measured with /usr/bin/time over 50 pulls of 64 MiB
// in one process); 4 MiB pieces spill out of L2 before the checksum pass.
const readPiece = 4 * sumBlock

// midStream classifies a read that failed after the producer began to
// answer: a producer that went silent until the deadline is unreachable (a
// partition, a hung host); a connection closed or reset mid-payload is a
// short transfer, ErrCorrupt. Either way the task retries.
func (c *dataConn) midStream(what string, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w: %s: silent during %s: %w", ErrUnreachable, c.addr, what, err)
	}
	return fmt.Errorf("%w: %s: short transfer: %s: %w", ErrCorrupt, c.addr, what, unexpected(err))
}

// readSums reads the block size and block checksums that follow statusOK for
// a range of n bytes. They alias c's buffer until the next call.
func (c *dataConn) readSums(n int64) (int64, []uint64, error) {
	if _, err := io.ReadFull(c, c.rbuf[:8]); err != nil {
		return 0, nil, c.midStream("read checksum header", err)
	}
	block := int64(binary.BigEndian.Uint32(c.rbuf[:4]))
	count := int64(binary.BigEndian.Uint32(c.rbuf[4:8]))
	if count == 0 {
		return 0, nil, nil
	}
	if block < minSumBlock || block > maxSumBlock || count != (n+block-1)/block {
		return 0, nil, fmt.Errorf("%w: %d checksums of %d-byte blocks for %d bytes", ErrProtocol, count, block, n)
	}
	if int64(cap(c.sumBuf)) < 8*count {
		c.sumBuf = make([]byte, 8*count)
		c.sums = make([]uint64, count)
	}
	raw := c.sumBuf[:8*count]
	if _, err := io.ReadFull(c, raw); err != nil {
		return 0, nil, c.midStream("read checksums", err)
	}
	sums := c.sums[:count]
	for i := range sums {
		sums[i] = binary.BigEndian.Uint64(raw[8*i:])
	}
	return block, sums, nil
}

// ticketHolder is the ticket a pull's stripes share, refreshed at most once
// per expiry by whichever stripe sees it expire first.
type ticketHolder struct {
	s   *Service
	pid peer.ID
	ref Ref

	mu sync.Mutex
	// mu guards the fields below.
	ticket []byte
	issued []byte // the ticket the producer issued ahead, if the pull began with one
}

// wasIssued reports whether t is the ticket the producer issued ahead.
func (t *ticketHolder) wasIssued(ticket []byte) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.issued != nil && bytes.Equal(t.issued, ticket)
}

func (t *ticketHolder) current() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ticket
}

func (t *ticketHolder) fetch(ctx context.Context) (*TicketResponse, error) {
	resp, err := t.s.requestTicket(ctx, t.pid, t.ref)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.ticket = resp.Ticket
	t.mu.Unlock()
	return resp, nil
}

// refresh replaces the ticket unless another stripe already replaced old.
func (t *ticketHolder) refresh(ctx context.Context, old []byte) ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if string(t.ticket) != string(old) {
		return t.ticket, nil
	}
	resp, err := t.s.requestTicket(ctx, t.pid, t.ref)
	if err != nil {
		return nil, err
	}
	t.ticket = resp.Ticket
	return t.ticket, nil
}

// requestTicket asks the producer for a ticket over the control channel.
func (s *Service) requestTicket(ctx context.Context, pid peer.ID, ref Ref) (*TicketResponse, error) {
	str, resp, err := s.requestTicketStream(ctx, pid, ref, false)
	if err != nil {
		return nil, err
	}
	str.close()
	return resp, nil
}

// ctlStream is a control stream kept open after the ticket response to read
// chunk events on.
type ctlStream struct {
	s    *Service
	str  network.Stream
	stop func() bool // ends the reset-on-cancel hook
}

func (c *ctlStream) readEvent(ev *ChunkEvent) error {
	c.str.SetDeadline(time.Now().Add(c.s.cfg.IOTimeout))
	return ReadFrame(c.str, c.s.cfg.MaxFrame, ev)
}

func (c *ctlStream) close() {
	c.stop()
	c.str.Close()
}

// requestTicketStream asks the producer for a ticket, and with watch for
// chunk events after it, which the caller reads from the returned stream and
// then closes it.
func (s *Service) requestTicketStream(ctx context.Context, pid peer.ID, ref Ref, watch bool) (*ctlStream, *TicketResponse, error) {
	proof, err := ticketProof(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("transfer: ticket for %s: proof: %w", ref.ID, err)
	}
	if len(ref.Producer.P2PAddrs) > 0 {
		addrs := make([]ma.Multiaddr, 0, len(ref.Producer.P2PAddrs))
		for _, a := range ref.Producer.P2PAddrs {
			m, err := ma.NewMultiaddr(a)
			if err != nil {
				s.log.Debug("bad producer addr", zap.String("addr", a), zap.Error(err))
				continue
			}
			addrs = append(addrs, m)
		}
		s.h.Peerstore().AddAddrs(pid, addrs, peerstore.TempAddrTTL)
	}
	unreachable := func(what string, err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("transfer: ticket for %s: %w", ref.ID, ctx.Err())
		}
		return fmt.Errorf("%w: %s: %s: %w", ErrUnreachable, pid, what, err)
	}
	str, err := s.h.NewStream(ctx, pid, ProtocolID)
	if err != nil {
		return nil, nil, unreachable("open stream", err)
	}
	c := &ctlStream{s: s, str: str, stop: context.AfterFunc(ctx, func() { str.Reset() })}
	ok := false
	defer func() {
		if !ok {
			c.stop()
			str.Reset()
		}
	}()
	str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	if err := WriteFrame(str, &TicketRequest{V: WireVersion, PayloadID: ref.ID, Watch: watch, Proof: proof}); err != nil {
		return nil, nil, unreachable("write ticket request", err)
	}
	str.CloseWrite()
	var resp TicketResponse
	if err := ReadFrame(str, s.cfg.MaxFrame, &resp); err != nil {
		if errors.Is(err, ErrProtocol) || errors.Is(err, ErrVersion) || errors.Is(err, ErrFrameTooLarge) || errors.Is(err, ErrBadMeta) {
			return nil, nil, fmt.Errorf("transfer: ticket response from %s: %w", pid, err)
		}
		return nil, nil, unreachable("read ticket response", err)
	}
	if resp.ErrCode != "" {
		return nil, nil, &RemoteError{Code: resp.ErrCode, Msg: resp.ErrMsg}
	}
	ok = true
	return c, &resp, nil
}

// dataConn is a consumer-side data-plane connection to one producer.
type dataConn struct {
	net.Conn
	key  string // pool key: producer peer id and address
	addr string
	used bool // has completed at least one request

	rbuf   [8]byte
	wbuf   []byte
	sumBuf []byte   // block checksums as read, reused across requests
	sums   []uint64 // decoded, reused
	// sumsSeen are the checksums the last verified range came with (a view
	// of sums), in blocks of sumsBlock bytes, for PullCopy.
	sumsSeen  []uint64
	sumsBlock int64

	mu sync.Mutex
	// mu guards the field below.
	cancelled bool
}

// setDeadline sets the connection's deadline unless a cancel has already
// forced it into the past.
func (c *dataConn) setDeadline(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cancelled {
		return
	}
	c.Conn.SetDeadline(t)
}

// cancel unblocks any I/O on c for good; c must then be discarded.
func (c *dataConn) cancel() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cancelled = true
	c.Conn.SetDeadline(time.Unix(1, 0))
}

// connPool keeps up to Conns idle connections per producer, so repeated pulls
// skip the dial and the handshake.
type connPool struct {
	s *Service

	mu sync.Mutex
	// mu guards the fields below.
	idle   map[string][]*dataConn
	all    map[*dataConn]struct{} // idle and in use, closed on close
	closed bool
}

func newConnPool(s *Service) *connPool {
	return &connPool{s: s, idle: make(map[string][]*dataConn), all: make(map[*dataConn]struct{})}
}

// get returns an idle connection to the producer, or dials a new one.
func (p *connPool) get(ctx context.Context, addr string, pid peer.ID) (*dataConn, bool, error) {
	key := string(pid) + "\x00" + addr
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, false, ErrClosed
	}
	if l := p.idle[key]; len(l) > 0 {
		c := l[len(l)-1]
		p.idle[key] = l[:len(l)-1]
		p.mu.Unlock()
		return c, true, nil
	}
	p.mu.Unlock()
	c, err := p.dial(ctx, key, addr, pid)
	return c, false, err
}

func (p *connPool) dial(ctx context.Context, key, addr string, pid peer.ID) (_ *dataConn, err error) {
	s := p.s
	d := net.Dialer{Timeout: s.cfg.IOTimeout}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: dial %s: %w", ErrUnreachable, addr, err)
	}
	c := &dataConn{Conn: nc, key: key, addr: addr, wbuf: make([]byte, 0, requestHeaderLen+maxTicketLen)}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		nc.Close()
		return nil, ErrClosed
	}
	p.all[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		if err != nil {
			p.discard(c)
		}
	}()
	stop := context.AfterFunc(ctx, c.cancel)
	defer stop()
	c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
	// A producer at its connection cap answers an error status instead of
	// its hello.
	if _, err := io.ReadFull(c, c.rbuf[:1]); err != nil {
		return nil, p.handshakeErr(ctx, addr, err)
	}
	if c.rbuf[0] == statusErr {
		return nil, readErrStatus(c)
	}
	var nonce [nonceLen]byte
	if err := readHello(io.MultiReader(bytes.NewReader(c.rbuf[:1]), c), &nonce); err != nil {
		return nil, p.handshakeErr(ctx, addr, err)
	}
	sig, err := s.priv.Sign(authPayload(&nonce, []byte(pid), []byte(s.self)))
	if err != nil {
		return nil, fmt.Errorf("transfer: sign handshake: %w", err)
	}
	if err := writeAuth(c, authMsg{PeerID: []byte(s.self), PubKey: s.pub, Sig: sig}); err != nil {
		return nil, p.handshakeErr(ctx, addr, err)
	}
	if _, err := io.ReadFull(c, c.rbuf[:1]); err != nil {
		return nil, p.handshakeErr(ctx, addr, err)
	}
	switch c.rbuf[0] {
	case statusOK:
		return c, nil
	case statusErr:
		return nil, readErrStatus(c)
	}
	return nil, fmt.Errorf("%w: handshake status %d", ErrProtocol, c.rbuf[0])
}

func (p *connPool) handshakeErr(ctx context.Context, addr string, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, ErrProtocol) || errors.Is(err, ErrVersion) {
		return err
	}
	return fmt.Errorf("%w: %s: handshake: %w", ErrUnreachable, addr, err)
}

// put returns a healthy connection for reuse, or closes it when the pool for
// its producer is full or the pool is closed.
func (p *connPool) put(c *dataConn) {
	c.mu.Lock()
	dead := c.cancelled
	c.mu.Unlock()
	p.mu.Lock()
	if !dead && !p.closed && len(p.idle[c.key]) < p.s.cfg.Conns {
		p.idle[c.key] = append(p.idle[c.key], c)
		p.mu.Unlock()
		return
	}
	delete(p.all, c)
	p.mu.Unlock()
	c.Close()
}

// forget closes the idle connections to producer pid.
func (p *connPool) forget(pid peer.ID) {
	prefix := string(pid) + "\x00"
	p.mu.Lock()
	var idle []*dataConn
	for key, l := range p.idle {
		if strings.HasPrefix(key, prefix) {
			idle = append(idle, l...)
			delete(p.idle, key)
		}
	}
	for _, c := range idle {
		delete(p.all, c)
	}
	p.mu.Unlock()
	for _, c := range idle {
		c.Close()
	}
}

// discard closes a connection that is broken or in an unknown state.
func (p *connPool) discard(c *dataConn) {
	p.mu.Lock()
	delete(p.all, c)
	p.mu.Unlock()
	c.Close()
}

func (p *connPool) close() {
	p.mu.Lock()
	p.closed = true
	all := p.all
	p.all = make(map[*dataConn]struct{})
	p.idle = make(map[string][]*dataConn)
	p.mu.Unlock()
	for c := range all {
		c.Close()
	}
}
