package engine

import (
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash/crc32"
	"sync"
)

// KVCache holds tensors computed from conditioning alone, shared across
// requests: the unconditional branch's attention keys and values, which
// depend only on the engine and the negative prompt's half of the
// conditioning. Get returns a value previously Put under key (the caller
// must not modify it); Put may drop values (a budget) and takes ownership of
// value. Implementations are safe for concurrent use.
type KVCache interface {
	Get(key string) ([]byte, bool)
	Put(key string, value []byte)
}

// kvKey names one branch's keys and values: the engine (its ID covers every
// setting that changes the weights), the projection's shape and a hash of
// the branch's conditioning bytes.
func (e *Engine) kvKey(half []byte) string {
	sum := sha256.Sum256(half)
	return e.id + "/kv/" + e.attn.kvShape() + "/" + hex.EncodeToString(sum[:])
}

// encodeKV is a cache value: the float64 keys and values exactly as the
// steps use them, then a CRC-32C of those bytes, so a value damaged in a
// cache that crosses processes is recomputed rather than used.
func encodeKV(kv []float64) []byte {
	b := make([]byte, 8*len(kv)+4)
	putFloat64s(b, kv)
	binary.LittleEndian.PutUint32(b[8*len(kv):], crc32.Checksum(b[:8*len(kv)], castagnoli))
	return b
}

// decodeKV fills kv from a cache value and reports whether it was whole.
func decodeKV(kv []float64, b []byte) bool {
	n := 8 * len(kv)
	if len(b) != n+4 || binary.LittleEndian.Uint32(b[n:]) != crc32.Checksum(b[:n], castagnoli) {
		return false
	}
	getFloat64s(kv, b[:n])
	return true
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// MemKVCache is an in-memory KVCache of at most a budget of bytes (keys and
// values), evicting the least recently used entries first.
type MemKVCache struct {
	budget int64

	mu sync.Mutex
	// mu guards the fields below.
	lru     *list.List // of *kvEntry, most recently used first
	entries map[string]*list.Element
	stats   KVCacheStats
}

type kvEntry struct {
	key   string
	value []byte
}

// KVCacheStats are a MemKVCache's counters, for metrics.
type KVCacheStats struct {
	Hits, Misses int64 // Get calls that found / did not find their key
	Evictions    int64 // entries dropped to stay within the budget
	Entries      int   // entries held
	Bytes        int64 // bytes of keys and values held
}

// NewKVCache is an in-memory KVCache of at most budget bytes; a value
// larger than the budget is never held.
func NewKVCache(budget int64) *MemKVCache {
	return &MemKVCache{budget: budget, lru: list.New(), entries: make(map[string]*list.Element)}
}

// Get returns the value put under key, if it is still held.
func (c *MemKVCache) Get(key string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.entries[key]
	if !ok {
		c.stats.Misses++
		return nil, false
	}
	c.stats.Hits++
	c.lru.MoveToFront(el)
	return el.Value.(*kvEntry).value, true
}

// Put holds value under key, replacing what was there, and evicts the least
// recently used entries until the cache fits its budget.
func (c *MemKVCache) Put(key string, value []byte) {
	size := int64(len(key) + len(value))
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.entries[key]; ok {
		c.removeLocked(el)
	}
	if size > c.budget {
		return
	}
	c.entries[key] = c.lru.PushFront(&kvEntry{key: key, value: value})
	c.stats.Bytes += size
	c.stats.Entries++
	for c.stats.Bytes > c.budget {
		c.removeLocked(c.lru.Back())
		c.stats.Evictions++
	}
}

func (c *MemKVCache) removeLocked(el *list.Element) {
	en := c.lru.Remove(el).(*kvEntry)
	delete(c.entries, en.key)
	c.stats.Bytes -= int64(len(en.key) + len(en.value))
	c.stats.Entries--
}

// Stats returns the cache's counters.
func (c *MemKVCache) Stats() KVCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}
