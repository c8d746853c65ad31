package transfer

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

// Buffer is payload memory handed out by Alloc: a region of the service's
// arena, or a heap slice when the service has no arena. Engines write outputs
// into one and Publish its Bytes without a copy; consumers pass one's Bytes
// as the destination of PullInto or PullChunks so a transfer lands straight
// in the arena (and, for rdma, in registered memory).
//
// An arena region is freed once the Buffer is released, every payload
// published from it has been released, and no transfer still reads it.
// Bytes must not be used after Release, nor after the Service is closed.
type Buffer struct {
	s    *Service
	ab   arena.Buf // the region, when inArena
	b    []byte
	refs atomic.Int32 // owner + payloads publishing it; the region is freed at 0
	done atomic.Bool  // Release was called
	// inArena is false for heap buffers, which need no accounting.
	inArena bool
}

// Bytes is the buffer's memory, exactly as long as asked of Alloc.
func (b *Buffer) Bytes() []byte { return b.b }

// Release gives the buffer back. It is idempotent. A payload published from
// the buffer stays valid until its own Release.
func (b *Buffer) Release() {
	if b.done.CompareAndSwap(false, true) {
		b.unref()
	}
}

func (b *Buffer) unref() {
	if !b.inArena {
		return
	}
	if b.refs.Add(-1) == 0 {
		b.s.freeBuffer(b)
	}
}

// Alloc returns a buffer of n bytes from the service's arena, or from the
// heap when the service has no arena. An arena without room for n bytes is an
// error wrapping arena.ErrNoSpace: the caller may wait for releases or use a
// heap slice, which every call also accepts.
func (s *Service) Alloc(n int64) (*Buffer, error) {
	if n <= 0 || n > s.cfg.MaxPayloadBytes {
		return nil, fmt.Errorf("transfer: alloc of %d bytes not in [1,%d]", n, s.cfg.MaxPayloadBytes)
	}
	if s.arena == nil {
		return &Buffer{s: s, b: make([]byte, n)}, nil
	}
	return s.allocArena(n, 1)
}

// allocArena carves n bytes from the arena, with refs initial references.
func (s *Service) allocArena(n int64, refs int32) (*Buffer, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	ab, err := s.arena.Alloc(n)
	if err != nil {
		return nil, fmt.Errorf("transfer: alloc %d bytes: %w", n, err)
	}
	b := &Buffer{s: s, ab: ab, b: s.arena.Slice(ab), inArena: true}
	b.refs.Store(refs)
	s.bufs[ab.Off] = b
	return b, nil
}

// freeBuffer returns b's region to the arena; the arena defers it while a
// transfer pins the region.
func (s *Service) freeBuffer(b *Buffer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bufs[b.ab.Off] == b {
		delete(s.bufs, b.ab.Off)
	}
	if s.arenaClosed {
		return
	}
	if err := s.arena.Free(b.ab); err != nil {
		s.log.Warn("arena free", zap.Int64("off", b.ab.Off), zap.Error(err))
	}
}

// arenaOffset is the offset of p's first byte in the arena, or -1 when p does
// not lie entirely inside it.
func (s *Service) arenaOffset(p []byte) int64 {
	if s.arena == nil || len(p) == 0 {
		return -1
	}
	mem := s.arena.Bytes()
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	if at < base || at-base > uintptr(len(mem)) || uintptr(len(p)) > uintptr(len(mem))-(at-base) {
		return -1
	}
	return int64(at - base)
}

// bufferFor returns the live Buffer whose Bytes are exactly p, taking a
// reference on it, or nil.
func (s *Service) bufferFor(p []byte) *Buffer {
	off := s.arenaOffset(p)
	if off < 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.bufs[off]
	if b == nil || b.ab.Len != int64(len(p)) {
		return nil
	}
	for {
		n := b.refs.Load()
		if n <= 0 {
			return nil
		}
		if b.refs.CompareAndSwap(n, n+1) {
			return b
		}
	}
}

// Stats is a snapshot of what a Service holds.
type Stats struct {
	// Payloads and PayloadBytes count the published payloads held.
	Payloads     int
	PayloadBytes int64
	// HasArena is true when the service owns an arena; Arena is then its
	// occupancy (Arena.Free is the free buffer space agents gossip, and
	// Arena.Fragmentation() how splintered it is).
	HasArena bool
	Arena    arena.Stats
	// HeapFallbacks counts Begin calls served from the heap because the
	// arena had no room.
	HeapFallbacks int64
	// RDMA is true when an RDMA device is open and the arena registered.
	RDMA bool
	// Pulls counts completed pulls by the transport that moved the bytes
	// ("local", "shm", "rdma", "tcp"; an auto-mode fallback counts as tcp).
	Pulls map[string]int64
	// StorePulls counts, the same way, the pulls made for the Store (with a
	// ForStore context): copies onto holders and reads of stored objects.
	StorePulls map[string]int64
	// IssuedPulls counts the pulls that used a ticket their producer issued
	// ahead (WithIssued) instead of asking for one.
	IssuedPulls int64
	// Transfers and StoreTransfers are Pulls and StorePulls with the bytes
	// moved and the time taken, by transport.
	Transfers, StoreTransfers map[string]PullTotals
}

// transports indexes pull counters.
var transports = [...]string{TransportLocal, TransportShm, TransportRDMA, TransportTCP}

// pullCounters counts completed pulls per transport, with the bytes they
// moved and the time they took.
type pullCounters [len(transports)]struct {
	n, bytes, nanos atomic.Int64
}

func (p *pullCounters) add(t string, bytes int64, d time.Duration) {
	for i, name := range transports {
		if name == t {
			p[i].n.Add(1)
			p[i].bytes.Add(bytes)
			p[i].nanos.Add(int64(d))
			return
		}
	}
}

func (p *pullCounters) snapshot() map[string]int64 {
	m := make(map[string]int64, len(transports))
	for i, name := range transports {
		m[name] = p[i].n.Load()
	}
	return m
}

// PullTotals are the completed pulls of one transport since the service
// started: how many, the bytes they moved and the time they took (from
// the pull's start to its last byte).
type PullTotals struct {
	Pulls int64
	Bytes int64
	Time  time.Duration
}

func (p *pullCounters) totals() map[string]PullTotals {
	m := make(map[string]PullTotals, len(transports))
	for i, name := range transports {
		m[name] = PullTotals{Pulls: p[i].n.Load(), Bytes: p[i].bytes.Load(), Time: time.Duration(p[i].nanos.Load())}
	}
	return m
}

// Stats returns a snapshot of the payloads and arena the service holds.
func (s *Service) Stats() Stats {
	st := Stats{HeapFallbacks: s.heapFallbacks.Load(), RDMA: s.rdma != nil, Pulls: s.pulls.snapshot(), StorePulls: s.storePulls.snapshot(), IssuedPulls: s.issuedPulls.Load(),
		Transfers: s.pulls.totals(), StoreTransfers: s.storePulls.totals()}
	st.Payloads, st.PayloadBytes = s.reg.held()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.arena != nil && !s.arenaClosed {
		st.HasArena = true
		st.Arena = s.arena.Stats()
	}
	return st
}

// ArenaFd returns the arena's memfd and its size, for a local process (an
// external engine) that maps the arena once and then reads and writes
// payloads by offset. ok is false without an arena. The fd stays owned by
// the service: pass it on (SCM_RIGHTS duplicates it), never close it.
func (s *Service) ArenaFd() (fd int, size int64, ok bool) {
	if s.arena == nil {
		return -1, 0, false
	}
	return s.arena.Fd(), s.arena.Size(), true
}

// ArenaOffset is the offset of p's first byte in the arena; ok is false when
// p does not lie entirely inside it (a heap buffer).
func (s *Service) ArenaOffset(p []byte) (off int64, ok bool) {
	off = s.arenaOffset(p)
	return off, off >= 0
}

// Retain keeps the arena region holding p (any part of a live Buffer)
// allocated until the returned function is called, even if its Buffer and
// payloads are released meanwhile: someone outside the Go heap's sight (an
// external engine writing through its own mapping) may still touch it. ok is
// false when p is not inside a live arena buffer.
func (s *Service) Retain(p []byte) (release func(), ok bool) {
	off := s.arenaOffset(p)
	if off < 0 {
		return nil, false
	}
	end := off + int64(len(p))
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.bufs {
		if b.ab.Off > off || b.ab.Off+b.ab.Len < end {
			continue
		}
		for {
			n := b.refs.Load()
			if n <= 0 {
				return nil, false
			}
			if b.refs.CompareAndSwap(n, n+1) {
				var once sync.Once
				return func() { once.Do(b.unref) }, true
			}
		}
	}
	return nil, false
}
