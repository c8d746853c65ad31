package shm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

// maxFds is how many fds the handshake receive makes room for: one is
// expected; room for a few more lets us see, and close, extras rather than
// have them silently truncated.
const maxFds = 4

// Peer is a consumer's view of one producer's arena on this host. Its
// methods are safe for concurrent use; pin round trips are serialised on the
// one connection (a few microseconds each).
//
// Slices returned by View stay valid until Close, even after Release, but
// once released their bytes may be overwritten by the producer.
type Peer struct {
	m         *arena.Mapping
	id        string
	size      int64
	cred      unix.Ucred
	conn      *net.UnixConn
	closeOnce sync.Once

	// mu guards the fields below and serialises use of conn.
	mu     sync.Mutex
	closed bool
	broken error // set once the connection is unusable
	seq    uint32
	pins   map[Handle]int
	wb, rb [frameSize]byte
}

// Dial connects to a producer's Server at path, checks the producer's
// credentials (check; nil means SameUID), receives its arena memfd and maps
// it read-only.
func Dial(ctx context.Context, path string, check CredCheck) (_ *Peer, err error) {
	if check == nil {
		check = SameUID()
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("shm: dial %s: %w", path, err)
	}
	c := nc.(*net.UnixConn)
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	cred, err := peerCred(c)
	if err != nil {
		return nil, err
	}
	if err := check(cred); err != nil {
		return nil, err
	}

	stop := context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Unix(1, 0)) })
	hdr, fd, err := readHandshake(c)
	if !stop() {
		if err == nil {
			unix.Close(fd)
		}
		return nil, fmt.Errorf("shm: handshake with %s: %w", path, ctx.Err())
	}
	if err != nil {
		return nil, fmt.Errorf("shm: handshake with %s: %w", path, err)
	}
	m, err := arena.Map(fd, hdr.ArenaSize, arena.ReadOnly)
	unix.Close(fd)
	if err != nil {
		return nil, fmt.Errorf("shm: map arena %q: %w", hdr.ArenaID, err)
	}
	return &Peer{
		m:    m,
		id:   hdr.ArenaID,
		size: hdr.ArenaSize,
		cred: cred,
		conn: c,
		pins: make(map[Handle]int),
	}, nil
}

// readHandshake receives the header and exactly one fd. Any fds received
// are closed on error.
func readHandshake(c *net.UnixConn) (header, int, error) {
	var buf [headerSize]byte
	oob := make([]byte, unix.CmsgSpace(4*maxFds))
	n, oobn, flags, _, err := c.ReadMsgUnix(buf[:], oob)
	if err != nil {
		return header{}, -1, err
	}
	var fds []int
	if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
		for _, m := range msgs {
			if rights, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, rights...)
			}
		}
	}
	fail := func(err error) (header, int, error) {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return header{}, -1, err
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fail(fmt.Errorf("%w: control data truncated", ErrBadMessage))
	}
	if len(fds) != 1 {
		return fail(fmt.Errorf("%w: %d fds in handshake, want 1", ErrBadMessage, len(fds)))
	}
	if n < headerSize {
		// A stream socket may split the header; the fd came with its first byte.
		if _, err := io.ReadFull(c, buf[n:]); err != nil {
			return fail(err)
		}
	}
	hdr, err := decodeHeader(buf[:])
	if err != nil {
		return fail(err)
	}
	return hdr, fds[0], nil
}

// ArenaID is the producer's arena id from the handshake.
func (p *Peer) ArenaID() string { return p.id }

// Size is the producer's arena size.
func (p *Peer) Size() int64 { return p.size }

// Cred is the producer's credentials as checked at Dial.
func (p *Peer) Cred() unix.Ucred { return p.cred }

// check validates h against the mapped arena.
func (p *Peer) check(h Handle) error {
	if h.ArenaID != p.id {
		return fmt.Errorf("%w: arena %q, peer serves %q", ErrBadHandle, h.ArenaID, p.id)
	}
	if h.Off < 0 || h.Len <= 0 || h.Off > p.size || h.Len > p.size-h.Off {
		return fmt.Errorf("%w: off %d len %d outside arena of %d bytes", ErrBadHandle, h.Off, h.Len, p.size)
	}
	return nil
}

// View pins h in the producer and returns its bytes in place, without a
// copy. The producer will not reuse the region until Release(h). The slice
// must not be written (the mapping is read-only; a write faults).
func (p *Peer) View(ctx context.Context, h Handle) ([]byte, error) {
	if err := p.check(h); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.acquireLocked(ctx, h); err != nil {
		return nil, err
	}
	p.pins[h]++
	return p.m.Bytes()[h.Off : h.Off+h.Len : h.Off+h.Len], nil
}

// Release drops one pin taken by View. Sending is fire-and-forget: a
// producer that is gone has dropped the pins already.
func (p *Peer) Release(h Handle) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pins[h] == 0 {
		return fmt.Errorf("%w: off %d gen %d", ErrNotHeld, h.Off, h.Gen)
	}
	if p.pins[h]--; p.pins[h] == 0 {
		delete(p.pins, h)
	}
	if p.closed || p.broken != nil {
		return nil
	}
	frame{Type: typeRelease, Off: h.Off, Len: h.Len, Gen: h.Gen}.encode(&p.wb)
	if _, err := p.conn.Write(p.wb[:]); err != nil {
		p.breakLocked(err)
	}
	return nil
}

// CopyInto copies the payload h names into dst (len(dst) must equal h.Len),
// holding a pin for the duration. Large payloads are split into pieces
// copied by up to min(GOMAXPROCS, 8) goroutines.
func (p *Peer) CopyInto(ctx context.Context, h Handle, dst []byte) error {
	if int64(len(dst)) != h.Len {
		return fmt.Errorf("%w: dst is %d bytes, payload %d", ErrBadHandle, len(dst), h.Len)
	}
	src, err := p.View(ctx, h)
	if err != nil {
		return err
	}
	cerr := parallelCopy(ctx, dst, src)
	if err := p.Release(h); err != nil {
		return err
	}
	return cerr
}

// acquireLocked sends an acquire frame and waits for its reply, honouring
// ctx. A round trip cut short by ctx leaves the stream out of step, so the
// connection is then marked broken.
func (p *Peer) acquireLocked(ctx context.Context, h Handle) error {
	if p.closed {
		return ErrClosed
	}
	if p.broken != nil {
		return fmt.Errorf("shm: connection to %q broken: %w", p.id, p.broken)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	var fired chan struct{}
	stop := func() bool { return true }
	if ctx.Done() != nil {
		fired = make(chan struct{})
		stop = context.AfterFunc(ctx, func() {
			p.conn.SetDeadline(time.Unix(1, 0))
			close(fired)
		})
	}
	p.seq++
	seq := p.seq
	frame{Type: typeAcquire, Seq: seq, Off: h.Off, Len: h.Len, Gen: h.Gen}.encode(&p.wb)
	_, err := p.conn.Write(p.wb[:])
	if err == nil {
		_, err = io.ReadFull(p.conn, p.rb[:])
	}
	if !stop() {
		<-fired
		if err != nil {
			p.breakLocked(ctx.Err())
			return ctx.Err()
		}
		p.conn.SetDeadline(time.Time{})
	}
	if err != nil {
		p.breakLocked(err)
		return fmt.Errorf("shm: acquire from %q: %w", p.id, err)
	}
	f, err := decodeFrame(p.rb[:])
	if err == nil && (f.Type != typeReply || f.Seq != seq) {
		err = fmt.Errorf("%w: reply type %d seq %d, want seq %d", ErrBadMessage, f.Type, f.Seq, seq)
	}
	if err != nil {
		p.breakLocked(err)
		return err
	}
	switch f.Code {
	case codeOK:
		return nil
	case codeUnknownBuf:
		return fmt.Errorf("%w: off %d len %d gen %d", ErrUnknownBuf, h.Off, h.Len, h.Gen)
	default:
		return ErrTooManyPins
	}
}

func (p *Peer) breakLocked(err error) {
	if p.broken == nil {
		p.broken = err
		p.conn.Close()
	}
}

// Close disconnects (the producer drops this peer's pins) and unmaps the
// producer's arena. Every slice View returned becomes invalid: stop using
// them first. Idempotent.
func (p *Peer) Close() error {
	var err error
	p.closeOnce.Do(func() {
		// Close the socket before taking mu: it unblocks a round trip in flight.
		cerr := p.conn.Close()
		if errors.Is(cerr, net.ErrClosed) {
			cerr = nil // already closed when the connection broke
		}
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		err = errors.Join(cerr, p.m.Close())
	})
	return err
}
