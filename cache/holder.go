package cache

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// copyOf is one copy this node holds: a payload of its transfer service.
type copyOf struct {
	object    string
	ref       transfer.Ref // the payload readers pull
	tier      Tier
	size      int64
	mode      Mode
	stagedAt  time.Time
	committed bool // seen in a record that lists it
	// rev is the etcd revision of the newest record state applied to this
	// copy: a watch event or a list older than that is stale for it and
	// must not free it, whatever order they are applied in.
	rev int64
	lru *list.Element // in holdings.lru while committed and a Cache object
	// recovered marks a durable copy found on disk at start: it serves the
	// payload a previous run of this node served, under a new ref, until
	// maintenance names it in the record (reannounce) or frees it.
	recovered bool
	// fill is set for a copy staged in flight (a chained put's Early
	// request): its payload was published before its bytes landed, and
	// fill says when they all have. nil for a copy staged whole.
	fill *filling
}

// filling is the progress of a copy staged in flight.
type filling struct {
	done   chan struct{} // closed once the fill ended; err is set before
	err    error         // nil: every chunk landed
	cancel func()        // ends the fill (the copy was dropped)
	start  chan struct{} // closed when the fill may start (at once unless deferred)
	once   sync.Once
}

// begin lets a deferred fill start; idempotent.
func (f *filling) begin() { f.once.Do(func() { close(f.start) }) }

// waitStart waits until the fill may start: begin was called, or limit
// passed (a deferred copy whose putter never asked is still filled), or
// ctx ended (the copy was dropped).
func (f *filling) waitStart(ctx context.Context, limit time.Duration) error {
	select {
	case <-f.start:
		return nil
	default:
	}
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case <-f.start:
	case <-t.C:
	case <-ctx.Done():
		return fmt.Errorf("cache: a deferred copy ended before its fill started: %w", ctx.Err())
	}
	return nil
}

// holdings is what this node holds for the Store, and the room it has.
type holdings struct {
	xfer *transfer.Service
	cfg  *Config
	log  *zap.Logger

	mu sync.Mutex
	// mu guards the fields below.
	copies    map[string]*copyOf // by payload id
	byObject  map[string][]*copyOf
	lru       *list.List // committed Cache copies, least recently used first
	memUsed   int64
	cacheUsed int64 // bytes of Cache copies, staged ones included (Config.CacheCapacity)
	cacheN    int   // and how many (Config.CacheEntries)
	diskUsed  int64 // spill bytes, counted until the file is removed
	evictions int64
	spilled   int64         // copies that went to disk because memory was full, ever
	overflows int64         // copies held beyond capacity (reserve with overflow), ever
	room      chan struct{} // signalled (never blocking) when memUsed or diskUsed changes

	// keepDurable is set when the Store closes: durable copies released
	// then keep their files, for the next run to recover.
	keepDurable atomic.Bool
}

func newHoldings(x *transfer.Service, cfg *Config, log *zap.Logger) *holdings {
	return &holdings{xfer: x, cfg: cfg, log: log, copies: map[string]*copyOf{}, byObject: map[string][]*copyOf{}, lru: list.New(), room: make(chan struct{}, 1)}
}

// roomChanged tells a waiter on room that the room left changed; it never
// blocks (one pending signal covers any number of changes).
func (h *holdings) roomChanged() {
	select {
	case h.room <- struct{}{}:
	default:
	}
}

// free reports the room left in memory and on disk.
func (h *holdings) free() (mem, disk int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.cfg.MemoryCapacity - h.memUsed, h.cfg.SpillCapacity - h.diskUsed
}

// reserve claims size bytes in memory or, failing that, on disk, evicting
// Cache copies to make memory room. It returns the tier, or ErrFull; with
// overflow set it takes memory beyond capacity instead of failing (counted).
// evicted lists the copies evicted, whose records the caller deletes.
func (h *holdings) reserve(size int64, mode Mode, overflow bool) (tier Tier, evicted []*copyOf, err error) {
	return h.reserveIn(size, mode, overflow, false)
}

// reserveMemory is reserve for memory only: a copy staged in flight is a
// transfer payload published before it is written, which only memory can
// be (a durable mode's copy too: it is not written through).
func (h *holdings) reserveMemory(size int64, mode Mode) (evicted []*copyOf, err error) {
	_, evicted, err = h.reserveIn(size, mode, false, true)
	return evicted, err
}

func (h *holdings) reserveIn(size int64, mode Mode, overflow, memOnly bool) (tier Tier, evicted []*copyOf, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if mode == Cache {
		return h.reserveCacheLocked(size)
	}
	if durable(mode) && !memOnly && h.diskUsed+size <= h.cfg.SpillCapacity {
		// Written through to disk, so the copy outlives this agent.
		h.diskUsed += size
		h.roomChanged()
		return Disk, nil, nil
	}
	if h.memUsed+size > h.cfg.MemoryCapacity {
		evicted = h.evictLocked(func() bool { return h.memUsed+size <= h.cfg.MemoryCapacity })
	}
	switch {
	case h.memUsed+size <= h.cfg.MemoryCapacity:
		h.memUsed += size
		h.roomChanged()
		return Memory, evicted, nil
	case memOnly:
	case h.diskUsed+size <= h.cfg.SpillCapacity:
		h.diskUsed += size
		h.roomChanged()
		h.spilled++
		return Disk, evicted, nil
	case overflow:
		h.memUsed += size
		h.roomChanged()
		h.overflows++
		return Memory, evicted, nil
	}
	return "", evicted, fmt.Errorf("%w: %d bytes wanted; %d of %d in memory and %d of %d on disk used on %s",
		ErrFull, size, h.memUsed, h.cfg.MemoryCapacity, h.diskUsed, h.cfg.SpillCapacity, h.cfg.Node)
}

// reserveCacheLocked claims memory for a Cache copy: within
// Config.CacheCapacity (when set) and the memory capacity, evicting the
// least recently used Cache copies to make room. Cache copies never go to
// disk and never overflow: an entry that does not fit is not cached.
func (h *holdings) reserveCacheLocked(size int64) (Tier, []*copyOf, error) {
	capacity := h.cfg.MemoryCapacity
	if h.cfg.CacheCapacity > 0 {
		capacity = min(capacity, h.cfg.CacheCapacity)
	}
	if size > capacity {
		return "", nil, fmt.Errorf("%w: a cache entry of %d bytes; cache entries may take %d bytes on %s", ErrFull, size, capacity, h.cfg.Node)
	}
	fits := func() bool {
		return h.cacheUsed+size <= capacity && h.memUsed+size <= h.cfg.MemoryCapacity &&
			(h.cfg.CacheEntries == 0 || h.cacheN < h.cfg.CacheEntries)
	}
	evicted := h.evictLocked(fits)
	if !fits() {
		return "", evicted, fmt.Errorf("%w: a cache entry of %d bytes; %d of %d in memory used on %s, %d by %d cache entries",
			ErrFull, size, h.memUsed, h.cfg.MemoryCapacity, h.cfg.Node, h.cacheUsed, h.cacheN)
	}
	h.memUsed += size
	h.cacheUsed += size
	h.cacheN++
	h.roomChanged()
	return Memory, evicted, nil
}

// evictLocked forgets committed Cache copies in memory, least recently used
// first, until fits reports room; and none at all unless evicting every
// such copy would make it: never evict for nothing. It returns the copies
// evicted, whose records the caller deletes after releasing them.
func (h *holdings) evictLocked(fits func() bool) (evicted []*copyOf) {
	var victims []*copyOf
	for e := h.lru.Front(); e != nil; e = e.Next() {
		if c := e.Value.(*copyOf); c.tier == Memory {
			victims = append(victims, c)
		}
	}
	// Try it on the books first: forget, and put back if it was for nothing.
	memUsed, cacheUsed, cacheN := h.memUsed, h.cacheUsed, h.cacheN
	n := 0
	for n < len(victims) && !fits() {
		h.memUsed -= victims[n].size
		h.cacheUsed -= victims[n].size
		h.cacheN--
		n++
	}
	ok := fits()
	h.memUsed, h.cacheUsed, h.cacheN = memUsed, cacheUsed, cacheN
	if !ok {
		return nil
	}
	for _, c := range victims[:n] {
		h.forgetLocked(c)
		evicted = append(evicted, c)
		h.evictions++
	}
	return evicted
}

// spillDir is this node's own directory under SpillDir.
func (h *holdings) spillDir() string { return filepath.Join(h.cfg.SpillDir, h.cfg.Node) }

// reserveDisk claims size bytes on disk only (the arena had no room).
func (h *holdings) reserveDisk(size int64) (Tier, []*copyOf, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.diskUsed+size > h.cfg.SpillCapacity {
		return "", nil, fmt.Errorf("%w: %d bytes wanted; %d of %d on disk used on %s", ErrFull, size, h.diskUsed, h.cfg.SpillCapacity, h.cfg.Node)
	}
	h.diskUsed += size
	h.roomChanged()
	h.spilled++
	return Disk, nil, nil
}

// has reports whether the copy with payload id is held.
func (h *holdings) has(payload string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.copies[payload] != nil
}

// anyRecovered reports whether a recovered copy awaits its record.
func (h *holdings) anyRecovered() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.copies {
		if c.recovered {
			return true
		}
	}
	return false
}

// unreserve gives back a reservation that was never filled.
func (h *holdings) unreserve(tier Tier, size int64) { h.unreserveMode(tier, size, "") }

// unreserveMode is unreserve of a reservation for a copy of mode: a Cache
// copy's counts against the cache's room too.
func (h *holdings) unreserveMode(tier Tier, size int64, mode Mode) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch tier {
	case Memory:
		h.memUsed -= size
		if mode == Cache {
			h.cacheUsed -= size
			h.cacheN--
		}
		h.roomChanged()
	case Disk:
		h.diskUsed -= size
		h.roomChanged()
	}
}

// source is what a copy is made from: the payload ref names, pulled from
// its producer over the data plane, or, for an inline put, data, the bytes
// themselves (the putter's own payload, or a request's Data checked
// against ref's size and checksum). ref's Meta and Checksum describe the
// copy either way.
type source struct {
	ref  transfer.Ref
	data []byte // nil: pull ref
}

func (src source) size() int64 { return src.ref.Meta.Bytes() }

// copyInto fills dst, src's size, from src. It returns the block checksums
// a pull brought with the bytes; an inline copy has none, and its payload
// hashes a chunk the first time a consumer reads it over tcp.
func (h *holdings) copyInto(ctx context.Context, src source, dst []byte) (transfer.BlockSums, error) {
	if src.data != nil {
		copy(dst, src.data)
		return nil, nil
	}
	return h.xfer.PullCopy(ctx, src.ref, dst)
}

// fill copies src into a fresh copy of object in tier and publishes it. The
// reservation is the caller's; on error it is given back here.
func (h *holdings) fill(ctx context.Context, object string, mode Mode, tier Tier, src source, overflow bool) (*copyOf, error) {
	ctx = transfer.ForStore(ctx)
	size := src.size()
	var ref transfer.Ref
	var err error
	switch tier {
	case Memory:
		ref, err = h.fillMemory(ctx, src, overflow)
	case Disk:
		ref, err = h.fillDisk(ctx, object, mode, src)
	}
	if err != nil {
		if tier == Memory {
			h.unreserveMode(tier, size, mode) // a disk reservation is given back by the file's free
		}
		return nil, err
	}
	c := &copyOf{object: object, ref: ref, tier: tier, size: size, mode: mode, stagedAt: h.cfg.Now()}
	h.add(c)
	return c, nil
}

// add enters a new copy in the books.
func (h *holdings) add(c *copyOf) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.copies[c.ref.ID] = c
	h.byObject[c.object] = append(h.byObject[c.object], c)
}

// filling reports whether the copy payload of object is held, and its
// fill when it is staged in flight.
func (h *holdings) filling(object, payload string) (f *filling, held bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := h.copies[payload]
	if c == nil || c.object != object {
		return nil, false
	}
	return c.fill, true
}

func (h *holdings) fillMemory(ctx context.Context, src source, overflow bool) (transfer.Ref, error) {
	meta := src.ref.Meta
	buf, err := h.xfer.Alloc(meta.Bytes())
	if overflow && errors.Is(err, arena.ErrNoSpace) {
		// Held beyond capacity so a decode can finish: the heap (tcp only).
		mem := make([]byte, meta.Bytes())
		sums, err := h.copyInto(ctx, src, mem)
		if err != nil {
			return transfer.Ref{}, err
		}
		return h.xfer.PublishCopy(meta, mem, src.ref.Checksum, sums, nil)
	}
	if err != nil {
		return transfer.Ref{}, err
	}
	defer buf.Release() // the published payload keeps the region until its own Release
	sums, err := h.copyInto(ctx, src, buf.Bytes())
	if err != nil {
		return transfer.Ref{}, err
	}
	return h.xfer.PublishCopy(meta, buf.Bytes(), src.ref.Checksum, sums, nil)
}

// fillDisk copies src into a new file of the spill directory, mapped
// shared, and publishes the mapping; the file goes when the payload is
// released and no transfer reads it. A durable copy (its mode's, with a
// checksum to verify it by at the next start) is synced to disk with its
// sidecar before it is published.
func (h *holdings) fillDisk(ctx context.Context, object string, mode Mode, src source) (transfer.Ref, error) {
	size := src.size()
	isDurable := durable(mode) && src.ref.Checksum != 0
	path := h.spillPath(object, spillExt)
	if isDurable {
		path = h.spillPath(object, durableExt)
	}
	freeDisk := func() { h.unreserve(Disk, size) }
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		freeDisk()
		return transfer.Ref{}, fmt.Errorf("cache: spill file: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		os.Remove(path)
		freeDisk()
		return transfer.Ref{}, fmt.Errorf("cache: spill file of %d bytes: %w", size, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		freeDisk()
		return transfer.Ref{}, fmt.Errorf("cache: map spill file: %w", err)
	}
	release := h.diskRelease(mem, path, size, isDurable)
	fail := func(err error) (transfer.Ref, error) {
		unix.Munmap(mem)
		removeCopyFiles(path)
		freeDisk()
		return transfer.Ref{}, err
	}
	sums, err := h.copyInto(ctx, src, mem)
	if err != nil {
		return fail(err)
	}
	if isDurable {
		sc := sidecar{V: sidecarVersion, Object: object, Mode: mode, Meta: src.ref.Meta, Checksum: src.ref.Checksum}
		if err := h.syncDurable(f, mem, path, sc); err != nil {
			return fail(err)
		}
	}
	return h.xfer.PublishCopy(src.ref.Meta, mem, src.ref.Checksum, sums, release)
}

// commit marks a copy as recorded, by the record state of revision rev:
// it now lives by its record.
func (h *holdings) commit(payload string, rev int64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := h.copies[payload]
	if c == nil {
		return
	}
	c.rev = max(c.rev, rev)
	if c.committed {
		return
	}
	c.committed, c.recovered = true, false
	if c.mode == Cache {
		c.lru = h.lru.PushBack(c)
	}
}

// keep reports whether the copy payload of object is held, and restarts
// its stage timeout if no record has named it yet (Staged.Keep).
func (h *holdings) keep(object, payload string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := h.copies[payload]
	if c == nil || c.object != object {
		return false
	}
	if !c.committed {
		c.stagedAt = h.cfg.Now()
	}
	return true
}

// forgetRevisions sets every copy's revision to 0: after etcd's history
// restarted (an etcd replaced or restored) the old revisions mean nothing,
// and a list of the new etcd must be able to judge every copy.
func (h *holdings) forgetRevisions() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.copies {
		c.rev = 0
	}
}

// touch notes a use of a copy (a ticket was issued for it, or it is read
// locally): a Cache copy moves to the back of the LRU order, and a copy
// whose fill is deferred starts filling, since a reader now waits on it.
func (h *holdings) touch(payload string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := h.copies[payload]
	if c == nil {
		return
	}
	if c.lru != nil {
		h.lru.MoveToBack(c.lru)
	}
	if c.fill != nil {
		c.fill.begin()
	}
}

// touchObject is touch for every copy of object held here (an entry found
// by a lookup, which may never pull it).
func (h *holdings) touchObject(object string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.byObject[object] {
		if c.lru != nil {
			h.lru.MoveToBack(c.lru)
		}
	}
}

// dropIf frees the copy with payload id if it is held and cond (nil: always)
// holds for it; cond runs under mu, so the decision sees the copy's current
// state, not a snapshot the watch may have overtaken.
func (h *holdings) dropIf(payload string, cond func(c *copyOf) bool) bool {
	h.mu.Lock()
	c := h.copies[payload]
	if c != nil && (cond == nil || cond(c)) {
		h.forgetLocked(c)
	} else {
		c = nil
	}
	h.mu.Unlock()
	if c != nil {
		h.release(c)
	}
	return c != nil
}

// staleBefore is a dropIf condition: the copy has seen no record state
// newer than revision rev, and is committed when committedOnly.
func staleBefore(rev int64, committedOnly bool) func(c *copyOf) bool {
	return func(c *copyOf) bool { return c.rev <= rev && (c.committed || !committedOnly) }
}

// release gives a forgotten copy's payload back to the transfer service:
// memory at once (the arena defers reuse while a transfer reads it), disk
// when the file is unmapped after its last reader. Never under mu: the disk
// tier's free takes it.
func (h *holdings) release(cs ...*copyOf) {
	for _, c := range cs {
		h.xfer.Release(c.ref.ID) // readers waiting for chunks of one in flight end with ErrNotFound
		if c.fill != nil {
			c.fill.cancel()
		}
	}
}

// forgetLocked removes c from the books; the caller releases it after
// unlocking.
func (h *holdings) forgetLocked(c *copyOf) {
	delete(h.copies, c.ref.ID)
	list := h.byObject[c.object]
	for i, x := range list {
		if x == c {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(h.byObject, c.object)
	} else {
		h.byObject[c.object] = list
	}
	if c.lru != nil {
		h.lru.Remove(c.lru)
		c.lru = nil
	}
	if c.tier == Memory {
		h.memUsed -= c.size
		if c.mode == Cache {
			h.cacheUsed -= c.size
			h.cacheN--
		}
		h.roomChanged()
	}
}

// snapshot copies the held copies' state.
func (h *holdings) snapshot() []copyOf {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]copyOf, 0, len(h.copies))
	for _, c := range h.copies {
		out = append(out, *c)
	}
	return out
}

// copiesOf lists the payload ids held for object.
func (h *holdings) copiesOf(object string) []copyOf {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]copyOf, 0, len(h.byObject[object]))
	for _, c := range h.byObject[object] {
		out = append(out, *c)
	}
	return out
}

// dropAll frees every copy (Close). Durable copies keep their files, for
// the next run of this node to recover.
func (h *holdings) dropAll() {
	h.keepDurable.Store(true)
	h.mu.Lock()
	var all []*copyOf
	for _, c := range h.copies {
		h.forgetLocked(c)
		all = append(all, c)
	}
	h.mu.Unlock()
	h.release(all...)
}

// errIsFull reports whether err means no room (ours or the arena's).
func errIsFull(err error) bool {
	return errors.Is(err, ErrFull) || errors.Is(err, arena.ErrNoSpace)
}
