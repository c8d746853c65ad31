package transfer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/peerstore"
	ma "github.com/multiformats/go-multiaddr"
	"go.uber.org/zap"
)

// Chunk is one chunk of a payload that has landed in the destination buffer.
// Data is a view into that buffer, not a copy.
type Chunk struct {
	Index int
	Data  []byte
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

// Pull fetches a payload into a fresh buffer. When this service is the
// producer it returns the published buffer itself, which must not be modified.
func (s *Service) Pull(ctx context.Context, ref Ref) ([]byte, error) {
	if err := ref.Meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return nil, err
	}
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
	if ref.Producer.PeerID == s.self.String() {
		_, err := s.pullLocal(ctx, ref, dst, nil)
		return err
	}
	return s.pull(ctx, ref, dst, nil)
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
	onChunk := func(k int) {
		off, n := ref.Meta.ChunkRange(k)
		p.ch <- Chunk{Index: k, Data: dst[off : off+n]}
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
// nil it returns the published buffer, else it copies into dst.
func (s *Service) pullLocal(ctx context.Context, ref Ref, dst []byte, onChunk func(int)) ([]byte, error) {
	e := s.reg.get(ref.ID)
	if e == nil {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, ref.ID)
	}
	if e.meta.Bytes() != ref.Meta.Bytes() || e.meta.Chunks() != ref.Meta.Chunks() {
		return nil, fmt.Errorf("%w: ref meta does not match payload %s", ErrBadMeta, ref.ID)
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
	if dst == nil {
		return e.buf, nil
	}
	return dst, nil
}

// span is one byte range a pull requests; chunk is its chunk index, or -1.
type span struct {
	off, n int64
	chunk  int
}

// plan splits a payload into the ranges requested: one per chunk for chunked
// payloads (in index order, so chunk 0 lands first), else up to Conns equal
// stripes of at least MinStripe bytes.
func (s *Service) plan(meta TensorMeta) []span {
	size := meta.Bytes()
	if nc := meta.Chunks(); nc > 1 {
		out := make([]span, nc)
		for k := range out {
			off, n := meta.ChunkRange(k)
			out[k] = span{off: off, n: n, chunk: k}
		}
		return out
	}
	stripes := int64(s.cfg.Conns)
	if lim := (size + s.cfg.MinStripe - 1) / s.cfg.MinStripe; lim < stripes {
		stripes = lim
	}
	stripes = max(stripes, 1)
	out := make([]span, stripes)
	per := size / stripes
	var off int64
	for i := range out {
		n := per
		if i == len(out)-1 {
			n = size - off
		}
		out[i] = span{off: off, n: n, chunk: -1}
		off += n
	}
	return out
}

// pull fetches ref from a remote producer into dst, striping ranges over
// pooled connections.
func (s *Service) pull(ctx context.Context, ref Ref, dst []byte, onChunk func(int)) error {
	if s.isClosed() {
		return ErrClosed
	}
	pid, err := peer.Decode(ref.Producer.PeerID)
	if err != nil {
		return fmt.Errorf("%w: producer peer id %q: %v", ErrBadMeta, ref.Producer.PeerID, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.life, cancel)()

	tk := &ticketHolder{s: s, pid: pid, ref: ref}
	resp, err := tk.fetch(ctx)
	if err != nil {
		return err
	}
	if resp.Meta.Bytes() != ref.Meta.Bytes() || resp.Meta.Chunks() != ref.Meta.Chunks() {
		return fmt.Errorf("%w: producer meta %v does not match ref %v", ErrBadMeta, resp.Meta, ref.Meta)
	}
	addr := resp.DataAddr

	spans := s.plan(ref.Meta)
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
			c, err = s.fetchSpan(ctx, c, addr, pid, tk, sp, dst)
			if err != nil {
				errOnce.Do(func() { firstErr = err; cancel() })
				return
			}
			if onChunk != nil && sp.chunk >= 0 {
				onChunk(sp.chunk)
			}
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
	if s.cfg.ChecksumTCP && ref.Checksum != 0 {
		if got := xxhash.Sum64(dst); got != ref.Checksum {
			return fmt.Errorf("%w: payload %s checksum %x, want %x", ErrCorrupt, ref.ID, got, ref.Checksum)
		}
	}
	if onChunk != nil && spans[0].chunk < 0 {
		onChunk(0)
	}
	return nil
}

// fetchSpan fetches one span on c (dialling when c is nil) and returns the
// connection to keep using, or nil when it was discarded. A pooled connection
// the producer has since closed, and an expired ticket, are each retried once.
func (s *Service) fetchSpan(ctx context.Context, c *dataConn, addr string, pid peer.ID, tk *ticketHolder, sp span, dst []byte) (*dataConn, error) {
	retriedConn, retriedTicket := false, false
	for {
		reused := c != nil && c.used
		if c == nil {
			var err error
			if c, reused, err = s.pool.get(ctx, addr, pid); err != nil {
				return nil, err
			}
		}
		t := tk.current()
		started, err := s.fetch(ctx, c, t, sp.off, dst[sp.off:sp.off+sp.n])
		if err == nil {
			c.used = true
			return c, nil
		}
		// After an error the stream is in an unknown state, or the producer
		// has closed it (remote errors): never reuse it.
		s.pool.discard(c)
		c = nil
		var re *RemoteError
		remote := errors.As(err, &re)
		switch {
		case ctx.Err() != nil:
			return nil, fmt.Errorf("transfer: pull %s: %w", tk.ref.ID, ctx.Err())
		case remote && errors.Is(err, ErrTicketExpired) && !retriedTicket:
			retriedTicket = true
			if _, err := tk.refresh(ctx, t); err != nil {
				return nil, err
			}
		case !remote && !started && reused && !retriedConn:
			retriedConn = true
		default:
			return nil, err
		}
	}
}

// fetch sends one request on c and reads the answer into dst. started reports
// whether the producer had begun answering, after which c is unusable on error.
func (s *Service) fetch(ctx context.Context, c *dataConn, t []byte, off int64, dst []byte) (started bool, err error) {
	stop := context.AfterFunc(ctx, c.cancel)
	defer stop()
	c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
	c.wbuf = appendRequest(c.wbuf[:0], request{Offset: uint64(off), Length: uint64(len(dst)), Ticket: t})
	if _, err := c.Write(c.wbuf); err != nil {
		return false, fmt.Errorf("%w: %s: write request: %w", ErrUnreachable, c.addr, err)
	}
	for {
		if _, err := io.ReadFull(c, c.rbuf[:1]); err != nil {
			return false, fmt.Errorf("%w: %s: read status: %w", ErrUnreachable, c.addr, err)
		}
		switch c.rbuf[0] {
		case statusWait:
			c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
			continue
		case statusErr:
			return false, readErrStatus(c)
		case statusOK:
		default:
			return true, fmt.Errorf("%w: status byte %d", ErrProtocol, c.rbuf[0])
		}
		break
	}
	if _, err := io.ReadFull(c, c.rbuf[:8]); err != nil {
		return true, fmt.Errorf("%w: %s: read checksum: %w", ErrCorrupt, c.addr, unexpected(err))
	}
	sum := binary.BigEndian.Uint64(c.rbuf[:8])
	for got := 0; got < len(dst); {
		k := min(len(dst)-got, ioBlock)
		c.setDeadline(time.Now().Add(s.cfg.IOTimeout))
		if _, err := io.ReadFull(c, dst[got:got+k]); err != nil {
			return true, fmt.Errorf("%w: %s: short read at %d of %d bytes: %w", ErrCorrupt, c.addr, got, len(dst), unexpected(err))
		}
		got += k
	}
	if sum != 0 && s.cfg.ChecksumTCP {
		if x := xxhash.Sum64(dst); x != sum {
			return true, fmt.Errorf("%w: range at %d: checksum %x, want %x", ErrCorrupt, off, x, sum)
		}
	}
	return true, nil
}

// ticketHolder is the ticket a pull's stripes share, refreshed at most once
// per expiry by whichever stripe sees it expire first.
type ticketHolder struct {
	s   *Service
	pid peer.ID
	ref Ref

	mu sync.Mutex
	// mu guards the field below.
	ticket []byte
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
		return nil, unreachable("open stream", err)
	}
	defer str.Close()
	defer context.AfterFunc(ctx, func() { str.Reset() })()
	str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	if err := WriteFrame(str, &TicketRequest{V: WireVersion, PayloadID: ref.ID}); err != nil {
		str.Reset()
		return nil, unreachable("write ticket request", err)
	}
	str.CloseWrite()
	var resp TicketResponse
	if err := ReadFrame(str, s.cfg.MaxFrame, &resp); err != nil {
		str.Reset()
		if errors.Is(err, ErrProtocol) || errors.Is(err, ErrVersion) || errors.Is(err, ErrFrameTooLarge) || errors.Is(err, ErrBadMeta) {
			return nil, fmt.Errorf("transfer: ticket response from %s: %w", pid, err)
		}
		return nil, unreachable("read ticket response", err)
	}
	if resp.ErrCode != "" {
		return nil, &RemoteError{Code: resp.ErrCode, Msg: resp.ErrMsg}
	}
	return &resp, nil
}

// dataConn is a consumer-side data-plane connection to one producer.
type dataConn struct {
	net.Conn
	key  string // pool key: producer peer id and address
	addr string
	used bool // has completed at least one request

	rbuf [8]byte
	wbuf []byte

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
	var nonce [nonceLen]byte
	if err := readHello(c, &nonce); err != nil {
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
