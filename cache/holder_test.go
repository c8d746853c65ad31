package cache

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/transfer"
)

// bareStore is a Store with holdings on a heap-only transfer service and
// no etcd: enough to drive reconciliation and apply by hand.
func bareStore(t *testing.T, mem int64) (*Store, *transfer.Service) {
	t.Helper()
	h, err := transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	xcfg := transfer.DefaultConfig()
	xcfg.Logger = zaptest.NewLogger(t)
	x, err := transfer.New(xcfg, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Close() })
	cfg := testStoreConfig(t, "/bare", "n0")
	cfg.MemoryCapacity = mem
	cfg, err = cfg.validate()
	if err != nil {
		t.Fatal(err)
	}
	s := &Store{cfg: cfg, log: cfg.Logger, xfer: x}
	s.hold = newHoldings(x, &s.cfg, s.log)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.epoch, s.endEpoch = context.WithCancel(s.ctx)
	t.Cleanup(func() {
		s.cancel()
		s.wg.Wait() // the watches of records a check found
	})
	return s, x
}

// reconcileList reconciles s's copies as if its markers, listed at
// revision rev, pointed to the records ls alone, each read at rev; it
// returns the copies to check with etcd.
func reconcileList(s *Store, rev int64, ls ...*listed) []copyOf {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	s.idx.entries = nil
	for _, l := range ls {
		e := s.idx.addLocked(l.ID)
		e.rec, e.rev = l, rev
	}
	s.idx.rev = rev
	unnamed, _ := s.reconcileLocked()
	return unnamed
}

// testClient is a client of the package's etcd, closed with the test.
func testClient(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: etcdEndpoints(t), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// holdCopy stages a copy of data on s as object id.
func holdCopy(t *testing.T, s *Store, x *transfer.Service, id string, data []byte) copyOf {
	t.Helper()
	src, err := x.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(len(data))}}, data)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Release(src.ID)
	tier, _, err := s.hold.reserve(int64(len(data)), Pinned, false)
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.hold.fill(context.Background(), id, Pinned, tier, source{ref: src}, false)
	if err != nil {
		t.Fatal(err)
	}
	return *c
}

func recordEvent(typ mvccpb.Event_EventType, rev int64, rec Record) *clientv3.Event {
	v := []byte(encodeRecord(rec))
	ev := &clientv3.Event{Type: typ, Kv: &mvccpb.KeyValue{ModRevision: rev}}
	if typ == mvccpb.PUT {
		ev.Kv.Value = v
	} else {
		ev.PrevKv = &mvccpb.KeyValue{Value: v}
	}
	return ev
}

// The maintenance list and the watch race: a list taken before a record
// appeared must not free a copy the watch has already committed, and a
// watch event older than a list must not free what the list committed.
func TestStaleRecordStateKeepsCopy(t *testing.T) {
	s, x := bareStore(t, 1<<20)
	c := holdCopy(t, s, x, "obj", pattern(4096, 1))
	rec := Record{ID: "obj", Size: 4096, Mode: Pinned, Replicas: 1, Holders: []Holder{{Node: "n0", Tier: Memory, Ref: c.ref}}}

	s.apply(recordEvent(mvccpb.PUT, 10, rec)) // the watch sees the record at 10
	if st := s.LocalStats(); st.Copies != 1 || st.Staged != 0 {
		t.Fatalf("after the record's put: %+v", st)
	}
	reconcileList(s, 9) // a list from before the record
	if st := s.LocalStats(); st.Copies != 1 {
		t.Fatalf("a list older than the commit freed the copy: %+v", st)
	}
	other := rec
	other.Holders = []Holder{{Node: "n1", Tier: Memory, Ref: c.ref}}
	s.apply(recordEvent(mvccpb.PUT, 8, other)) // a stale rewrite without us
	s.apply(recordEvent(mvccpb.DELETE, 9, rec))
	if st := s.LocalStats(); st.Copies != 1 {
		t.Fatalf("stale events freed the copy: %+v", st)
	}

	// A newer list without the record frees it.
	reconcileList(s, 11)
	if st := s.LocalStats(); st.Copies != 0 || st.MemoryUsed != 0 {
		t.Fatalf("a newer list without the record kept %+v", st)
	}

	// A newer delete frees a copy a list committed.
	c = holdCopy(t, s, x, "obj", pattern(4096, 2))
	rec.Holders[0].Ref = c.ref
	reconcileList(s, 20, &listed{Record: rec})
	if st := s.LocalStats(); st.Copies != 1 || st.Staged != 0 {
		t.Fatalf("a list naming the copy did not commit it: %+v", st)
	}
	s.apply(recordEvent(mvccpb.DELETE, 15, rec))
	if st := s.LocalStats(); st.Copies != 1 {
		t.Fatalf("a delete older than the list freed the copy: %+v", st)
	}
	s.apply(recordEvent(mvccpb.DELETE, 21, rec))
	if st := s.LocalStats(); st.Copies != 0 || st.MemoryUsed != 0 {
		t.Fatalf("delete kept %+v", st)
	}
	if held, _ := x.Held(); held != 0 {
		t.Errorf("%d payloads left in the service", held)
	}
}

func TestStagedCopyTimesOut(t *testing.T) {
	s, x := bareStore(t, 1<<20)
	s.cli = testClient(t) // the drop asks etcd first
	now := time.Now()
	s.cfg.Now = func() time.Time { return now }
	holdCopy(t, s, x, "late", pattern(4096, 3))
	reconcileList(s, 1)
	if st := s.LocalStats(); st.Staged != 1 {
		t.Fatalf("a young staged copy went: %+v", st)
	}
	now = now.Add(s.cfg.StageTimeout + time.Millisecond)
	s.checkUnnamed(testCtx(t), reconcileList(s, 2)) // etcd has no record of it
	if st := s.LocalStats(); st.Copies != 0 || st.MemoryUsed != 0 {
		t.Fatalf("a timed-out staged copy stayed: %+v", st)
	}
}

// A copy whose bytes do not match the source's checksum is refused and
// gives its memory reservation back.
func TestFailedCopyGivesRoomBack(t *testing.T) {
	s, x := bareStore(t, 1<<20)
	data := pattern(8192, 4)
	src, err := x.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(len(data))}}, data)
	if err != nil {
		t.Fatal(err)
	}
	x.Release(src.ID) // the source is gone before the copy starts
	tier, _, err := s.hold.reserve(int64(len(data)), Pinned, false)
	if err != nil || tier != Memory {
		t.Fatalf("reserve: %s %v", tier, err)
	}
	if _, err := s.hold.fill(context.Background(), "gone", Pinned, tier, source{ref: src}, false); !errors.Is(err, transfer.ErrNotFound) {
		t.Fatalf("fill = %v, want ErrNotFound", err)
	}
	if mem, _ := s.Free(); mem != 1<<20 {
		t.Errorf("%d bytes free after a failed copy, want %d", mem, 1<<20)
	}
	if held, _ := x.Held(); held != 0 {
		t.Errorf("%d payloads held after a failed copy, want 0", held)
	}
}

// Eviction takes Cache copies in memory, least recently used first, and
// only when that makes enough room.
func TestReserveEvictsLRU(t *testing.T) {
	const size = 4096
	s, x := bareStore(t, 3*size)
	var ids []string
	for _, id := range []string{"c1", "c2", "c3"} {
		src, err := x.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{size}}, pattern(size, 5))
		if err != nil {
			t.Fatal(err)
		}
		tier, _, err := s.hold.reserve(size, Cache, false)
		if err != nil {
			t.Fatal(err)
		}
		c, err := s.hold.fill(context.Background(), id, Cache, tier, source{ref: src}, false)
		x.Release(src.ID)
		if err != nil {
			t.Fatal(err)
		}
		s.hold.commit(c.ref.ID, 1)
		ids = append(ids, c.ref.ID)
	}
	s.hold.touch(ids[0]) // c1 is now the most recent
	// Too big to fit even with every cache copy gone: nothing is evicted.
	if _, ev, err := s.hold.reserve(4*size, Pinned, false); !errors.Is(err, ErrFull) || len(ev) != 0 {
		t.Fatalf("oversized reserve: evicted %d, err %v", len(ev), err)
	}
	// A cache put evicts the least recently used cache entry (the cache
	// is an LRU within its room).
	_, ev, err := s.hold.reserve(size, Cache, false)
	if err != nil || len(ev) != 1 || ev[0].object != "c2" {
		t.Fatalf("cache reserve: evicted %v, err %v; want c2", ev, err)
	}
	s.hold.release(ev...)
	s.hold.unreserveMode(Memory, size, Cache)
	tier, ev, err := s.hold.reserve(2*size, Pinned, false)
	if err != nil || tier != Memory {
		t.Fatalf("reserve: %s %v", tier, err)
	}
	s.hold.release(ev...)
	var got []string
	for _, c := range ev {
		got = append(got, c.object)
	}
	if len(got) != 1 || got[0] != "c3" {
		t.Fatalf("evicted %v, want [c3]", got)
	}
	if st := s.LocalStats(); st.Evictions != 2 || st.Copies != 1 || st.MemoryUsed != 3*size || st.CacheUsed != size {
		t.Errorf("stats %+v", st)
	}
}

// A node empties its own spill directory when it starts (copies died with
// its previous run) and leaves other nodes' directories alone.
func TestPrepareSpillRemovesStaleCopies(t *testing.T) {
	dir := t.TempDir()
	for _, node := range []string{"n0", "n1"} {
		if err := os.MkdirAll(filepath.Join(dir, node), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, node, "old-1.spill"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testStoreConfig(t, "/bare", "n0")
	cfg.SpillDir, cfg.SpillCapacity = dir, 1<<20
	cfg, err := cfg.validate()
	if err != nil {
		t.Fatal(err)
	}
	h := newHoldings(nil, &cfg, cfg.Logger)
	if err := h.prepareSpill(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "n0", "old-1.spill")); !os.IsNotExist(err) {
		t.Fatalf("n0's stale spill file survived: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "n1", "old-1.spill")); err != nil {
		t.Fatalf("n1's spill file was touched: %v", err)
	}
}
