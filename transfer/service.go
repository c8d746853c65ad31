package transfer

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"go.uber.org/zap"
)

// ProtocolID is the libp2p protocol of the control channel (ticket requests).
const ProtocolID protocol.ID = "/latentmesh/transfer/1"

// Config configures a Service. It is copied by New and frozen.
type Config struct {
	// DataListen is the TCP address the data plane listens on. Loopback by
	// default so a test or a single-host dev cluster opens nothing outward;
	// agents set the node's data-network address.
	DataListen string
	// DataAdvertise is the address consumers dial, when it differs from the
	// bound listener address (e.g. DataListen is 0.0.0.0:port). Empty means
	// the listener's own address.
	DataAdvertise string
	// Conns is the number of TCP connections per producer a pull stripes
	// across, and the most a consumer keeps pooled per producer. Four keeps a
	// 100 Gb/s NIC busy without one flow's window limiting it.
	Conns int
	// MinStripe is the smallest byte range worth its own connection; smaller
	// payloads use fewer connections. 1 MiB amortises the request round trip.
	MinStripe int64
	// IOTimeout bounds every wait for progress on a connection (dial,
	// handshake, each block read or written), so a silent partition becomes
	// an error in bounded time. 10s tolerates GC and scheduler stalls.
	IOTimeout time.Duration
	// IdleTimeout is how long the producer keeps a pooled connection with no
	// request open. Consumers redial transparently after it.
	IdleTimeout time.Duration
	// TicketTTL is how long a ticket stays valid. 30s covers a pull; a
	// consumer whose ticket expires mid-pull asks for a fresh one.
	TicketTTL time.Duration
	// MaxPayloadBytes bounds a payload's size, on publish and on pull. 4 GiB
	// covers a long video latent with room to spare.
	MaxPayloadBytes int64
	// MaxFrame bounds a control frame. Tickets and metadata are small; 64 KiB
	// keeps a hostile peer from making us allocate much.
	MaxFrame int
	// ChecksumTCP verifies xxhash checksums (whole payload, or per chunk) on
	// pulls over TCP. On by default: it costs far less than the copy.
	ChecksumTCP bool
	// Logger receives the service's logs; named "transfer".
	Logger *zap.Logger
}

// DefaultConfig returns a Config with every field set.
func DefaultConfig() Config {
	return Config{
		DataListen:      "127.0.0.1:0",
		Conns:           4,
		MinStripe:       1 << 20,
		IOTimeout:       10 * time.Second,
		IdleTimeout:     90 * time.Second,
		TicketTTL:       30 * time.Second,
		MaxPayloadBytes: 4 << 30,
		MaxFrame:        64 << 10,
		ChecksumTCP:     true,
		Logger:          zap.NewNop(),
	}
}

func (c Config) validate() error {
	switch {
	case c.DataListen == "":
		return errors.New("transfer: config: DataListen is empty")
	case c.Conns < 1 || c.Conns > 64:
		return fmt.Errorf("transfer: config: Conns %d not in [1,64]", c.Conns)
	case c.MinStripe < 1:
		return fmt.Errorf("transfer: config: MinStripe %d < 1", c.MinStripe)
	case c.IOTimeout <= 0:
		return fmt.Errorf("transfer: config: IOTimeout %v <= 0", c.IOTimeout)
	case c.IdleTimeout <= 0:
		return fmt.Errorf("transfer: config: IdleTimeout %v <= 0", c.IdleTimeout)
	case c.TicketTTL <= 0:
		return fmt.Errorf("transfer: config: TicketTTL %v <= 0", c.TicketTTL)
	case c.MaxPayloadBytes < 1:
		return fmt.Errorf("transfer: config: MaxPayloadBytes %d < 1", c.MaxPayloadBytes)
	case c.MaxFrame < 256:
		return fmt.Errorf("transfer: config: MaxFrame %d < 256", c.MaxFrame)
	case c.Logger == nil:
		return errors.New("transfer: config: Logger is nil")
	}
	return nil
}

// Producer says where a payload lives and how to reach its holder.
type Producer struct {
	PeerID   string   `msgpack:"peer_id" json:"peer_id"`
	P2PAddrs []string `msgpack:"p2p_addrs" json:"p2p_addrs"`
	DataAddr string   `msgpack:"data_addr" json:"data_addr"`
}

// Ref names a published payload. It is small and serialisable (task records
// in etcd carry it); anyone holding it may ask the producer for a ticket.
type Ref struct {
	ID       string     `msgpack:"id" json:"id"`
	Producer Producer   `msgpack:"producer" json:"producer"`
	Meta     TensorMeta `msgpack:"meta" json:"meta"`
	// Checksum is the xxhash64 of the whole payload; 0 means none (chunked
	// payloads published with Begin carry per-chunk checksums instead).
	Checksum uint64 `msgpack:"checksum" json:"checksum"`
}

// Service publishes payloads and pulls them from other Services. One runs per
// agent, on the agent's libp2p host.
type Service struct {
	cfg  Config
	log  *zap.Logger
	h    host.Host
	self peer.ID
	priv crypto.PrivKey
	pub  []byte // marshalled public key, sent in data-plane handshakes
	now  func() time.Time

	key  ticketKey
	reg  *registry
	pool *connPool

	ln       net.Listener
	dataAddr string

	life      context.Context // cancelled by Close; bounds pulls and waits
	endLife   context.CancelFunc
	stop      <-chan struct{} // life.Done()
	closeOnce sync.Once
	wg        sync.WaitGroup

	mu sync.Mutex
	// mu guards the fields below.
	closed    bool
	dataConns map[net.Conn]struct{} // producer side, closed on Close
}

// New starts a Service on h: it listens on cfg.DataListen and registers the
// ProtocolID stream handler. The caller owns h and closes it after Close.
func New(cfg Config, h host.Host) (*Service, error) {
	return newService(cfg, h, time.Now)
}

func newService(cfg Config, h host.Host, now func() time.Time) (_ *Service, err error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("transfer: nil host")
	}
	priv := h.Peerstore().PrivKey(h.ID())
	if priv == nil {
		return nil, fmt.Errorf("transfer: host %s has no private key in its peerstore", h.ID())
	}
	pub, err := crypto.MarshalPublicKey(priv.GetPublic())
	if err != nil {
		return nil, fmt.Errorf("transfer: marshal public key: %w", err)
	}
	s := &Service{
		cfg:       cfg,
		log:       cfg.Logger.Named("transfer"),
		h:         h,
		self:      h.ID(),
		priv:      priv,
		pub:       pub,
		now:       now,
		reg:       newRegistry(),
		dataConns: make(map[net.Conn]struct{}),
	}
	s.life, s.endLife = context.WithCancel(context.Background())
	s.stop = s.life.Done()
	defer func() {
		if err != nil {
			s.endLife()
		}
	}()
	s.pool = newConnPool(s)
	if _, err := rand.Read(s.key.secret[:]); err != nil {
		return nil, fmt.Errorf("transfer: ticket secret: %w", err)
	}
	s.ln, err = net.Listen("tcp", cfg.DataListen)
	if err != nil {
		return nil, fmt.Errorf("transfer: listen %s: %w", cfg.DataListen, err)
	}
	s.dataAddr = cfg.DataAdvertise
	if s.dataAddr == "" {
		s.dataAddr = s.ln.Addr().String()
	}
	s.wg.Add(1)
	go s.acceptLoop()
	h.SetStreamHandler(ProtocolID, s.handleStream)
	s.log.Debug("started", zap.String("data_addr", s.dataAddr), zap.Stringer("peer", s.self))
	return s, nil
}

// DataAddr is the TCP address consumers dial for payload bytes.
func (s *Service) DataAddr() string { return s.dataAddr }

// Close stops the data listener, removes the stream handler, closes every
// data connection (pooled, serving or pulling) and waits for the service's
// goroutines. Pulls in flight fail. It is idempotent.
func (s *Service) Close() error {
	s.closeOnce.Do(func() {
		s.h.RemoveStreamHandler(ProtocolID)
		s.mu.Lock()
		s.closed = true
		conns := s.dataConns
		s.dataConns = nil
		s.mu.Unlock()
		s.endLife()
		s.ln.Close()
		for c := range conns {
			c.Close()
		}
		s.pool.close()
		s.wg.Wait()
	})
	return nil
}

// enter registers a goroutine with the service; it fails once Close began.
func (s *Service) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

func (s *Service) producer() Producer {
	addrs := s.h.Addrs()
	p := Producer{PeerID: s.self.String(), DataAddr: s.dataAddr, P2PAddrs: make([]string, 0, len(addrs))}
	for _, a := range addrs {
		p.P2PAddrs = append(p.P2PAddrs, a.String())
	}
	return p
}

// Publish makes data pullable under a fresh payload id. The service keeps
// data until Release: the caller must not modify it afterwards. The Ref
// carries the payload's xxhash checksum.
func (s *Service) Publish(meta TensorMeta, data []byte) (Ref, error) {
	if err := meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return Ref{}, err
	}
	if int64(len(data)) != meta.Bytes() {
		return Ref{}, fmt.Errorf("%w: %d bytes for a %d-byte payload", ErrBufferSize, len(data), meta.Bytes())
	}
	if s.isClosed() {
		return Ref{}, ErrClosed
	}
	e := s.reg.add(meta, data)
	for k := range e.ready {
		off, n := meta.ChunkRange(k)
		if len(e.ready) > 1 {
			e.sums[k] = xxhash.Sum64(data[off : off+n])
		}
		close(e.ready[k])
	}
	return Ref{ID: e.id, Producer: s.producer(), Meta: meta, Checksum: xxhash.Sum64(data)}, nil
}

// Begin publishes a payload whose chunks are written later: consumers may
// start pulling at once and receive chunk k as soon as the producer calls
// ChunkReady(k). The Ref carries no whole-payload checksum; each chunk's
// checksum is taken at ChunkReady.
func (s *Service) Begin(meta TensorMeta) (*Pending, Ref, error) {
	if err := meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return nil, Ref{}, err
	}
	if s.isClosed() {
		return nil, Ref{}, ErrClosed
	}
	e := s.reg.add(meta, make([]byte, meta.Bytes()))
	p := &Pending{e: e, done: make([]bool, len(e.ready))}
	return p, Ref{ID: e.id, Producer: s.producer(), Meta: meta}, nil
}

// Release forgets a payload; later pulls of it fail with ErrNotFound. Pulls
// already being served finish. Releasing an unknown id is a no-op.
func (s *Service) Release(id string) { s.reg.remove(id) }

// Held reports how many payloads the service holds and their total size.
func (s *Service) Held() (count int, bytes int64) { return s.reg.held() }

func (s *Service) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// handleStream answers one TicketRequest on a control stream.
func (s *Service) handleStream(str network.Stream) {
	if !s.enter() {
		str.Reset()
		return
	}
	defer s.wg.Done()
	defer str.Close()
	defer context.AfterFunc(s.life, func() { str.Reset() })()
	str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	remote := str.Conn().RemotePeer()
	var req TicketRequest
	if err := ReadFrame(str, s.cfg.MaxFrame, &req); err != nil {
		s.log.Debug("bad ticket request", zap.Stringer("peer", remote), zap.Error(err))
		code := CodeBadRequest
		if errors.Is(err, ErrVersion) {
			code = CodeVersion
		}
		WriteFrame(str, &TicketResponse{V: WireVersion, ErrCode: code, ErrMsg: err.Error()})
		return
	}
	resp := s.issue(req.PayloadID, remote)
	if err := WriteFrame(str, &resp); err != nil {
		s.log.Debug("write ticket response", zap.Stringer("peer", remote), zap.Error(err))
	}
}

// issue mints a ticket for payload id, bound to consumer.
func (s *Service) issue(id string, consumer peer.ID) TicketResponse {
	e := s.reg.get(id)
	if e == nil {
		return TicketResponse{V: WireVersion, ErrCode: CodeNotFound, ErrMsg: "payload " + id}
	}
	t := s.key.mint(ticket{payloadID: id, consumer: consumer, expiry: s.now().Add(s.cfg.TicketTTL)})
	return TicketResponse{V: WireVersion, Ticket: t, Meta: e.meta, DataAddr: s.dataAddr}
}
