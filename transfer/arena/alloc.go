package arena

import (
	"fmt"
	"sort"
)

// Buf names an allocated region of an arena: Len bytes at Off. Gen is the
// allocation's generation, unique within the arena, so a Buf that outlived
// its allocation is recognised as stale even when a new allocation of the
// same size now sits at the same offset.
type Buf struct {
	Off int64  `msgpack:"off" json:"off"`
	Len int64  `msgpack:"len" json:"len"`
	Gen uint64 `msgpack:"gen" json:"gen"`
}

// Stats is a snapshot of the arena's occupancy.
type Stats struct {
	Size        int64 // mapped bytes
	Used        int64 // bytes held by live allocations (rounded to Align), pending frees included
	Free        int64 // bytes in free blocks
	LargestFree int64 // largest single free block: the biggest Alloc that can succeed
	FreeBlocks  int   // number of free blocks
	Allocs      int   // live allocations, pending frees included
	Pinned      int   // allocations with at least one pin
	PendingFree int   // freed by the owner, waiting for their last pin to go
	HugePages   bool  // huge pages back the arena (PageMode is not PageBase)
	PageMode    string
	Prefaulted  bool
}

// Fragmentation is 1 - LargestFree/Free: 0 when all free space is one block
// (or none is free), approaching 1 as free space splinters.
func (s Stats) Fragmentation() float64 {
	if s.Free == 0 {
		return 0
	}
	return 1 - float64(s.LargestFree)/float64(s.Free)
}

// Alloc reserves n bytes, aligned to Config.Align. It picks the smallest free
// block that fits (best fit, which keeps large blocks whole for large
// payloads) and costs O(free blocks) time and no heap proportional to n.
func (a *Arena) Alloc(n int64) (Buf, error) {
	if n <= 0 {
		return Buf{}, fmt.Errorf("arena: alloc of %d bytes", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Buf{}, ErrClosed
	}
	return a.alloc.allocLocked(n)
}

// Free returns b to the arena. If b is pinned the region is released when the
// last pin goes; b can be neither pinned again nor freed again meanwhile.
// Freeing a Buf twice, a stale Buf or a foreign one returns ErrBadBuf and
// changes nothing.
func (a *Arena) Free(b Buf) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	return a.alloc.freeLocked(b)
}

// Pin takes a reference on a live buffer so its region is not reused while a
// reader (a same-host peer reading in place) holds it. Each Pin needs one
// Unpin.
func (a *Arena) Pin(b Buf) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	return a.alloc.pinLocked(b)
}

// Unpin drops a reference taken by Pin, completing a pending Free when it
// was the last one.
func (a *Arena) Unpin(b Buf) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	return a.alloc.unpinLocked(b)
}

// Stats returns a snapshot of occupancy and of how the arena was mapped.
func (a *Arena) Stats() Stats {
	a.mu.Lock()
	s := a.alloc.statsLocked()
	a.mu.Unlock()
	s.Size = a.size
	s.PageMode = a.pageMode
	s.HugePages = a.pageMode != PageBase
	s.Prefaulted = a.prefaulted
	return s
}

// extent is a free block.
type extent struct{ off, size int64 }

// allocation is a live block.
type allocation struct {
	len, size int64
	gen       uint64
	pins      int32
	freed     bool // owner called Free; released at the last Unpin
}

// allocator is a best-fit free list sorted by offset with coalescing of
// neighbours. Suited to few, large blocks: Alloc is O(free blocks), Free is
// O(log free blocks) search plus a slice shift. Not safe for concurrent use;
// Arena.mu guards it.
type allocator struct {
	size, align int64
	free        []extent // sorted by off, never adjacent (always coalesced)
	live        map[int64]*allocation
	gen         uint64
	used        int64
	pinned      int
	pending     int
}

func (al *allocator) init(size, align int64) {
	al.size, al.align = size, align
	al.free = []extent{{0, size}}
	al.live = make(map[int64]*allocation)
}

func (al *allocator) allocLocked(n int64) (Buf, error) {
	if n > al.size {
		return Buf{}, fmt.Errorf("%w: %d bytes requested, arena is %d", ErrNoSpace, n, al.size)
	}
	size := roundUp(n, al.align)
	best := -1
	for i, e := range al.free {
		if e.size >= size && (best < 0 || e.size < al.free[best].size) {
			best = i
			if e.size == size {
				break
			}
		}
	}
	if best < 0 {
		return Buf{}, fmt.Errorf("%w: %d bytes requested, largest free block %d", ErrNoSpace, n, al.largestLocked())
	}
	e := &al.free[best]
	off := e.off
	if e.size == size {
		al.free = append(al.free[:best], al.free[best+1:]...)
	} else {
		e.off += size
		e.size -= size
	}
	al.gen++
	al.live[off] = &allocation{len: n, size: size, gen: al.gen}
	al.used += size
	return Buf{Off: off, Len: n, Gen: al.gen}, nil
}

// lookupLocked returns the allocation b names, or ErrBadBuf.
func (al *allocator) lookupLocked(b Buf) (*allocation, error) {
	x, ok := al.live[b.Off]
	if !ok || x.gen != b.Gen || x.len != b.Len {
		return nil, fmt.Errorf("%w: off %d len %d gen %d", ErrBadBuf, b.Off, b.Len, b.Gen)
	}
	return x, nil
}

func (al *allocator) freeLocked(b Buf) error {
	x, err := al.lookupLocked(b)
	if err != nil {
		return err
	}
	if x.freed {
		return fmt.Errorf("%w: off %d already freed, waiting for %d pins", ErrBadBuf, b.Off, x.pins)
	}
	if x.pins > 0 {
		x.freed = true
		al.pending++
		return nil
	}
	al.releaseLocked(b.Off, x)
	return nil
}

func (al *allocator) pinLocked(b Buf) error {
	x, err := al.lookupLocked(b)
	if err != nil {
		return err
	}
	if x.freed {
		return fmt.Errorf("%w: off %d is being freed", ErrBadBuf, b.Off)
	}
	if x.pins == 0 {
		al.pinned++
	}
	x.pins++
	return nil
}

func (al *allocator) unpinLocked(b Buf) error {
	x, err := al.lookupLocked(b)
	if err != nil {
		return err
	}
	if x.pins == 0 {
		return fmt.Errorf("%w: off %d", ErrNotPinned, b.Off)
	}
	x.pins--
	if x.pins > 0 {
		return nil
	}
	al.pinned--
	if x.freed {
		al.pending--
		al.releaseLocked(b.Off, x)
	}
	return nil
}

// releaseLocked returns a live allocation's block to the free list,
// coalescing it with free neighbours.
func (al *allocator) releaseLocked(off int64, x *allocation) {
	delete(al.live, off)
	al.used -= x.size
	end := off + x.size
	i := sort.Search(len(al.free), func(i int) bool { return al.free[i].off > off })
	joinPrev := i > 0 && al.free[i-1].off+al.free[i-1].size == off
	joinNext := i < len(al.free) && al.free[i].off == end
	switch {
	case joinPrev && joinNext:
		al.free[i-1].size += x.size + al.free[i].size
		al.free = append(al.free[:i], al.free[i+1:]...)
	case joinPrev:
		al.free[i-1].size += x.size
	case joinNext:
		al.free[i].off = off
		al.free[i].size += x.size
	default:
		al.free = append(al.free, extent{})
		copy(al.free[i+1:], al.free[i:])
		al.free[i] = extent{off, x.size}
	}
}

func (al *allocator) largestLocked() int64 {
	var m int64
	for _, e := range al.free {
		m = max(m, e.size)
	}
	return m
}

func (al *allocator) statsLocked() Stats {
	return Stats{
		Used:        al.used,
		Free:        al.size - al.used,
		LargestFree: al.largestLocked(),
		FreeBlocks:  len(al.free),
		Allocs:      len(al.live),
		Pinned:      al.pinned,
		PendingFree: al.pending,
	}
}
