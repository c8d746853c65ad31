package transfer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

// entry is one payload held by a producer. buf, owner, meta and ready never
// change after creation; sums[k] is written before ready[k] is closed, so a
// reader that has seen ready[k] closed may read sums[k] and buf's chunk k.
type entry struct {
	id    string
	meta  TensorMeta
	buf   []byte
	owner *Buffer         // the arena buffer buf is, holding a reference; nil for heap memory
	arena pinner          // owner's arena, when owner is set
	ready []chan struct{} // one per chunk, closed when the chunk is readable
	sums  [][]uint64      // per chunk, XXH3 of each sumBlock of it; valid once ready[k] is closed
	whole uint64          // XXH3 of the payload when published whole; 0 for Begin
	// released is closed when the payload is released (or the service
	// closes), so pulls waiting for chunks that will never come end with
	// ErrNotFound instead of waiting on heartbeats forever.
	released chan struct{}

	// lent is set for memory the caller lent with PublishLent (a mapped
	// spill file): it is given back once the payload is released and no
	// transfer reads it any more.
	lent *lentMem
	// lazy is set for a payload published with PublishCopy or Begin:
	// lazy[k] guards sums[k], which are set once, when known (a copy's,
	// or taken by ChunkReady), else computed on the first tcp read of
	// chunk k.
	lazy []sync.Once
}

// lentMem counts the transfers reading lent memory and gives it back after
// the last one once the payload is released.
type lentMem struct {
	mu sync.Mutex
	// mu guards the fields below.
	readers int
	retired bool
	free    func()
}

func (l *lentMem) pin() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.retired {
		return false
	}
	l.readers++
	return true
}

func (l *lentMem) unpin() {
	l.mu.Lock()
	l.readers--
	last := l.retired && l.readers == 0
	l.mu.Unlock()
	if last {
		l.free()
	}
}

// retire marks the memory released; it is given back now or after the
// last reader.
func (l *lentMem) retire() {
	l.mu.Lock()
	first := !l.retired
	l.retired = true
	now := first && l.readers == 0
	l.mu.Unlock()
	if now {
		l.free()
	}
}

// pinner is the part of the arena an entry needs to keep its memory from
// being reused while a transfer reads it.
type pinner interface {
	Pin(arena.Buf) error
	Unpin(arena.Buf) error
}

// pin keeps e's memory from being freed until unpin is called; it fails when
// the memory was already freed (the payload was released meanwhile).
func (e *entry) pin() error {
	if e.lent != nil {
		if !e.lent.pin() {
			return fmt.Errorf("%w: %s released", ErrNotFound, e.id)
		}
		return nil
	}
	if e.owner == nil {
		return nil
	}
	if err := e.arena.Pin(e.owner.ab); err != nil {
		return fmt.Errorf("%w: %s released", ErrNotFound, e.id)
	}
	return nil
}

func (e *entry) unpin() {
	if e.lent != nil {
		e.lent.unpin()
		return
	}
	if e.owner != nil {
		e.arena.Unpin(e.owner.ab)
	}
}

// sumBlock is the granularity of payload checksums: the producer hashes each
// sumBlock of every chunk when the chunk is ready, and the consumer verifies
// each block as it lands, while it is still in L2 (256 KiB fits the L2 of
// any current server core) and costs 32 bytes of checksum per MiB on the wire.
const sumBlock = 256 << 10

// blockSums hashes each sumBlock of b into out (reused when large enough).
func blockSums(b []byte, out []uint64) []uint64 {
	out = out[:0]
	for len(b) > 0 {
		k := min(len(b), sumBlock)
		out = append(out, xxh3.Hash(b[:k]))
		b = b[k:]
	}
	return out
}

// chunkSize is the size in bytes of each chunk of e.
func (e *entry) chunkSize() int64 { _, n := e.meta.ChunkRange(0); return n }

// complete reports whether every chunk is ready.
func (e *entry) complete() bool {
	for _, r := range e.ready {
		select {
		case <-r:
		default:
			return false
		}
	}
	return true
}

// waitRange blocks until every chunk overlapping [off, off+n) is ready, ctx
// ends or stop is closed.
func (e *entry) waitRange(ctx context.Context, stop <-chan struct{}, off, n int64) error {
	if n == 0 {
		return nil
	}
	cs := e.chunkSize()
	for k := off / cs; k <= (off+n-1)/cs; k++ {
		select {
		case <-e.ready[k]:
		default:
			select {
			case <-e.ready[k]:
			case <-e.released:
				return fmt.Errorf("%w: %s released before chunk %d was ready", ErrNotFound, e.id, k)
			case <-ctx.Done():
				return ctx.Err()
			case <-stop:
				return ErrClosed
			}
		}
	}
	return nil
}

// rangeReady reports whether [off, off+n) can be served without waiting.
func (e *entry) rangeReady(off, n int64) bool {
	if n == 0 {
		return true
	}
	cs := e.chunkSize()
	for k := off / cs; k <= (off+n-1)/cs; k++ {
		select {
		case <-e.ready[k]:
		default:
			return false
		}
	}
	return true
}

// rangeSums returns the block checksums of [off, off+n) when that range lies
// in one ready chunk and starts and ends on its block boundaries (the ranges
// a consumer's plan asks for), else nil: the range then travels without.
func (e *entry) rangeSums(off, n int64) []uint64 {
	if n == 0 {
		return nil
	}
	cs := e.chunkSize()
	k := off / cs
	base := k * cs
	end := off + n
	if end > base+cs || (off-base)%sumBlock != 0 || (end != base+cs && (end-base)%sumBlock != 0) {
		return nil
	}
	select {
	case <-e.ready[k]:
	default:
		return nil
	}
	if e.lazy != nil {
		e.lazy[k].Do(func() { e.sums[k] = blockSums(e.buf[base:base+cs], nil) })
	}
	return e.sums[k][(off-base)/sumBlock : (end-base+sumBlock-1)/sumBlock]
}

// registry holds the payloads this process has published.
type registry struct {
	mu sync.Mutex
	// mu guards the fields below.
	entries map[string]*entry
	bytes   int64
}

func newRegistry() *registry {
	return &registry{entries: make(map[string]*entry)}
}

// newPayloadID returns 128 random bits, hex encoded.
func newPayloadID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("transfer: crypto/rand: %v", err))
	}
	return hex.EncodeToString(b[:])
}

func (r *registry) add(meta TensorMeta, buf []byte, owner *Buffer, a pinner, whole uint64, lent *lentMem, lazy bool) *entry {
	nc := meta.Chunks()
	e := &entry{
		id:       newPayloadID(),
		meta:     meta,
		buf:      buf,
		owner:    owner,
		arena:    a,
		whole:    whole,
		lent:     lent,
		ready:    make([]chan struct{}, nc),
		sums:     make([][]uint64, nc),
		released: make(chan struct{}),
	}
	for k := range e.ready {
		e.ready[k] = make(chan struct{})
	}
	if lazy {
		e.lazy = make([]sync.Once, nc)
	}
	r.mu.Lock()
	r.entries[e.id] = e
	r.bytes += int64(len(buf))
	r.mu.Unlock()
	return e
}

func (r *registry) get(id string) *entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.entries[id]
}

// remove forgets id and returns its entry, or nil when unknown.
func (r *registry) remove(id string) *entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[id]
	if ok {
		delete(r.entries, id)
		r.bytes -= int64(len(e.buf))
		close(e.released)
		if e.lent != nil {
			defer e.lent.retire() // after mu: free may take its time
		}
	}
	return e
}

// drain forgets every entry and returns them.
func (r *registry) drain() []*entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*entry, 0, len(r.entries))
	for id, e := range r.entries {
		out = append(out, e)
		delete(r.entries, id)
		close(e.released)
		if e.lent != nil {
			defer e.lent.retire()
		}
	}
	r.bytes = 0
	return out
}

func (r *registry) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.entries))
	for id := range r.entries {
		out = append(out, id)
	}
	return out
}

func (r *registry) held() (int, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.entries), r.bytes
}

// Pending is a payload published before all of its chunks exist. The producer
// writes chunk k into Buf() and then calls ChunkReady(k); consumers pulling
// that chunk wait until then. Chunks may become ready in any order.
type Pending struct {
	e *entry

	// finish drops the writer's reference on the arena region (once): the
	// region outlives a Release until the writer is done with it too.
	finish sync.Once

	mu sync.Mutex
	// mu guards the fields below.
	done []bool
	left int // chunks not yet ready
}

// Buf is the payload buffer, meta.Bytes() long: a region of the service's
// arena when it has one with room, else heap memory. Write chunk k into
// Buf()[ChunkRange(k)] before calling ChunkReady(k), and never touch it after.
func (p *Pending) Buf() []byte { return p.e.buf }

// ID is the payload id, as in the Ref returned by Begin.
func (p *Pending) ID() string { return p.e.id }

// ChunkReady marks chunk k as written: its checksum is taken and pulls waiting
// on it proceed.
func (p *Pending) ChunkReady(k int) error {
	return p.ready(k, func() {
		off, n := p.e.meta.ChunkRange(k)
		p.e.sums[k] = blockSums(p.e.buf[off:off+n], nil)
	})
}

// ChunkCopied marks chunk k as written with a copy of another payload's
// chunk that a pull verified as it landed, without hashing it again:
// sums are the block checksums it was verified against (Chunk.Sums), and
// tcp consumers are served them, so a copy of a copy is checked against
// the checksums its first producer took. With sums nil (a chunk copied
// over shm or rdma, where nothing is hashed) or not one per block of the
// chunk, the chunk is hashed the first time a consumer reads it over tcp,
// as a PublishCopy payload's is.
func (p *Pending) ChunkCopied(k int, sums []uint64) error {
	if k >= 0 && k < len(p.e.ready) && int64(len(sums)) != (p.e.chunkSize()+sumBlock-1)/sumBlock {
		sums = nil
	}
	return p.ready(k, func() {
		if sums != nil {
			p.e.sums[k] = slices.Clone(sums) // the caller's slice may be reused
		}
	})
}

// ready marks chunk k ready once, after take has set its checksums (or
// left them to the first tcp read).
func (p *Pending) ready(k int, take func()) error {
	if k < 0 || k >= len(p.e.ready) {
		return fmt.Errorf("transfer: chunk %d of %d", k, len(p.e.ready))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[k] {
		return fmt.Errorf("transfer: chunk %d already ready", k)
	}
	p.done[k] = true
	// No reader touches sums[k] or lazy[k] before ready[k] is closed.
	take()
	if p.e.sums[k] != nil {
		p.e.lazy[k].Do(func() {}) // known: nothing left for a read to compute
	}
	close(p.e.ready[k])
	if p.left--; p.left == 0 {
		p.Done()
	}
	return nil
}

// Done tells the service the writer will not touch Buf again. Marking the
// last chunk ready does it; a writer that gives up early must call it (after
// Release, if the payload will never be completed). Until then Buf stays
// valid even if the payload is released meanwhile. Idempotent.
func (p *Pending) Done() {
	p.finish.Do(func() {
		if p.e.owner != nil {
			p.e.owner.unref()
		}
	})
}
