package transfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer/shm"
)

// maxUnixPath is the longest socket path the kernel accepts (sun_path less
// its terminating NUL).
const maxUnixPath = 107

// shmSocketPath is where the agent with peer id pid serves its arena.
func shmSocketPath(dir, pid string) string { return filepath.Join(dir, pid+".sock") }

// arenaID is the shm arena id of the agent with peer id pid: the id itself,
// so a consumer can check it reached the producer it meant to.
func arenaID(pid string) string { return pid }

// startShm serves the arena on a Unix socket in ShmDir. A stale socket of a
// previous run of this peer is replaced.
func (s *Service) startShm() error {
	id := arenaID(s.self.String())
	if len(id) > shm.MaxArenaIDLen {
		return fmt.Errorf("transfer: shm: peer id of %d bytes is too long for an arena id", len(id))
	}
	path := shmSocketPath(s.cfg.ShmDir, s.self.String())
	if len(path) > maxUnixPath {
		return fmt.Errorf("transfer: shm: socket path %s longer than %d bytes", path, maxUnixPath)
	}
	if err := os.MkdirAll(s.cfg.ShmDir, 0o700); err != nil {
		return fmt.Errorf("transfer: shm: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("transfer: shm: remove stale socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("transfer: shm: listen %s: %w", path, err)
	}
	// Close removes the socket itself; do not let the listener unlink it too
	// (a restarted peer may already own the path).
	ln.SetUnlinkOnClose(false)
	scfg := shm.DefaultServerConfig(id)
	scfg.Logger = s.log
	srv, err := shm.NewServer(s.arena, scfg)
	if err != nil {
		ln.Close()
		os.Remove(path)
		return fmt.Errorf("transfer: shm: %w", err)
	}
	s.shmSrv, s.shmPath = srv, path
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := srv.Serve(s.life, ln); err != nil && !errors.Is(err, shm.ErrClosed) && s.life.Err() == nil {
			s.log.Warn("shm serve", zap.Error(err))
		}
	}()
	return nil
}

// shmPeers caches, per producer, the consumer side of its shm socket: the
// producer's arena mapped read-only. A peer whose connection broke is
// replaced on the next pull, and unmapped once no view of it is in use.
type shmPeers struct {
	s *Service

	mu sync.Mutex
	// mu guards the fields below.
	peers  map[string]*shmPeer // by producer peer id
	closed bool
}

type shmPeer struct {
	p     *shm.Peer
	views int  // outstanding PullView views, guarded by shmPeers.mu
	dead  bool // replaced in the cache; closed when views reaches 0
}

func newShmPeers(s *Service) *shmPeers {
	return &shmPeers{s: s, peers: make(map[string]*shmPeer)}
}

// get returns the cached peer for the producer, dialling its socket first
// when there is none. The caller holds the returned peer until put.
func (c *shmPeers) get(ctx context.Context, prod Producer) (*shmPeer, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	if sp := c.peers[prod.PeerID]; sp != nil {
		sp.views++
		c.mu.Unlock()
		return sp, nil
	}
	c.mu.Unlock()
	p, err := shm.Dial(ctx, prod.ShmSocket, shm.SameUID())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	if want := arenaID(prod.PeerID); p.ArenaID() != want {
		p.Close()
		return nil, fmt.Errorf("%w: shm socket %s serves arena %q, want %q", ErrTransport, prod.ShmSocket, p.ArenaID(), want)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		p.Close()
		return nil, ErrClosed
	}
	if sp := c.peers[prod.PeerID]; sp != nil { // another pull dialled meanwhile
		p.Close()
		sp.views++
		return sp, nil
	}
	sp := &shmPeer{p: p, views: 1}
	c.peers[prod.PeerID] = sp
	return sp, nil
}

// put ends one use of sp; with broken set, sp is dropped from the cache so
// the next pull redials.
func (c *shmPeers) put(pid string, sp *shmPeer, broken bool) {
	c.mu.Lock()
	sp.views--
	if broken && c.peers[pid] == sp {
		delete(c.peers, pid)
		sp.dead = true
	}
	closeIt := sp.dead && sp.views == 0
	c.mu.Unlock()
	if closeIt {
		sp.p.Close()
	}
}

// forget drops the producer's cached peer: unmapped now, or when its last
// view is released.
func (c *shmPeers) forget(pid string) {
	c.mu.Lock()
	sp := c.peers[pid]
	if sp != nil {
		delete(c.peers, pid)
		sp.dead = true
	}
	closeIt := sp != nil && sp.views == 0
	c.mu.Unlock()
	if closeIt {
		sp.p.Close()
	}
}

// close unmaps every producer arena; views still held become invalid.
func (c *shmPeers) close() {
	c.mu.Lock()
	c.closed = true
	peers := c.peers
	c.peers = nil
	c.mu.Unlock()
	for _, sp := range peers {
		sp.p.Close()
	}
}

// shmBroken reports whether err means the shm connection itself failed (as
// opposed to a refused handle), so the peer must be redialled.
func shmBroken(err error) bool {
	return err != nil && !errors.Is(err, shm.ErrUnknownBuf) && !errors.Is(err, shm.ErrTooManyPins) &&
		!errors.Is(err, shm.ErrBadHandle) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// shmRoundTrip is the context for one pin round trip to a producer over its
// shm socket. A caller's cancel must not interrupt it: the peer connection is
// shared, and an interrupted exchange breaks it, which drops the pins of every
// other view open on it. The round trip is microseconds; IOTimeout bounds a
// producer that stopped answering.
func (s *Service) shmRoundTrip(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.cfg.IOTimeout)
}

// shmErr maps an shm error to the package's sentinels.
func shmErr(id string, err error) error {
	switch {
	case errors.Is(err, shm.ErrUnknownBuf):
		return fmt.Errorf("%w: %s (released in producer)", ErrNotFound, id)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("transfer: pull %s: %w", id, err)
	case errors.Is(err, shm.ErrBadHandle):
		return fmt.Errorf("%w: shm: %w", ErrProtocol, err)
	}
	return fmt.Errorf("%w: shm: %w", ErrUnreachable, err)
}

// watchStream is a control stream on which the producer reports chunks as
// they become ready.
type watchStream struct {
	s    *Service
	resp *TicketResponse
	next func() (int, error) // the next ready chunk
	done func()
}

// openWatch asks the producer for a ticket and, for a payload of more than
// one chunk, chunk readiness events.
func (s *Service) openWatch(ctx context.Context, pid peer.ID, ref Ref) (*watchStream, error) {
	if resp := s.issuedFor(ctx, ref, true); resp != nil {
		// Issued ahead with every chunk ready: no stream, no events.
		k := 0
		return &watchStream{s: s, resp: resp, done: func() {}, next: func() (int, error) {
			k++
			return k - 1, nil
		}}, nil
	}
	// Always watch: shm and rdma read the producer's memory directly, so even
	// a one-chunk payload must not be read before the producer marked it
	// ready (a Begin'd payload is published before it is written).
	str, resp, err := s.requestTicketStream(ctx, pid, ref, true)
	if err != nil {
		return nil, err
	}
	if resp.Meta.Bytes() != ref.Meta.Bytes() || resp.Meta.Chunks() != ref.Meta.Chunks() {
		str.close()
		return nil, fmt.Errorf("%w: producer meta %v does not match ref %v", ErrBadMeta, resp.Meta, ref.Meta)
	}
	w := &watchStream{s: s, resp: resp, done: str.close}
	want := 0
	w.next = func() (int, error) {
		for {
			var ev ChunkEvent
			if err := str.readEvent(&ev); err != nil {
				if ctx.Err() != nil {
					return 0, fmt.Errorf("transfer: pull %s: %w", ref.ID, ctx.Err())
				}
				return 0, fmt.Errorf("%w: %s: chunk events: %w", ErrUnreachable, pid, err)
			}
			if ev.ErrCode != "" {
				return 0, &RemoteError{Code: ev.ErrCode, Msg: ev.ErrMsg}
			}
			if ev.Chunk == -1 {
				continue
			}
			if ev.Chunk != want {
				return 0, fmt.Errorf("%w: chunk event %d, want %d", ErrProtocol, ev.Chunk, want)
			}
			want++
			return ev.Chunk, nil
		}
	}
	return w, nil
}

// pullShm copies a payload from the producer's arena into dst, chunk by
// chunk as the producer reports them ready.
func (s *Service) pullShm(ctx context.Context, pid peer.ID, ref Ref, dst []byte, onChunk func(int)) error {
	w, err := s.openWatch(ctx, pid, ref)
	if err != nil {
		return err
	}
	defer w.done()
	if w.resp.Shm == nil {
		return &fallbackError{errNotInArena}
	}
	h := *w.resp.Shm
	if h.Len != ref.Meta.Bytes() {
		return fmt.Errorf("%w: shm handle of %d bytes for a %d-byte payload", ErrProtocol, h.Len, ref.Meta.Bytes())
	}
	sp, err := s.shmCli.get(ctx, ref.Producer)
	if err != nil {
		if ctx.Err() != nil || errors.Is(err, ErrClosed) {
			return err
		}
		return &fallbackError{err}
	}
	vctx, cancel := s.shmRoundTrip(ctx)
	src, err := sp.p.View(vctx, h)
	cancel()
	if err != nil {
		s.shmCli.put(ref.Producer.PeerID, sp, shmBroken(err))
		return shmErr(ref.ID, err)
	}
	defer func() {
		sp.p.Release(h)
		s.shmCli.put(ref.Producer.PeerID, sp, false)
	}()
	for range ref.Meta.Chunks() {
		k, err := w.next()
		if err != nil {
			return err
		}
		off, n := ref.Meta.ChunkRange(k)
		if err := shm.Copy(ctx, dst[off:off+n], src[off:off+n]); err != nil {
			return fmt.Errorf("transfer: pull %s: %w", ref.ID, err)
		}
		if onChunk != nil {
			onChunk(k)
		}
	}
	return nil
}

// PullView returns a payload's bytes without copying them when the producer
// is on this host and reachable over shm: view is the producer's arena memory
// (read-only: writing faults), pinned so the producer cannot reuse it until
// release is called. For a payload of several chunks it waits for all of
// them. From any other producer (or with Config.Transport tcp or rdma) the
// payload is pulled into a buffer from this service's arena (the heap without
// one), which release frees. release is idempotent; view must not be used
// after it, nor after Close.
func (s *Service) PullView(ctx context.Context, ref Ref) (view []byte, release func(), err error) {
	if err := ref.Meta.Validate(s.cfg.MaxPayloadBytes); err != nil {
		return nil, nil, err
	}
	t, err := s.transportFor(ref)
	if err != nil {
		return nil, nil, err
	}
	if t == TransportShm {
		pid, err := peer.Decode(ref.Producer.PeerID)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: producer peer id %q: %v", ErrBadMeta, ref.Producer.PeerID, err)
		}
		view, release, err := s.viewShm(ctx, pid, ref)
		if !errors.Is(err, errNotInArena) || s.cfg.Transport == TransportShm {
			return view, release, err
		}
	}
	b, err := s.Alloc(ref.Meta.Bytes())
	if err != nil {
		return nil, nil, err
	}
	if err := s.PullInto(ctx, ref, b.Bytes()); err != nil {
		b.Release()
		return nil, nil, err
	}
	return b.Bytes(), b.Release, nil
}

// errNotInArena means the producer holds a payload outside its arena, so it
// cannot be read in place.
var errNotInArena = fmt.Errorf("%w: producer holds the payload outside its arena", ErrTransport)

func (s *Service) viewShm(ctx context.Context, pid peer.ID, ref Ref) ([]byte, func(), error) {
	if !s.enter() {
		return nil, nil, ErrClosed
	}
	defer s.wg.Done()
	w, err := s.openWatch(ctx, pid, ref)
	if err != nil {
		return nil, nil, err
	}
	defer w.done()
	if w.resp.Shm == nil {
		return nil, nil, errNotInArena
	}
	h := *w.resp.Shm
	if h.Len != ref.Meta.Bytes() {
		return nil, nil, fmt.Errorf("%w: shm handle of %d bytes for a %d-byte payload", ErrProtocol, h.Len, ref.Meta.Bytes())
	}
	for range ref.Meta.Chunks() {
		if _, err := w.next(); err != nil {
			return nil, nil, err
		}
	}
	sp, err := s.shmCli.get(ctx, ref.Producer)
	if err != nil {
		return nil, nil, err
	}
	vctx, cancel := s.shmRoundTrip(ctx)
	view, err := sp.p.View(vctx, h)
	cancel()
	if err != nil {
		s.shmCli.put(ref.Producer.PeerID, sp, shmBroken(err))
		return nil, nil, shmErr(ref.ID, err)
	}
	var once sync.Once
	release := func() {
		once.Do(func() {
			sp.p.Release(h)
			s.shmCli.put(ref.Producer.PeerID, sp, false)
		})
	}
	return view, release, nil
}
