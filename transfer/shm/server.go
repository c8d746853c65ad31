package shm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

var (
	// ErrPeerRejected is returned (wrapped) when a peer's credentials fail
	// the CredCheck.
	ErrPeerRejected = errors.New("shm: peer rejected")
	// ErrBadMessage is returned (wrapped) for a malformed handshake or frame.
	ErrBadMessage = errors.New("shm: bad message")
	// ErrBadHandle is returned (wrapped) for a Handle outside the peer's
	// arena, naming another arena, or not matching dst.
	ErrBadHandle = errors.New("shm: bad handle")
	// ErrUnknownBuf is returned when the producer no longer holds the buffer a
	// Handle names (freed, or the handle is stale).
	ErrUnknownBuf = errors.New("shm: buffer not live in producer")
	// ErrTooManyPins is returned when the consumer already holds
	// ServerConfig.MaxPinsPerPeer pins.
	ErrTooManyPins = errors.New("shm: too many pins")
	// ErrNotHeld is returned by Release for a Handle with no outstanding View.
	ErrNotHeld = errors.New("shm: handle not held")
	// ErrClosed is returned by operations on a closed Server or Peer.
	ErrClosed = errors.New("shm: closed")
)

// Handle names an immutable payload in a producer's arena. It is what
// crosses the control plane; the bytes never do.
type Handle struct {
	ArenaID string `msgpack:"arena_id" json:"arena_id"`
	Off     int64  `msgpack:"off" json:"off"`
	Len     int64  `msgpack:"len" json:"len"`
	Gen     uint64 `msgpack:"gen" json:"gen"`
}

// Source is the producer's arena as the Server needs it; *arena.Arena
// implements it.
type Source interface {
	Fd() int
	Size() int64
	Pin(arena.Buf) error
	Unpin(arena.Buf) error
}

// ServerConfig configures a Server.
type ServerConfig struct {
	// ArenaID names the arena in Handles and the handshake; unique per agent.
	ArenaID string
	// Check vets each connecting consumer; nil means SameUID.
	Check CredCheck
	// MaxPinsPerPeer bounds the pins one consumer may hold, so a buggy or
	// hostile consumer cannot grow the producer's pin table without limit.
	MaxPinsPerPeer int
	// HandshakeTimeout bounds sending the arena fd to a new consumer.
	HandshakeTimeout time.Duration
	// Logger receives connection events; nil means zap.NewNop().
	Logger *zap.Logger
}

// DefaultServerConfig returns a ServerConfig for arena id.
func DefaultServerConfig(arenaID string) ServerConfig {
	return ServerConfig{
		ArenaID: arenaID,
		// Same uid: agents and their engine workers normally share an account.
		Check: SameUID(),
		// Far above the payloads one consumer reads in place at once (a few per
		// job), small enough that the table stays a few hundred KiB at worst.
		MaxPinsPerPeer: 4096,
		// A local socket write of 80 bytes completes at once unless the peer is
		// wedged; don't let a wedged peer hold a goroutine.
		HandshakeTimeout: 5 * time.Second,
		Logger:           zap.NewNop(),
	}
}

// ServerStats is a snapshot of a Server.
type ServerStats struct {
	Peers       int   // connected consumers
	Pins        int   // pins held by all consumers
	Rejected    int64 // connections refused by the CredCheck
	BadReleases int64 // releases of pins a consumer did not hold (ignored)
}

// Server exports a producer's arena to same-host consumers: it sends the
// memfd once per connection and then serves pin and release frames. Handles
// are created with Handle. A Server may Serve several listeners.
type Server struct {
	cfg    ServerConfig
	src    Source
	log    *zap.Logger
	ctx    context.Context // cancelled by Close; parent of every Serve
	cancel context.CancelFunc
	wg     sync.WaitGroup // Serve calls in flight

	// mu guards the fields below.
	mu          sync.Mutex
	closed      bool
	peers       int
	pins        int
	rejected    int64
	badReleases int64
}

// NewServer validates cfg and returns a Server over src.
func NewServer(src Source, cfg ServerConfig) (*Server, error) {
	if err := validArenaID(cfg.ArenaID); err != nil {
		return nil, err
	}
	if cfg.MaxPinsPerPeer <= 0 {
		return nil, fmt.Errorf("shm: MaxPinsPerPeer %d must be positive", cfg.MaxPinsPerPeer)
	}
	if cfg.HandshakeTimeout <= 0 {
		return nil, fmt.Errorf("shm: HandshakeTimeout %v must be positive", cfg.HandshakeTimeout)
	}
	if src.Size() <= 0 || src.Size() > maxArenaSize {
		return nil, fmt.Errorf("shm: arena size %d out of range", src.Size())
	}
	if cfg.Check == nil {
		cfg.Check = SameUID()
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{
		cfg:    cfg,
		src:    src,
		log:    cfg.Logger.Named("shm").With(zap.String("arena", cfg.ArenaID)),
		ctx:    ctx,
		cancel: cancel,
	}, nil
}

// Handle names b for consumers of this server.
func (s *Server) Handle(b arena.Buf) Handle {
	return Handle{ArenaID: s.cfg.ArenaID, Off: b.Off, Len: b.Len, Gen: b.Gen}
}

// Stats returns a snapshot of the server's state.
func (s *Server) Stats() ServerStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return ServerStats{Peers: s.peers, Pins: s.pins, Rejected: s.rejected, BadReleases: s.badReleases}
}

// Serve accepts consumers on l until ctx is done, Close is called or l
// fails. It closes l, disconnects its consumers (dropping their pins) and
// waits for its goroutines before returning. It returns nil after ctx or
// Close ended it.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		l.Close()
		return ErrClosed
	}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	ctx, cancel := context.WithCancel(ctx)
	stopServer := context.AfterFunc(s.ctx, cancel)
	stopListener := context.AfterFunc(ctx, func() { l.Close() })
	var conns sync.WaitGroup
	defer func() {
		cancel()
		stopServer()
		stopListener()
		l.Close()
		conns.Wait()
	}()

	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("shm: accept: %w", err)
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			s.serveConn(ctx, c)
		}()
	}
}

// Close stops every Serve and waits for them. Idempotent.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	return nil
}

// serveConn runs one consumer connection: credential check, handshake, then
// frames until either side closes. Its pins are dropped when it ends.
func (s *Server) serveConn(ctx context.Context, c *net.UnixConn) {
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()

	cred, err := peerCred(c)
	if err == nil {
		err = s.cfg.Check(cred)
	}
	if err != nil {
		s.mu.Lock()
		s.rejected++
		s.mu.Unlock()
		s.log.Warn("consumer rejected", zap.Error(err))
		return
	}
	log := s.log.With(zap.Int32("pid", cred.Pid), zap.Uint32("uid", cred.Uid))

	var hb [headerSize]byte
	header{ArenaSize: s.src.Size(), ArenaID: s.cfg.ArenaID}.encode(&hb)
	c.SetWriteDeadline(time.Now().Add(s.cfg.HandshakeTimeout))
	if _, _, err := c.WriteMsgUnix(hb[:], unix.UnixRights(s.src.Fd()), nil); err != nil {
		log.Warn("handshake failed", zap.Error(err))
		return
	}
	c.SetWriteDeadline(time.Time{})

	s.mu.Lock()
	s.peers++
	s.mu.Unlock()
	pins := make(map[arena.Buf]int)
	held := 0
	defer func() {
		for b, n := range pins {
			for range n {
				if err := s.src.Unpin(b); err != nil {
					log.Warn("unpin on disconnect", zap.Int64("off", b.Off), zap.Error(err))
				}
			}
		}
		s.mu.Lock()
		s.peers--
		s.pins -= held
		s.mu.Unlock()
	}()
	log.Debug("consumer connected")

	var rb [frameSize]byte
	var wb [frameSize]byte
	for {
		if _, err := io.ReadFull(c, rb[:]); err != nil {
			if ctx.Err() == nil && !errors.Is(err, io.EOF) {
				log.Debug("consumer read", zap.Error(err))
			}
			return
		}
		f, err := decodeFrame(rb[:])
		if err != nil || f.Type == typeReply {
			log.Warn("bad frame from consumer, disconnecting", zap.Error(err), zap.Uint8("type", f.Type))
			return
		}
		b := arena.Buf{Off: f.Off, Len: f.Len, Gen: f.Gen}
		if f.Type == typeRelease {
			if pins[b] == 0 {
				s.mu.Lock()
				s.badReleases++
				s.mu.Unlock()
				log.Warn("release of unheld pin", zap.Int64("off", b.Off), zap.Uint64("gen", b.Gen))
				continue
			}
			if err := s.src.Unpin(b); err != nil {
				log.Warn("unpin", zap.Int64("off", b.Off), zap.Error(err))
			}
			if pins[b]--; pins[b] == 0 {
				delete(pins, b)
			}
			held--
			s.mu.Lock()
			s.pins--
			s.mu.Unlock()
			continue
		}
		code := uint16(codeOK)
		switch {
		case held >= s.cfg.MaxPinsPerPeer:
			code = codeTooMany
		case s.src.Pin(b) != nil:
			code = codeUnknownBuf
		default:
			pins[b]++
			held++
			s.mu.Lock()
			s.pins++
			s.mu.Unlock()
		}
		frame{Type: typeReply, Code: code, Seq: f.Seq}.encode(&wb)
		if _, err := c.Write(wb[:]); err != nil {
			log.Debug("consumer write", zap.Error(err))
			return
		}
	}
}
