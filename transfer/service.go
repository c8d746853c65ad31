package transfer

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/latentmesh/latentmesh/transfer/arena"
	"github.com/latentmesh/latentmesh/transfer/rdma"
	"github.com/latentmesh/latentmesh/transfer/shm"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/zeebo/xxh3"
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
	// ChecksumTCP verifies an XXH3 checksum of every 256 KiB block on pulls
	// over TCP, as each block lands. On by default: where the kernel's
	// copies already saturate the CPU it costs about a tenth of the rate
	// (measured on 2 cores), a fair price against a wrong image.
	ChecksumTCP bool
	// TCPCongestion is the congestion control the data plane's TCP senders
	// run (Linux TCP_CONGESTION, set on the listener so every accepted
	// connection inherits it); empty keeps the system default. cubic, the
	// Linux default, because a pull is a bulk transfer inside one cluster:
	// with bbr, a common system default, the pacing timers of four striped
	// flows cost enough CPU on a 2-core machine to take a quarter off a
	// checksummed pull (see docs/ARCHITECTURE.md#measured). When the kernel
	// lacks it or does not allow it to this process, New logs that once and
	// the system default stays.
	TCPCongestion string
	// Transport picks how payload bytes move: TransportAuto chooses per
	// producer (same host with arenas on both ends -> shm; both ends with an
	// RDMA device -> rdma; else tcp). A forced transport that cannot reach a
	// producer fails the pull instead of falling back.
	Transport string
	// Arena configures the service's one registered memory region. Size 0
	// means no arena: payload buffers come from the Go heap and the service
	// offers no shm or rdma.
	Arena arena.Config
	// RDMA configures the RDMA device, used when Transport is auto or rdma
	// and the build has the rdma tag and the host a device.
	RDMA rdma.Config
	// ShmDir is the directory holding the shm Unix sockets of the agents on
	// this host, one per peer id. Consumers find a producer's socket there.
	ShmDir string
	// Logger receives the service's logs; named "transfer".
	Logger *zap.Logger

	// Admit says whether a peer may use this service at all: it is asked
	// for every control stream (ticket request), every data-plane
	// connection once its handshake proved the peer id, and every RDMA
	// queue pair. The agent admits the peers registered in etcd. nil
	// admits every peer (tests, benchmarks); the service always admits
	// itself. It must be cheap and must not block: it runs on every
	// connection.
	Admit func(p peer.ID) bool
	// AuthorizePayload says whether peer p, already admitted, may have a
	// ticket for payload id, given the opaque proof its TicketRequest
	// carried (see WithTicketProof). A non-nil error refuses the ticket
	// with CodeDenied. nil authorizes every admitted peer. It may do I/O
	// (the agent reads the consumer's claim from etcd): ctx is bounded by
	// IOTimeout.
	AuthorizePayload func(ctx context.Context, id string, p peer.ID, proof []byte) error
	// MaxDataConns bounds the data-plane connections this producer serves
	// at once, handshaking ones included; excess connections are refused
	// with CodeBusy before any handshake work. Each costs a goroutine, a
	// file descriptor and socket buffers; 1024 is far above what a mesh of
	// a few hundred nodes pulling Conns-wide needs.
	MaxDataConns int
	// MaxDataConnsPerPeer bounds the authenticated data-plane connections
	// one consumer holds open at once; more are refused with CodeBusy. A
	// consumer pools Conns per producer, but concurrent pulls (stage
	// inputs, Store copies) each stripe over their own: 64 covers sixteen
	// four-wide pulls at once.
	MaxDataConnsPerPeer int

	// openRDMA, when set (by this package's tests, with an rdma.Fabric),
	// replaces rdma.Available and rdma.Open.
	openRDMA func(rdma.Config, *zap.Logger) (*rdma.Device, error)
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
		TCPCongestion:   "cubic",
		// Let each pull pick the fastest transport both ends can use.
		Transport: TransportAuto,
		// No arena by default: tests and tcp-only agents keep heap buffers;
		// agents size it (arena.DefaultConfig) from their role.
		Arena: arena.Config{},
		// Per-host rendezvous; every agent on the host must agree on it.
		ShmDir: filepath.Join(os.TempDir(), "latentmesh-shm"),
		RDMA:   rdma.DefaultConfig(),
		Logger: zap.NewNop(),
		// Admit and AuthorizePayload nil: every peer; the agent sets both.
		MaxDataConns:        1024,
		MaxDataConnsPerPeer: 64,
	}
}

// Transports, the values of Config.Transport and of TransportFor.
const (
	TransportAuto = "auto"
	TransportTCP  = "tcp"
	TransportShm  = "shm"
	TransportRDMA = "rdma"
)

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
	case c.MaxDataConns < 1:
		return fmt.Errorf("transfer: config: MaxDataConns %d < 1", c.MaxDataConns)
	case c.MaxDataConnsPerPeer < 1:
		return fmt.Errorf("transfer: config: MaxDataConnsPerPeer %d < 1", c.MaxDataConnsPerPeer)
	case !validCongestion(c.TCPCongestion):
		return fmt.Errorf("transfer: config: TCPCongestion %q is not a congestion control name", c.TCPCongestion)
	}
	switch c.Transport {
	case TransportAuto, TransportTCP:
	case TransportShm, TransportRDMA:
		if c.Arena.Size == 0 {
			return fmt.Errorf("transfer: config: Transport %q needs an arena (Arena.Size > 0)", c.Transport)
		}
	default:
		return fmt.Errorf("transfer: config: Transport %q not one of auto, tcp, shm, rdma", c.Transport)
	}
	if c.Arena.Size < 0 {
		return fmt.Errorf("transfer: config: Arena.Size %d < 0", c.Arena.Size)
	}
	if c.Arena.Size > 0 && c.ShmDir == "" && c.Transport != TransportTCP {
		return errors.New("transfer: config: ShmDir is empty")
	}
	return nil
}

// Producer says where a payload lives and how to reach its holder.
type Producer struct {
	PeerID   string   `msgpack:"peer_id" json:"peer_id"`
	P2PAddrs []string `msgpack:"p2p_addrs" json:"p2p_addrs"`
	DataAddr string   `msgpack:"data_addr" json:"data_addr"`
	// Host identifies the producer's machine (hostname and kernel boot id);
	// a consumer with the same Host may use shm.
	Host string `msgpack:"host,omitempty" json:"host,omitempty"`
	// ShmSocket is the Unix socket the producer serves its arena on; empty
	// without an arena.
	ShmSocket string `msgpack:"shm_socket,omitempty" json:"shm_socket,omitempty"`
	// RDMA is true when the producer has an RDMA device open with its arena
	// registered.
	RDMA bool `msgpack:"rdma,omitempty" json:"rdma,omitempty"`
}

// Ref names a published payload. It is small and serialisable (task records
// in etcd carry it); anyone holding it may ask the producer for a ticket.
type Ref struct {
	ID       string     `msgpack:"id" json:"id"`
	Producer Producer   `msgpack:"producer" json:"producer"`
	Meta     TensorMeta `msgpack:"meta" json:"meta"`
	// Checksum is the XXH3-64 of the whole payload; 0 means none (chunked
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

	key     ticketKey
	reg     *registry
	pool    *connPool
	refused refusalLog

	ln       net.Listener
	dataAddr string
	hostID   string // hostIdentity, advertised in Producer.Host

	arena   *arena.Arena // nil without Config.Arena.Size
	shmSrv  *shm.Server  // serves the arena to same-host consumers; nil without an arena
	shmPath string       // the Unix socket shmSrv listens on
	shmCli  *shmPeers    // consumer side: one shm.Peer per producer
	rdma    *rdmaState   // nil unless an RDMA device is open

	heapFallbacks atomic.Int64
	issuedPulls   atomic.Int64 // pulls that used an issued ticket (Issue)
	pulls         pullCounters // stage handoffs
	storePulls    pullCounters // pulls with a ForStore context
	onTicket      atomic.Pointer[func(payloadID string)]

	life      context.Context // cancelled by Close; bounds pulls and waits
	endLife   context.CancelFunc
	stop      <-chan struct{} // life.Done()
	closeOnce sync.Once
	wg        sync.WaitGroup

	mu sync.Mutex
	// mu guards the fields below.
	closed      bool
	arenaClosed bool
	dataConns   map[net.Conn]struct{} // producer side, closed on Close
	peerConns   map[peer.ID]int       // authenticated producer-side connections by consumer
	bufs        map[int64]*Buffer     // live arena buffers by offset
}

// New starts a Service on h: it listens on cfg.DataListen, registers the
// ProtocolID stream handler and, with an arena, maps it and serves it to
// same-host consumers on a Unix socket in cfg.ShmDir. With cfg.Transport
// auto or rdma it opens an RDMA device; in auto mode a host without one is
// logged once and pulls use shm or tcp. The caller owns h and closes it after
// Close.
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
		hostID:    hostIdentity(),
		dataConns: make(map[net.Conn]struct{}),
		peerConns: make(map[peer.ID]int),
		bufs:      make(map[int64]*Buffer),
	}
	s.refused = refusalLog{log: s.log, now: now}
	s.life, s.endLife = context.WithCancel(context.Background())
	s.stop = s.life.Done()
	defer func() {
		if err != nil {
			s.endLife()
			s.closeTransports()
		}
	}()
	s.pool = newConnPool(s)
	s.shmCli = newShmPeers(s)
	if _, err := rand.Read(s.key.secret[:]); err != nil {
		return nil, fmt.Errorf("transfer: ticket secret: %w", err)
	}
	if cfg.Arena.Size > 0 {
		if s.arena, err = arena.New(cfg.Arena); err != nil {
			return nil, fmt.Errorf("transfer: %w", err)
		}
		if err := s.startShm(); err != nil {
			if cfg.Transport == TransportShm {
				return nil, err
			}
			s.log.Warn("shm unavailable; same-host pulls use tcp", zap.Error(err))
		}
	}
	if err := s.startRDMA(); err != nil {
		return nil, err
	}
	var ccErr error
	lc := net.ListenConfig{Control: listenControl(cfg.TCPCongestion, &ccErr)}
	s.ln, err = lc.Listen(context.Background(), "tcp", cfg.DataListen)
	if err != nil {
		return nil, fmt.Errorf("transfer: listen %s: %w", cfg.DataListen, err)
	}
	if ccErr != nil {
		s.log.Warn(congestionFallbackMsg, zap.String("wanted", cfg.TCPCongestion),
			zap.String("system_default", systemCongestion()), zap.Error(ccErr))
	}
	s.dataAddr = cfg.DataAdvertise
	if s.dataAddr == "" {
		s.dataAddr = s.ln.Addr().String()
	}
	s.wg.Add(1)
	go s.acceptLoop()
	h.SetStreamHandler(ProtocolID, s.handleStream)
	if s.rdma != nil {
		h.SetStreamHandler(RDMAProtocolID, s.handleRDMAStream)
	}
	s.log.Debug("started", zap.String("data_addr", s.dataAddr), zap.Stringer("peer", s.self),
		zap.String("transport", cfg.Transport), zap.Bool("arena", s.arena != nil),
		zap.String("shm_socket", s.shmPath), zap.Bool("rdma", s.rdma != nil))
	return s, nil
}

// MaxPayloadBytes is the largest payload this service publishes or pulls.
func (s *Service) MaxPayloadBytes() int64 { return s.cfg.MaxPayloadBytes }

// DataAddr is the TCP address consumers dial for payload bytes.
func (s *Service) DataAddr() string { return s.dataAddr }

// Close stops the data listener, removes the stream handler, closes every
// data connection (pooled, serving or pulling) and waits for the service's
// goroutines. Pulls in flight fail. It is idempotent.
//
// The arena is unmapped last: every Buffer's Bytes, and every view PullView
// returned, is invalid after Close.
func (s *Service) Close() error {
	s.closeOnce.Do(func() {
		s.h.RemoveStreamHandler(ProtocolID)
		if s.rdma != nil {
			s.h.RemoveStreamHandler(RDMAProtocolID)
		}
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
		s.closeTransports()
	})
	return nil
}

// closeTransports closes shm, rdma and the arena, in that order: nothing may
// read or write the arena once it is unmapped. Every goroutine that touches
// the arena has been waited for.
func (s *Service) closeTransports() {
	if s.shmCli != nil {
		s.shmCli.close()
	}
	if s.shmSrv != nil {
		s.shmSrv.Close()
		os.Remove(s.shmPath)
	}
	if s.rdma != nil {
		s.rdma.close()
	}
	s.reg.drain() // gives lent memory back; arena memory is unmapped below
	if s.arena != nil {
		s.mu.Lock()
		s.arenaClosed = true
		s.bufs = nil
		s.mu.Unlock()
		if err := s.arena.Close(); err != nil {
			s.log.Warn("close arena", zap.Error(err))
		}
	}
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
	p := Producer{
		PeerID:    s.self.String(),
		DataAddr:  s.dataAddr,
		P2PAddrs:  make([]string, 0, len(addrs)),
		Host:      s.hostID,
		ShmSocket: s.shmPath,
		RDMA:      s.rdma != nil,
	}
	for _, a := range addrs {
		p.P2PAddrs = append(p.P2PAddrs, a.String())
	}
	return p
}

// Publish makes data pullable under a fresh payload id. The service keeps
// data until Release: the caller must not modify it afterwards. The Ref
// carries the payload's XXH3 checksum.
//
// When data is exactly the Bytes of a Buffer from Alloc, the payload stays in
// the arena with no copy, and same-host (shm) and rdma consumers read it
// there; the Buffer may be released at once, its memory lives on until
// Release(id). Any other slice is held as it is, also without a copy, and
// travels by tcp only.
func (s *Service) Publish(meta TensorMeta, data []byte) (Ref, error) {
	return s.publish(meta, data, nil, false, 0, nil)
}

// PublishCopy publishes data, a copy of a payload that the pull which made
// it already verified (block by block over tcp; shm copies memory on one
// host), without hashing it again at publish: the checksums PullCopy
// received serve consumers, and a chunk that came without them is hashed
// the first time a consumer reads it over tcp. The Ref carries checksum, the
// source's whole-payload XXH3 (0 when unknown). The Store publishes its
// copies so: a put then costs its copies, not a hash pass per holder. free,
// when not nil, makes data lent memory as with PublishLent.
func (s *Service) PublishCopy(meta TensorMeta, data []byte, checksum uint64, sums BlockSums, free func()) (Ref, error) {
	var lent *lentMem
	if free != nil {
		lent = &lentMem{free: free}
	}
	ref, err := s.publish(meta, data, lent, true, checksum, sums)
	if err != nil && free != nil {
		free()
	}
	return ref, err
}

// PublishLent publishes memory the caller lent and must give back itself,
// such as a mapped spill file: free is called once, after Release (or Close)
// when no transfer reads the memory any more. The payload travels by tcp
// (or to this service itself); a publish that fails calls free at once.
func (s *Service) PublishLent(meta TensorMeta, data []byte, free func()) (Ref, error) {
	if free == nil {
		return Ref{}, errors.New("transfer: PublishLent without a free function")
	}
	ref, err := s.publish(meta, data, &lentMem{free: free}, false, 0, nil)
	if err != nil {
		free()
	}
	return ref, err
}

func (s *Service) publish(meta TensorMeta, data []byte, lent *lentMem, lazy bool, checksum uint64, known BlockSums) (Ref, error) {
	if err := meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return Ref{}, err
	}
	if int64(len(data)) != meta.Bytes() {
		return Ref{}, fmt.Errorf("%w: %d bytes for a %d-byte payload", ErrBufferSize, len(data), meta.Bytes())
	}
	if s.isClosed() {
		return Ref{}, ErrClosed
	}
	var owner *Buffer
	if lent == nil {
		owner = s.bufferFor(data)
	}
	if lazy {
		e := s.reg.add(meta, data, owner, s.arenaPinner(owner), checksum, lent, true)
		_, cs := meta.ChunkRange(0)
		for k := range e.ready {
			if k < len(known) && int64(len(known[k])) == (cs+sumBlock-1)/sumBlock {
				e.lazy[k].Do(func() { e.sums[k] = known[k] })
			}
			close(e.ready[k])
		}
		return Ref{ID: e.id, Producer: s.producer(), Meta: meta, Checksum: e.whole}, nil
	}
	d := xxh3.New()
	sums := make([][]uint64, meta.Chunks())
	for k := range sums {
		off, n := meta.ChunkRange(k)
		sums[k] = blockSums(data[off:off+n], nil)
		d.Write(data[off : off+n])
	}
	e := s.reg.add(meta, data, owner, s.arenaPinner(owner), d.Sum64(), lent, false)
	for k := range e.ready {
		e.sums[k] = sums[k]
		close(e.ready[k])
	}
	return Ref{ID: e.id, Producer: s.producer(), Meta: meta, Checksum: e.whole}, nil
}

// arenaPinner is the arena as an entry's pinner when owner is set.
func (s *Service) arenaPinner(owner *Buffer) pinner {
	if owner == nil {
		return nil
	}
	return s.arena
}

// Begin publishes a payload whose chunks are written later: consumers may
// start pulling at once and receive chunk k as soon as the producer calls
// ChunkReady(k). The Ref carries no whole-payload checksum; each chunk's
// checksums are taken at ChunkReady (or handed over by ChunkCopied). The buffer comes from the arena when it
// has room, else from the heap (counted in Stats.HeapFallbacks).
func (s *Service) Begin(meta TensorMeta) (*Pending, Ref, error) {
	if err := meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return nil, Ref{}, err
	}
	if s.isClosed() {
		return nil, Ref{}, ErrClosed
	}
	var owner *Buffer
	var buf []byte
	if s.arena != nil {
		// Two references: the payload's (dropped by Release) and the
		// writer's (dropped by Pending.Done), so a release while the writer
		// is still filling the buffer cannot hand the region to someone else.
		b, err := s.allocArena(meta.Bytes(), 2)
		switch {
		case err == nil:
			owner, buf = b, b.Bytes()
		case errors.Is(err, arena.ErrNoSpace):
			s.heapFallbacks.Add(1)
			s.log.Debug("arena full, payload on heap", zap.Int64("bytes", meta.Bytes()), zap.Error(err))
		default:
			return nil, Ref{}, err
		}
	}
	if buf == nil {
		buf = make([]byte, meta.Bytes())
	}
	e := s.reg.add(meta, buf, owner, s.arenaPinner(owner), 0, nil, true)
	p := &Pending{e: e, done: make([]bool, len(e.ready)), left: len(e.ready)}
	return p, Ref{ID: e.id, Producer: s.producer(), Meta: meta}, nil
}

// Release forgets a payload; later pulls of it fail with ErrNotFound. Pulls
// already being served finish, and arena memory they read stays allocated
// until they do. Releasing an unknown id is a no-op.
func (s *Service) Release(id string) {
	e := s.reg.remove(id)
	if e != nil && s.rdma != nil {
		s.rdma.dropPayload(id) // later READs of it fail with a remote access error
	}
	if e != nil && e.owner != nil {
		e.owner.unref()
	}
}

// Forget drops what this service keeps for a peer that has left the mesh:
// as a consumer, its shm mapping of the peer's arena (which keeps that memory
// alive until unmapped), idle data connections and RDMA queue pair; as a
// producer, the queue pair the peer read through. Pulls in flight over tcp
// or shm are not affected; an RDMA READ in flight on a dropped queue pair
// fails, as it would once the peer is gone.
func (s *Service) Forget(peerID string) {
	if s.shmCli != nil {
		s.shmCli.forget(peerID)
	}
	pid, err := peer.Decode(peerID)
	if err != nil {
		return
	}
	s.pool.forget(pid)
	if s.rdma != nil {
		s.rdma.forget(pid)
	}
}

// HeldIDs lists the ids of the payloads the service holds.
func (s *Service) HeldIDs() []string { return s.reg.ids() }

// Held reports how many payloads the service holds and their total size.
// Stats adds the arena's occupancy.
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
	if !s.admit(remote) {
		s.refused.refuse("ticket", remote, "not admitted")
		WriteFrame(str, &TicketResponse{V: WireVersion, ErrCode: CodeDenied, ErrMsg: "peer not admitted"})
		return
	}
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
	if err := s.authorizePayload(req.PayloadID, remote, req.Proof); err != nil {
		s.refused.refuse("payload", remote, err.Error(), zap.String("payload", req.PayloadID))
		WriteFrame(str, &TicketResponse{V: WireVersion, ErrCode: CodeDenied, ErrMsg: "not authorized for payload " + req.PayloadID})
		return
	}
	resp := s.issue(req.PayloadID, remote)
	if err := WriteFrame(str, &resp); err != nil {
		s.log.Debug("write ticket response", zap.Stringer("peer", remote), zap.Error(err))
		return
	}
	if req.Watch && resp.ErrCode == "" {
		s.watch(str, req.PayloadID)
	}
}

// watch sends a ChunkEvent for each chunk of payload id, in index order, as
// it becomes ready, with heartbeats in between so the consumer can tell a
// slow producer from a dead one.
func (s *Service) watch(str network.Stream, id string) {
	e := s.reg.get(id)
	if e == nil {
		WriteFrame(str, &ChunkEvent{V: WireVersion, Chunk: -1, ErrCode: CodeNotFound, ErrMsg: "payload released"})
		return
	}
	beat := s.cfg.IOTimeout / 3
	for k := range e.ready {
		for {
			str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
			t := time.NewTimer(beat)
			ev := ChunkEvent{V: WireVersion, Chunk: k}
			select {
			case <-e.ready[k]:
			case <-t.C:
				ev.Chunk = -1
			case <-e.released:
				t.Stop()
				WriteFrame(str, &ChunkEvent{V: WireVersion, Chunk: -1, ErrCode: CodeNotFound, ErrMsg: "payload released"})
				return
			case <-s.stop:
				t.Stop()
				WriteFrame(str, &ChunkEvent{V: WireVersion, Chunk: -1, ErrCode: CodeShuttingDown, ErrMsg: "producer closing"})
				return
			}
			t.Stop()
			if err := WriteFrame(str, &ev); err != nil {
				s.log.Debug("watch write", zap.Error(err))
				return
			}
			if ev.Chunk == k {
				break
			}
		}
	}
}

// OnTicket sets f to be called with the payload id of every ticket issued:
// every pull by another service starts with one. The Store uses it to keep
// its least-recently-used order. f must not block.
func (s *Service) OnTicket(f func(payloadID string)) { s.onTicket.Store(&f) }

// issue mints a ticket for payload id, bound to consumer.
func (s *Service) issue(id string, consumer peer.ID) TicketResponse {
	e := s.reg.get(id)
	if e == nil {
		return TicketResponse{V: WireVersion, ErrCode: CodeNotFound, ErrMsg: "payload " + id}
	}
	if f := s.onTicket.Load(); f != nil && *f != nil {
		(*f)(id)
	}
	t := s.key.mint(ticket{payloadID: id, consumer: consumer, expiry: s.now().Add(s.cfg.TicketTTL)})
	resp := TicketResponse{V: WireVersion, Ticket: t, Meta: e.meta, DataAddr: s.dataAddr, Checksum: e.whole}
	if e.owner != nil {
		if s.shmSrv != nil {
			h := s.shmSrv.Handle(e.owner.ab)
			resp.Shm = &h
		}
		if s.rdma != nil {
			resp.RDMA = s.rdmaRegion(e)
		}
	}
	return resp
}
