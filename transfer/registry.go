package transfer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// entry is one payload held by a producer. buf, meta, size and ready never
// change after creation; sums[k] is written before ready[k] is closed, so a
// reader that has seen ready[k] closed may read sums[k] and buf's chunk k.
type entry struct {
	id    string
	meta  TensorMeta
	buf   []byte
	ready []chan struct{} // one per chunk, closed when the chunk is readable
	sums  []uint64        // xxhash per chunk, valid once ready[k] is closed
}

// chunkSize is the size in bytes of each chunk of e.
func (e *entry) chunkSize() int64 { _, n := e.meta.ChunkRange(0); return n }

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

// chunkSum is the checksum of [off, off+n) when that range is exactly one
// ready chunk, else 0 (no checksum).
func (e *entry) chunkSum(off, n int64) uint64 {
	cs := e.chunkSize()
	if n != cs || off%cs != 0 {
		return 0
	}
	k := off / cs
	select {
	case <-e.ready[k]:
		return e.sums[k]
	default:
		return 0
	}
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

func (r *registry) add(meta TensorMeta, buf []byte) *entry {
	nc := meta.Chunks()
	e := &entry{
		id:    newPayloadID(),
		meta:  meta,
		buf:   buf,
		ready: make([]chan struct{}, nc),
		sums:  make([]uint64, nc),
	}
	for k := range e.ready {
		e.ready[k] = make(chan struct{})
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

func (r *registry) remove(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.entries[id]; ok {
		delete(r.entries, id)
		r.bytes -= int64(len(e.buf))
	}
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

	mu sync.Mutex
	// mu guards the field below.
	done []bool
}

// Buf is the payload buffer, meta.Bytes() long. Write chunk k into
// Buf()[ChunkRange(k)] before calling ChunkReady(k), and never touch it after.
func (p *Pending) Buf() []byte { return p.e.buf }

// ID is the payload id, as in the Ref returned by Begin.
func (p *Pending) ID() string { return p.e.id }

// ChunkReady marks chunk k as written: its checksum is taken and pulls waiting
// on it proceed.
func (p *Pending) ChunkReady(k int) error {
	if k < 0 || k >= len(p.e.ready) {
		return fmt.Errorf("transfer: chunk %d of %d", k, len(p.e.ready))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done[k] {
		return fmt.Errorf("transfer: chunk %d already ready", k)
	}
	p.done[k] = true
	off, n := p.e.meta.ChunkRange(k)
	p.e.sums[k] = xxhash.Sum64(p.e.buf[off : off+n])
	close(p.e.ready[k])
	return nil
}
