package cache

import "time"

// LocalStats is this node's part of the Store.
type LocalStats struct {
	MemoryUsed     int64 `json:"memory_used"`
	MemoryCapacity int64 `json:"memory_capacity"`
	DiskUsed       int64 `json:"disk_used"`
	DiskCapacity   int64 `json:"disk_capacity"`
	Copies         int   `json:"copies"`    // copies held, staged ones included
	Staged         int   `json:"staged"`    // copies whose record has not appeared yet
	Spills         int64 `json:"spills"`    // copies that went to disk because memory was full, ever
	Evictions      int64 `json:"evictions"` // Cache copies evicted for room, ever
	// CacheUsed and CacheCapacity are the bytes of Cache copies held and
	// their bound (Config.CacheCapacity; 0: none beyond memory's).
	CacheUsed     int64 `json:"cache_used"`
	CacheCapacity int64 `json:"cache_capacity"`
	CacheEntries  int   `json:"cache_entries"` // Cache copies held
	// MemoHits and MemoMisses count Memo's answers: found (here or being
	// produced elsewhere), or produced by this node.
	MemoHits   int64 `json:"memo_hits"`
	MemoMisses int64 `json:"memo_misses"`
	Overflows  int64 `json:"overflows"` // copies held beyond capacity so a decode could finish
	Puts       int64 `json:"puts"`      // objects staged by this node, ever
	Gets       int64 `json:"gets"`      // objects fetched by this node, ever
	Repairs    int64 `json:"repairs"`   // records this node re-replicated
	Collected  int64 `json:"collected"` // records this node collected
	Lost       int64 `json:"lost"`      // of which every holder was gone
	// Recovered counts the durable copies this run found on disk at start
	// and has not yet named in a record or freed; Reannounced the records
	// it has named such a copy in again, ever.
	Recovered   int   `json:"recovered"`
	Reannounced int64 `json:"reannounced"`
	// WatchEvents counts the events this node's watches of its records
	// and its markers received, ever: a record's writes reach its
	// holders, not every node.
	WatchEvents int64 `json:"watch_events"`
	// ByMode counts the copies held by lease mode and tier.
	ByMode map[Mode]*TierCounts `json:"by_mode,omitempty"`
}

// TierCounts counts copies and their bytes per tier.
type TierCounts struct {
	MemoryCopies int   `json:"memory_copies"`
	MemoryBytes  int64 `json:"memory_bytes"`
	DiskCopies   int   `json:"disk_copies"`
	DiskBytes    int64 `json:"disk_bytes"`
}

func (t *TierCounts) add(tier Tier, size int64) {
	switch tier {
	case Memory:
		t.MemoryCopies++
		t.MemoryBytes += size
	case Disk:
		t.DiskCopies++
		t.DiskBytes += size
	}
}

// LocalStats reports this node's holdings and counters.
func (s *Store) LocalStats() LocalStats {
	h := s.hold
	h.mu.Lock()
	st := LocalStats{
		MemoryUsed: h.memUsed, MemoryCapacity: s.cfg.MemoryCapacity,
		DiskUsed: h.diskUsed, DiskCapacity: s.cfg.SpillCapacity,
		Copies: len(h.copies), Spills: h.spilled, Evictions: h.evictions, Overflows: h.overflows,
		CacheUsed: h.cacheUsed, CacheCapacity: s.cfg.CacheCapacity, CacheEntries: h.cacheN,
		MemoHits: s.memoHits.Load(), MemoMisses: s.memoMisses.Load(),
		ByMode: map[Mode]*TierCounts{},
	}
	for _, c := range h.copies {
		if !c.committed && !c.recovered {
			st.Staged++
		}
		if c.recovered {
			st.Recovered++
		}
		t := st.ByMode[c.mode]
		if t == nil {
			t = &TierCounts{}
			st.ByMode[c.mode] = t
		}
		t.add(c.tier, c.size)
	}
	h.mu.Unlock()
	st.Puts, st.Gets = s.puts.Load(), s.gets.Load()
	st.Repairs, st.Collected, st.Lost = s.repairs.Load(), s.collected.Load(), s.lost.Load()
	st.Reannounced, st.WatchEvents = s.reannounced.Load(), s.watchEvents.Load()
	return st
}

// ModeSummary counts the objects of one lease mode, and their copies by tier.
type ModeSummary struct {
	Objects int   `json:"objects"`
	Bytes   int64 `json:"bytes"` // logical: each object once
	TierCounts
}

// Summary is the Store as its records describe it.
type Summary struct {
	Objects int   `json:"objects"`
	Bytes   int64 `json:"bytes"`
	Copies  int   `json:"copies"`
	// UnderReplicated counts objects with fewer holders than they want.
	UnderReplicated int `json:"under_replicated"`
	// PendingConsumers counts objects waiting for a consuming stage (Consume).
	PendingConsumers int                   `json:"pending_consumers"`
	ByMode           map[Mode]*ModeSummary `json:"by_mode"`
	// Expiring counts objects with a retention; Oldest is the earliest
	// creation among all.
	Expiring int       `json:"expiring"`
	Oldest   time.Time `json:"oldest,omitzero"`
}

// Summarize counts recs by mode and tier.
func Summarize(recs []Record) Summary {
	s := Summary{ByMode: map[Mode]*ModeSummary{}}
	for _, r := range recs {
		m := s.ByMode[r.Mode]
		if m == nil {
			m = &ModeSummary{}
			s.ByMode[r.Mode] = m
		}
		s.Objects++
		s.Bytes += r.Size
		m.Objects++
		m.Bytes += r.Size
		for _, h := range r.Holders {
			s.Copies++
			m.add(h.Tier, r.Size)
		}
		if len(r.Holders) < r.Replicas {
			s.UnderReplicated++
		}
		if r.Mode == Consume {
			s.PendingConsumers++
		}
		if !r.ExpiresAt.IsZero() {
			s.Expiring++
		}
		if s.Oldest.IsZero() || r.CreatedAt.Before(s.Oldest) {
			s.Oldest = r.CreatedAt
		}
	}
	return s
}
