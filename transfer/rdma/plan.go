package rdma

import "fmt"

// WR is one RDMA READ work request of a planned read.
type WR struct {
	ID         uint64 // index in the plan; becomes the verbs wr_id
	RemoteAddr uint64 // remote virtual address to read from
	LocalOff   int64  // offset into the local registered region to land at
	Off        int64  // offset of this WR within the read
	Len        int64  // bytes, 1..maxWR
}

// Plan splits a read of n bytes at remoteAddr, landing at localOff, into work
// requests of at most maxWR bytes each. It returns nil when n or maxWR is not
// positive or localOff is negative.
func Plan(remoteAddr uint64, localOff, n int64, maxWR int64) []WR {
	return PlanChunks(remoteAddr, localOff, n, maxWR, n)
}

// PlanChunks is Plan for a payload of chunks of chunkLen bytes (the last may be
// shorter): no work request crosses a chunk boundary, so the completion of a
// chunk's last work request means that chunk has landed. chunkLen <= 0 means
// one chunk.
func PlanChunks(remoteAddr uint64, localOff, n, maxWR, chunkLen int64) []WR {
	if n <= 0 || maxWR <= 0 || localOff < 0 {
		return nil
	}
	if chunkLen <= 0 || chunkLen > n {
		chunkLen = n
	}
	perChunk := (chunkLen + maxWR - 1) / maxWR
	chunks := (n + chunkLen - 1) / chunkLen
	wrs := make([]WR, 0, perChunk*chunks)
	for c := int64(0); c < n; c += chunkLen {
		end := min(c+chunkLen, n)
		for off := c; off < end; off += maxWR {
			l := min(maxWR, end-off)
			wrs = append(wrs, WR{
				ID:         uint64(len(wrs)),
				RemoteAddr: remoteAddr + uint64(off),
				LocalOff:   localOff + off,
				Off:        off,
				Len:        l,
			})
		}
	}
	return wrs
}

// Tracker drives one planned read: it hands out the work requests that may be
// posted without exceeding the queue depth, and maps completed work request
// ids back to the chunks of the payload that have fully landed. A Tracker is
// not safe for concurrent use; the read driver owns it.
type Tracker struct {
	wrs         []WR
	depth       int
	next        int // index of the first WR not yet posted
	outstanding int
	done        []bool  // per WR
	chunkLen    int64   // bytes per chunk
	pending     []int32 // per chunk: WRs overlapping it that have not completed
	chunksLeft  int
}

// NewTracker tracks wrs, a plan of a read whose payload is split into chunks of
// chunkLen bytes (<= 0: one chunk), keeping at most depth work requests
// outstanding. wrs must be a plan as Plan or PlanChunks return it: ids equal to
// indexes, contiguous offsets from 0. A work request that spans a chunk
// boundary counts towards both chunks.
func NewTracker(wrs []WR, chunkLen int64, depth int) (*Tracker, error) {
	if len(wrs) == 0 {
		return nil, fmt.Errorf("rdma: tracker: empty plan")
	}
	if depth < 1 {
		return nil, fmt.Errorf("rdma: tracker: depth %d < 1", depth)
	}
	var total int64
	for i, w := range wrs {
		if w.ID != uint64(i) || w.Off != total || w.Len <= 0 {
			return nil, fmt.Errorf("rdma: tracker: wr %d (id %d, off %d, len %d) breaks the plan", i, w.ID, w.Off, w.Len)
		}
		total += w.Len
	}
	if chunkLen <= 0 || chunkLen > total {
		chunkLen = total
	}
	nchunks := (total + chunkLen - 1) / chunkLen
	t := &Tracker{
		wrs:        wrs,
		depth:      depth,
		done:       make([]bool, len(wrs)),
		chunkLen:   chunkLen,
		pending:    make([]int32, nchunks),
		chunksLeft: int(nchunks),
	}
	for _, w := range wrs {
		first, last := t.chunkSpan(w)
		for c := first; c <= last; c++ {
			t.pending[c]++
		}
	}
	return t, nil
}

// chunkSpan returns the first and last chunk w overlaps.
func (t *Tracker) chunkSpan(w WR) (int, int) {
	return int(w.Off / t.chunkLen), int((w.Off + w.Len - 1) / t.chunkLen)
}

// Postable returns the work requests that may be posted now, in order, at most
// depth minus the outstanding count. The slice aliases the plan; call Posted
// with how many of them were actually posted.
func (t *Tracker) Postable() []WR {
	n := min(t.depth-t.outstanding, len(t.wrs)-t.next)
	return t.wrs[t.next : t.next+n]
}

// Posted records that the first k work requests Postable returned were posted.
func (t *Tracker) Posted(k int) {
	if k < 0 || k > min(t.depth-t.outstanding, len(t.wrs)-t.next) {
		panic(fmt.Sprintf("rdma: tracker: Posted(%d) beyond Postable", k))
	}
	t.next += k
	t.outstanding += k
}

// Complete records the completion of work request id and returns the chunks,
// in ascending order, that it completed. It is an error to complete an id that
// was not posted or is already complete.
func (t *Tracker) Complete(id uint64) ([]int, error) {
	if id >= uint64(t.next) {
		return nil, fmt.Errorf("rdma: tracker: completion for unposted wr %d", id)
	}
	if t.done[id] {
		return nil, fmt.Errorf("rdma: tracker: duplicate completion for wr %d", id)
	}
	t.done[id] = true
	t.outstanding--
	var landed []int
	first, last := t.chunkSpan(t.wrs[id])
	for c := first; c <= last; c++ {
		t.pending[c]--
		if t.pending[c] == 0 {
			t.chunksLeft--
			landed = append(landed, c)
		}
	}
	return landed, nil
}

// Outstanding is the number of posted work requests not yet complete.
func (t *Tracker) Outstanding() int { return t.outstanding }

// Chunks is the number of chunks of the payload.
func (t *Tracker) Chunks() int { return len(t.pending) }

// ChunkDone reports whether chunk k has fully landed.
func (t *Tracker) ChunkDone(k int) bool { return k >= 0 && k < len(t.pending) && t.pending[k] == 0 }

// Done reports whether every work request has completed.
func (t *Tracker) Done() bool { return t.chunksLeft == 0 && t.outstanding == 0 && t.next == len(t.wrs) }
