package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/transfer"
)

// bytesMeta is the meta of n plain bytes.
func bytesMeta(n int) transfer.TensorMeta {
	return transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(n)}}
}

// lease grants a lease for a memo's flight key, revoked at cleanup.
func (c *cluster) lease(t *testing.T) clientv3.LeaseID {
	t.Helper()
	l, err := c.cli.Grant(testCtx(t), 30)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.cli.Revoke(context.Background(), l.ID) })
	return l.ID
}

// Many agents asking for one new entry at once produce it once; every one
// of them gets the same record, and reads the same bytes.
func TestMemoProducesOnceAcrossTheMesh(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 1 << 20})
	ctx := testCtx(t)
	lease := c.lease(t)
	want := pattern(4096, 7)
	var produced atomic.Int32
	produce := func(context.Context) ([]byte, transfer.TensorMeta, error) {
		produced.Add(1)
		return bytes.Clone(want), bytesMeta(len(want)), nil
	}
	var wg sync.WaitGroup
	recs := make([]Record, 12)
	hits := make([]bool, 12)
	errs := make([]error, 12)
	for i := range recs {
		n := c.nodes[i%3]
		wg.Go(func() { recs[i], hits[i], errs[i] = n.s.Memo(ctx, MemoSpec{ID: "cond.v.one", Lease: lease}, produce) })
	}
	wg.Wait()
	misses := 0
	for i := range recs {
		if errs[i] != nil {
			t.Fatalf("memo %d: %v", i, errs[i])
		}
		if recs[i].ID != "cond.v.one" || recs[i].Mode != Cache || len(recs[i].Holders) != 1 || recs[i].Holders[0].Node != recs[0].Holders[0].Node {
			t.Fatalf("memo %d: record %+v, want one copy on %s", i, recs[i], recs[0].Holders[0].Node)
		}
		if !hits[i] {
			misses++
		}
	}
	if n := produced.Load(); n != 1 || misses != 1 {
		t.Fatalf("produced %d times, %d misses; want 1 and 1", n, misses)
	}
	// Each node finds it (its holder in its index, the others by a read,
	// remembered for EntryTTL), and reads it.
	for _, n := range c.nodes {
		eventually(t, 10*time.Second, "entry found on "+n.name, func() error {
			if _, ok := n.s.Entry(ctx, "cond.v.one"); !ok {
				return errors.New("not yet")
			}
			return nil
		})
		rec, hit, err := n.s.Memo(ctx, MemoSpec{ID: "cond.v.one", Lease: lease}, produce)
		if err != nil || !hit {
			t.Fatalf("%s: memo again: hit %v, %v", n.name, hit, err)
		}
		got := make([]byte, rec.Size)
		if err := n.s.Fetch(ctx, rec, got); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: fetch: %v (equal %v)", n.name, err, bytes.Equal(got, want))
		}
	}
	if n := produced.Load(); n != 1 {
		t.Fatalf("produced %d times after the reads", n)
	}
	// Nothing is left in flight.
	resp, err := c.cli.Get(ctx, flightKey(c.prefix, "cond.v.one"))
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("flight key left: %v %v", resp, err)
	}
}

// A failed production deletes the flight key and caches nothing; the next
// Memo produces the entry.
func TestMemoFailureCachesNothing(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 1 << 20})
	ctx := testCtx(t)
	lease := c.lease(t)
	boom := errors.New("encoder broke")
	_, _, err := c.nodes[0].s.Memo(ctx, MemoSpec{ID: "cond.v.fail", Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) { return nil, transfer.TensorMeta{}, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("memo: %v, want %v", err, boom)
	}
	resp, err := c.cli.Get(ctx, flightKey(c.prefix, "cond.v.fail"))
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("flight key left after a failure: %v %v", resp.Kvs, err)
	}
	rec, hit, err := c.nodes[1].s.Memo(ctx, MemoSpec{ID: "cond.v.fail", Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) {
		return pattern(100, 1), bytesMeta(100), nil
	})
	if err != nil || hit || rec.Holders[0].Node != "n1" {
		t.Fatalf("memo after a failure: %+v hit %v %v", rec, hit, err)
	}
}

// Entries stay within CacheCapacity: the least recently used goes first,
// its record with it, and an entry larger than the room is refused.
func TestMemoWithinCacheCapacity(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 1 << 20, tune: func(cfg *Config) { cfg.CacheCapacity = 10 << 10 }})
	ctx := testCtx(t)
	n := c.nodes[0]
	lease := c.lease(t)
	put := func(id string) {
		t.Helper()
		if _, _, err := n.s.Memo(ctx, MemoSpec{ID: id, Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) {
			return pattern(4<<10, 3), bytesMeta(4 << 10), nil
		}); err != nil {
			t.Fatalf("memo %s: %v", id, err)
		}
		eventually(t, 10*time.Second, id+" indexed", func() error {
			if _, ok := n.s.Entry(ctx, id); !ok {
				return errors.New("not yet")
			}
			return nil
		})
	}
	put("cond.a")
	put("cond.b")
	// Reading a touches it: b is now the least recently used.
	if err := n.s.Fetch(ctx, mustEntry(t, n, "cond.a"), make([]byte, 4<<10)); err != nil {
		t.Fatal(err)
	}
	put("cond.c") // 12 KiB > 10 KiB: b goes
	eventually(t, 10*time.Second, "b evicted", func() error {
		if _, ok := n.s.Entry(ctx, "cond.b"); ok {
			return errors.New("b still an entry")
		}
		if resp := c.rawRecord(ctx, "cond.b"); len(resp.Kvs) != 0 {
			return errors.New("b's record still in etcd")
		}
		return nil
	})
	for _, id := range []string{"cond.a", "cond.c"} {
		mustEntry(t, n, id)
	}
	st := n.s.LocalStats()
	if st.CacheUsed != 8<<10 || st.Evictions != 1 || st.CacheCapacity != 10<<10 {
		t.Fatalf("stats %+v: want 8 KiB used of 10, one eviction", st)
	}
	_, _, err := n.s.Memo(ctx, MemoSpec{ID: "cond.big", Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) {
		return pattern(11<<10, 3), bytesMeta(11 << 10), nil
	})
	if !errors.Is(err, ErrFull) {
		t.Fatalf("an entry over the room: %v, want ErrFull", err)
	}
}

func mustEntry(t *testing.T, n *node, id string) Record {
	t.Helper()
	rec, ok := n.s.Entry(testCtx(t), id)
	if !ok {
		t.Fatalf("%s: no entry %s", n.name, id)
	}
	return rec
}

// An entry whose holder left is no entry: the next Memo produces it again.
func TestMemoAfterHolderLeft(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 1 << 20})
	ctx := testCtx(t)
	lease := c.lease(t)
	spec := MemoSpec{ID: "cond.v.gone", Lease: lease}
	if _, _, err := c.nodes[0].s.Memo(ctx, spec, func(context.Context) ([]byte, transfer.TensorMeta, error) {
		return pattern(100, 2), bytesMeta(100), nil
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "indexed on n1", func() error {
		if _, ok := c.nodes[1].s.Entry(ctx, spec.ID); !ok {
			return errors.New("not yet")
		}
		return nil
	})
	c.kill("n0")
	if _, ok := c.nodes[1].s.Entry(ctx, spec.ID); ok {
		t.Fatal("an entry whose only holder left is still an entry")
	}
	rec, hit, err := c.nodes[1].s.Memo(ctx, spec, func(context.Context) ([]byte, transfer.TensorMeta, error) {
		return pattern(100, 2), bytesMeta(100), nil
	})
	if err != nil || hit || rec.Holders[0].Node != "n1" {
		t.Fatalf("memo after the holder left: %+v hit %v %v", rec, hit, err)
	}
}

// DropEntries deletes this node's entries that keep refuses, and no other.
func TestDropEntries(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 1 << 20})
	ctx := testCtx(t)
	n := c.nodes[0]
	lease := c.lease(t)
	for _, id := range []string{"cond.old.1", "cond.old.2", "cond.new.1", "other.old.1"} {
		if _, _, err := n.s.Memo(ctx, MemoSpec{ID: id, Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) { return []byte(id), bytesMeta(len(id)), nil }); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "indexed", func() error {
		for _, id := range []string{"cond.old.1", "cond.old.2", "cond.new.1", "other.old.1"} {
			if _, ok := n.s.Entry(ctx, id); !ok {
				return fmt.Errorf("%s not yet", id)
			}
		}
		return nil
	})
	dropped, err := n.s.DropEntries(ctx, "cond.", func(id string) bool { return id == "cond.new.1" })
	if err != nil || dropped != 2 {
		t.Fatalf("dropped %d, %v; want 2", dropped, err)
	}
	for id, want := range map[string]bool{"cond.old.1": false, "cond.old.2": false, "cond.new.1": true, "other.old.1": true} {
		if got := len(c.rawRecord(ctx, id).Kvs) == 1; got != want {
			t.Errorf("%s: record kept %v, want %v", id, got, want)
		}
	}
}

// CacheEntries bounds how many entries a node holds, whatever their size:
// each costs a record in etcd.
func TestMemoWithinCacheEntries(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 1 << 20, tune: func(cfg *Config) { cfg.CacheEntries = 3 }})
	ctx := testCtx(t)
	n := c.nodes[0]
	lease := c.lease(t)
	for i := range 5 {
		id := fmt.Sprintf("cond.e%d", i)
		if _, _, err := n.s.Memo(ctx, MemoSpec{ID: id, Lease: lease}, func(context.Context) ([]byte, transfer.TensorMeta, error) {
			return pattern(100, 1), bytesMeta(100), nil
		}); err != nil {
			t.Fatal(err)
		}
		// Only an entry its holder has seen recorded can be evicted: a
		// copy whose record is still on its way counts in the room and is
		// nobody's to drop, so the next Memo would find no room.
		eventually(t, 10*time.Second, id+" recorded", func() error {
			if _, ok := n.s.Entry(ctx, id); !ok {
				return errors.New("not yet")
			}
			return nil
		})
	}
	eventually(t, 10*time.Second, "two evicted", func() error {
		if st := n.s.LocalStats(); st.CacheEntries != 3 || st.Evictions != 2 {
			return fmt.Errorf("%d entries, %d evictions; want 3 and 2", st.CacheEntries, st.Evictions)
		}
		for i, want := range []bool{false, false, true, true, true} {
			if _, ok := n.s.Entry(ctx, fmt.Sprintf("cond.e%d", i)); ok != want {
				return fmt.Errorf("entry %d: %v, want %v", i, ok, want)
			}
		}
		return nil
	})
}
