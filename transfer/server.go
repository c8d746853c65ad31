package transfer

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
)

// ioBlock is how many payload bytes one write (or, without checksums, one
// read) moves; the deadline moves forward between blocks (see deadline).
// 4 MiB writes cost a few percent less CPU than 1 MiB ones here.
const ioBlock = 4 << 20

func (s *Service) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			select {
			case <-s.stop:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			s.log.Warn("data accept", zap.Error(err))
			select {
			case <-s.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		ok, full := s.trackServing(c)
		if full {
			// Unauthenticated, so no peer id: the log names the address.
			// A fresh socket's buffer takes the short status at once.
			s.refused.refuse("data", "", "connection cap", zap.Stringer("remote", c.RemoteAddr()), zap.Int("max", s.cfg.MaxDataConns))
			c.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
			writeErrStatus(c, CodeBusy, fmt.Sprintf("producer serves %d data connections, its most", s.cfg.MaxDataConns))
			c.Close()
			continue
		}
		if !ok {
			c.Close()
			return
		}
		go s.serveConn(c)
	}
}

// trackServing registers a producer-side connection so Close can close it.
// It refuses one past MaxDataConns (full: the caller tells the consumer
// so) and any once Close began.
func (s *Service) trackServing(c net.Conn) (ok, full bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false, false
	}
	if len(s.dataConns) >= s.cfg.MaxDataConns {
		return false, true
	}
	s.wg.Add(1)
	s.dataConns[c] = struct{}{}
	return true, false
}

// admitConn counts an authenticated connection against its peer's cap; it
// returns false (and counts nothing) when the peer is at MaxDataConnsPerPeer.
func (s *Service) admitConn(p peer.ID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.peerConns[p] >= s.cfg.MaxDataConnsPerPeer {
		return false
	}
	s.peerConns[p]++
	return true
}

func (s *Service) releaseConn(p peer.ID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.peerConns[p]--; s.peerConns[p] <= 0 {
		delete(s.peerConns, p)
	}
}

func (s *Service) untrackServing(c net.Conn) {
	s.mu.Lock()
	if s.dataConns != nil {
		delete(s.dataConns, c)
	}
	s.mu.Unlock()
	c.Close()
	s.wg.Done()
}

// serveConn authenticates a consumer and serves its requests until it hangs
// up, errs, idles out or the service closes.
func (s *Service) serveConn(c net.Conn) {
	defer s.untrackServing(c)
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	log := s.log.With(zap.Stringer("remote", c.RemoteAddr()))
	c.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	consumer, err := s.handshake(c)
	if err != nil {
		log.Debug("data handshake", zap.Error(err))
		code := CodeUnauthorized
		if errors.Is(err, ErrVersion) {
			code = CodeVersion
		}
		writeErrStatus(c, code, err.Error())
		return
	}
	if !s.admit(consumer) {
		s.refused.refuse("data", consumer, "not admitted", zap.Stringer("remote", c.RemoteAddr()))
		writeErrStatus(c, CodeDenied, "peer not admitted")
		return
	}
	if !s.admitConn(consumer) {
		s.refused.refuse("data", consumer, "per-peer connection cap", zap.Int("max", s.cfg.MaxDataConnsPerPeer))
		writeErrStatus(c, CodeBusy, fmt.Sprintf("peer holds %d data connections, the most allowed", s.cfg.MaxDataConnsPerPeer))
		return
	}
	defer s.releaseConn(consumer)
	if _, err := c.Write([]byte{statusOK}); err != nil {
		return
	}
	var rb reqBuf
	var hdr []byte // status, block size, checksums: reused across requests
	for {
		c.SetReadDeadline(time.Now().Add(s.cfg.IdleTimeout))
		q, err := readRequest(c, &rb)
		if err != nil {
			if errors.Is(err, ErrProtocol) || errors.Is(err, ErrVersion) {
				log.Debug("bad data request", zap.Error(err))
				writeErrStatus(c, CodeBadRequest, err.Error())
			}
			return
		}
		c.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
		e, code, err := s.authorize(q, consumer)
		if err != nil {
			log.Debug("data request rejected", zap.String("code", code), zap.Error(err))
			writeErrStatus(c, code, err.Error())
			return
		}
		if err := e.pin(); err != nil {
			writeErrStatus(c, CodeNotFound, err.Error())
			return
		}
		if err := s.serveRange(c, e, int64(q.Offset), int64(q.Length), &hdr); err != nil {
			log.Debug("data write", zap.Error(err))
			e.unpin()
			return
		}
		e.unpin()
	}
}

// serveRange sends [off, off+n) of e, with its block checksums when the range
// has them, once its chunks are ready. e is pinned by the caller.
func (s *Service) serveRange(c net.Conn, e *entry, off, n int64, hdr *[]byte) error {
	if !e.rangeReady(off, n) {
		if err := s.awaitRange(c, e, off, n); err != nil {
			if errors.Is(err, ErrNotFound) {
				writeErrStatus(c, CodeNotFound, err.Error())
			}
			return fmt.Errorf("wait for chunks: %w", err)
		}
	}
	sums := e.rangeSums(off, n)
	h := append((*hdr)[:0], statusOK)
	h = binary.BigEndian.AppendUint32(h, sumBlock)
	h = binary.BigEndian.AppendUint32(h, uint32(len(sums)))
	for _, x := range sums {
		h = binary.BigEndian.AppendUint64(h, x)
	}
	*hdr = h
	if _, err := c.Write(h); err != nil {
		return err
	}
	return s.writeBlocks(c, e.buf[off:off+n])
}

// handshake proves the consumer's peer identity: it signs our fresh nonce,
// our peer id and its own with the key its peer id is derived from. The
// caller sends the status that ends the handshake, once it has admitted the
// peer.
func (s *Service) handshake(c net.Conn) (peer.ID, error) {
	var nonce [nonceLen]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return "", err
	}
	if err := writeHello(c, &nonce); err != nil {
		return "", err
	}
	m, err := readAuth(c)
	if err != nil {
		return "", err
	}
	return verifyAuth(&nonce, []byte(s.self), m)
}

// verifyAuth checks that m is a valid signature, for this connection's nonce
// and this producer, by the peer it names.
func verifyAuth(nonce *[nonceLen]byte, producer []byte, m authMsg) (peer.ID, error) {
	pub, err := crypto.UnmarshalPublicKey(m.PubKey)
	if err != nil {
		return "", fmt.Errorf("%w: public key: %v", ErrTicket, err)
	}
	id, err := peer.IDFromPublicKey(pub)
	if err != nil || string(id) != string(m.PeerID) {
		return "", fmt.Errorf("%w: public key does not match peer id", ErrTicket)
	}
	ok, err := pub.Verify(authPayload(nonce, producer, m.PeerID), m.Sig)
	if err != nil || !ok {
		return "", fmt.Errorf("%w: bad handshake signature", ErrTicket)
	}
	return id, nil
}

// checkTicket verifies raw: minted by this service, for consumer, not
// expired. On failure it returns the wire code to send back.
func (s *Service) checkTicket(raw []byte, consumer peer.ID) (ticket, string, error) {
	t, code, err := s.key.verify(raw)
	if err != nil {
		return t, code, err
	}
	if t.consumer != consumer {
		return t, CodeWrongPeer, fmt.Errorf("%w: issued to %s, presented by %s", ErrTicket, t.consumer, consumer)
	}
	if !s.now().Before(t.expiry) {
		return t, CodeExpired, fmt.Errorf("%w: at %s", ErrTicketExpired, t.expiry.UTC().Format(time.RFC3339Nano))
	}
	return t, "", nil
}

// authorize checks a request's ticket and range; on failure it returns the
// wire code to send back.
func (s *Service) authorize(q request, consumer peer.ID) (*entry, string, error) {
	t, code, err := s.checkTicket(q.Ticket, consumer)
	if err != nil {
		return nil, code, err
	}
	e := s.reg.get(t.payloadID)
	if e == nil {
		return nil, CodeNotFound, fmt.Errorf("%w: %s", ErrNotFound, t.payloadID)
	}
	size := uint64(len(e.buf))
	if q.Offset > size || q.Length > size-q.Offset {
		return nil, CodeRange, fmt.Errorf("%w: [%d,+%d) of %d bytes", ErrRange, q.Offset, q.Length, size)
	}
	return e, "", nil
}

// awaitRange waits for chunks to be written, sending a heartbeat status every
// third of IOTimeout so the consumer can tell a slow producer from a dead one.
func (s *Service) awaitRange(c net.Conn, e *entry, off, n int64) error {
	beat := s.cfg.IOTimeout / 3
	for {
		ctx, cancel := context.WithTimeout(context.Background(), beat)
		err := e.waitRange(ctx, s.stop, off, n)
		cancel()
		if err == nil {
			return nil
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		c.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
		if _, err := c.Write([]byte{statusWait}); err != nil {
			return err
		}
	}
}

// deadline keeps a connection's deadline timeout ahead of its last progress
// without resetting the timer on every block: it moves the deadline only
// when a quarter of timeout has passed since it last did, so a stalled peer
// is still an error within timeout of the last progress. (Resetting per
// block cost about 5% of the CPU of a 4-connection pull here.)
type deadline struct {
	set     func(time.Time)
	timeout time.Duration
	last    time.Time
}

// progress is called before each block.
func (d *deadline) progress() {
	if now := time.Now(); now.Sub(d.last) >= d.timeout/4 {
		d.set(now.Add(d.timeout))
		d.last = now
	}
}

// writeBlocks writes b in ioBlock pieces, moving the write deadline forward
// as they go.
func (s *Service) writeBlocks(c net.Conn, b []byte) error {
	dl := deadline{set: func(t time.Time) { c.SetWriteDeadline(t) }, timeout: s.cfg.IOTimeout}
	for len(b) > 0 {
		k := min(len(b), ioBlock)
		dl.progress()
		if _, err := c.Write(b[:k]); err != nil {
			return err
		}
		b = b[k:]
	}
	return nil
}
