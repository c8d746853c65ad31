package cache

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/transfer"
)

// countingKV counts the requests that go through an etcd client's KV, and
// apart the range reads of object records, the collector's pages (reads
// with a limit) apart again. Reads under a context from uncounted (the
// test's own) are not counted.
type countingKV struct {
	clientv3.KV
	requests atomic.Int64
	ranges   atomic.Int64 // range reads under some <prefix>/objects/, but pages
	pages    atomic.Int64 // range reads with a limit under some <prefix>/objects/
}

type uncountedKey struct{}

func uncounted(ctx context.Context) context.Context {
	return context.WithValue(ctx, uncountedKey{}, true)
}

// install puts k in front of cli's KV (a clusterConfig.client).
func (k *countingKV) install(cli *clientv3.Client) {
	k.KV = cli.KV
	cli.KV = k
}

func (k *countingKV) count(ctx context.Context, op clientv3.Op) {
	if ctx.Value(uncountedKey{}) != nil {
		return
	}
	k.requests.Add(1)
	switch {
	case !op.IsGet() || !strings.Contains(string(op.KeyBytes()), "/objects/"):
	case op.Limit() > 0:
		k.pages.Add(1)
	default:
		k.ranges.Add(1)
	}
}

func (k *countingKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	k.count(ctx, clientv3.OpGet(key, opts...))
	return k.KV.Get(ctx, key, opts...)
}

func (k *countingKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	k.count(ctx, clientv3.OpPut(key, val, opts...))
	return k.KV.Put(ctx, key, val, opts...)
}

func (k *countingKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	k.count(ctx, clientv3.OpDelete(key, opts...))
	return k.KV.Delete(ctx, key, opts...)
}

func (k *countingKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	k.count(ctx, op)
	return k.KV.Do(ctx, op)
}

// Txn counts a transaction as one request (the Store's are conditional
// writes; none reads records).
func (k *countingKV) Txn(ctx context.Context) clientv3.Txn {
	k.count(ctx, clientv3.Op{})
	return k.KV.Txn(ctx)
}

// gatedWatcher lets a test break the watches of an etcd client, as a
// leader loss would, and hold new ones back until it resumes.
type gatedWatcher struct {
	clientv3.Watcher

	mu sync.Mutex
	// mu guards the fields below.
	open    chan struct{}        // closed while watches may start
	cancels []context.CancelFunc // ends the watches started since the last cut
	held    int                  // Watch calls waiting for open
}

func (w *gatedWatcher) install(cli *clientv3.Client) {
	w.Watcher = cli.Watcher
	w.open = make(chan struct{})
	close(w.open)
	cli.Watcher = w
}

func (w *gatedWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.mu.Lock()
	for {
		open := w.open
		w.held++
		w.mu.Unlock()
		select {
		case <-open:
		case <-ctx.Done():
		}
		w.mu.Lock()
		w.held--
		if ctx.Err() != nil {
			w.mu.Unlock()
			ch := make(chan clientv3.WatchResponse)
			close(ch)
			return ch
		}
		if w.open == open { // not cut since
			break
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	w.cancels = append(w.cancels, cancel)
	w.mu.Unlock()
	return w.Watcher.Watch(ctx, key, opts...)
}

// cut ends every watch and holds new ones back until resume.
func (w *gatedWatcher) cut() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.open = make(chan struct{})
	for _, cancel := range w.cancels {
		cancel()
	}
	w.cancels = nil
}

func (w *gatedWatcher) resume() {
	w.mu.Lock()
	defer w.mu.Unlock()
	close(w.open)
}

// waitHeld waits until a Watch call is held back: the watch that was cut
// has ended, and its owner is trying to watch again.
func (w *gatedWatcher) waitHeld(t *testing.T) {
	t.Helper()
	eventually(t, 10*time.Second, "a watch held back", func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.held == 0 {
			return fmt.Errorf("no Watch call waiting")
		}
		return nil
	})
}

// quiet leaves the maintenance passes to the test: the periodic ones are
// an hour apart.
func quiet(cfg *Config) { cfg.MaintainEvery = time.Hour }

// foreignRecord is a record of an object held by a node that is not in
// the test's mesh: no pass of the mesh repairs, unlists or (within
// LostGrace) collects it.
func foreignRecord(id string) Record {
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4096}}
	return Record{
		ID: id, Size: 4096, Checksum: 1, Meta: meta, Mode: Cache, Replicas: 1, CreatedAt: time.Now().UTC(),
		Holders: []Holder{{Node: "elsewhere", Tier: Memory, Ref: transfer.Ref{ID: "p-" + id, Meta: meta, Checksum: 1}}},
	}
}

// putRecord writes rec to etcd as a put would, and returns its revision.
func (c *cluster) putRecord(ctx context.Context, rec Record) int64 {
	c.t.Helper()
	resp, err := c.cli.Put(uncounted(ctx), ObjectKey(c.prefix, rec.ID), encodeRecord(rec))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Header.Revision
}

// deleteRecord deletes id's record, and returns the revision.
func (c *cluster) deleteRecord(ctx context.Context, id string) int64 {
	c.t.Helper()
	resp, err := c.cli.Delete(uncounted(ctx), ObjectKey(c.prefix, id))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Header.Revision
}

// objects reads what etcd holds under the cluster's objects prefix: each
// object's record revision.
func (c *cluster) objects(ctx context.Context) map[string]int64 {
	c.t.Helper()
	resp, err := c.cli.Get(uncounted(ctx), ObjectsPrefix(c.prefix), clientv3.WithPrefix())
	if err != nil {
		c.t.Fatal(err)
	}
	out := map[string]int64{}
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), ObjectsPrefix(c.prefix))] = kv.ModRevision
	}
	return out
}

// indexOf reads s's index: each object's record revision, and the
// revision the index is whole through (0: not loaded).
func indexOf(s *Store) (map[string]int64, int64) {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	out := make(map[string]int64, len(s.idx.recs))
	for _, l := range s.idx.recs {
		out[l.ID] = l.modRev
	}
	return out, s.idx.rev
}

// indexMatches waits until s's index holds what etcd holds, whole through
// at least revision rev.
func indexMatches(t *testing.T, c *cluster, s *Store, rev int64, what string) {
	t.Helper()
	ctx := testCtx(t)
	eventually(t, 10*time.Second, what, func() error {
		idx, at := indexOf(s)
		if want := c.objects(ctx); !maps.Equal(idx, want) || at < rev {
			return fmt.Errorf("index %v at revision %d; etcd %v, want revision >= %d", idx, at, want, rev)
		}
		return nil
	})
}

// The watch keeps the index current: records put, rewritten and deleted
// through etcd appear in it, change and leave without any pass, and no
// pass reads the records from etcd but the collector's page.
func TestIndexFollowsWatch(t *testing.T) {
	kv := &countingKV{}
	c := newCluster(t, clusterConfig{nodes: 1, tune: quiet, client: kv.install})
	ctx := testCtx(t)
	s := c.nodes[0].s
	indexMatches(t, c, s, 1, "index loaded")
	loads := kv.ranges.Load()
	if loads < 1 {
		t.Fatalf("the index loaded with %d range reads counted; the counter misses them", loads)
	}
	passes := func() {
		for range 5 {
			s.maintain(ctx)
		}
	}

	rev := c.putRecord(ctx, foreignRecord("a"))
	c.putRecord(ctx, foreignRecord("b"))
	indexMatches(t, c, s, rev, "puts indexed")
	passes()
	moved := foreignRecord("a")
	moved.Holders[0].Node = "faraway"
	rev = c.putRecord(ctx, moved)
	indexMatches(t, c, s, rev, "rewrite indexed")
	s.idx.mu.Lock()
	if l := lookup(s.idx.recs, "a"); l == nil || l.Holders[0].Node != "faraway" {
		t.Errorf("index entry after the rewrite: %+v", l)
	}
	s.idx.mu.Unlock()
	passes()
	rev = c.deleteRecord(ctx, "a")
	indexMatches(t, c, s, rev, "delete indexed")
	passes()
	if idx, _ := indexOf(s); len(idx) != 1 || idx["b"] == 0 {
		t.Errorf("index %v, want b alone", idx)
	}
	if n := kv.ranges.Load() - loads; n != 0 {
		t.Errorf("15 passes read the records from etcd %d times, want 0", n)
	}
}

// A watch resumed below etcd's compaction lost events: the Store lists
// again, and the index holds exactly what etcd does.
func TestIndexRelistsAfterCompaction(t *testing.T) {
	kv, w := &countingKV{}, &gatedWatcher{}
	c := newCluster(t, clusterConfig{nodes: 1, tune: quiet, client: func(cli *clientv3.Client) {
		kv.install(cli)
		w.install(cli)
	}})
	ctx := testCtx(t)
	s := c.nodes[0].s
	var rev int64
	for _, id := range []string{"a", "b", "c"} {
		rev = c.putRecord(ctx, foreignRecord(id))
	}
	indexMatches(t, c, s, rev, "index loaded")
	lists := kv.ranges.Load()

	w.cut() // as a leader loss would
	w.waitHeld(t)
	c.deleteRecord(ctx, "a")
	moved := foreignRecord("b")
	moved.Holders[0].Node = "faraway"
	c.putRecord(ctx, moved)
	rev = c.putRecord(ctx, foreignRecord("d"))
	if _, err := c.cli.Compact(ctx, rev); err != nil {
		t.Fatal(err)
	}
	w.resume()
	indexMatches(t, c, s, rev, "index after the compacted watch")
	if n := kv.ranges.Load() - lists; n != 1 {
		t.Errorf("%d lists after the compacted watch, want 1", n)
	}
	// It follows the new watch from there.
	rev = c.deleteRecord(ctx, "c")
	indexMatches(t, c, s, rev, "index follows after the list")
}

// A replaced etcd's history is not the one the Store followed: it lists
// again at once, with the watch held back, and a copy whose record the new
// etcd lacks is freed.
func TestEtcdReplacedListsAgain(t *testing.T) {
	kv, w := &countingKV{}, &gatedWatcher{}
	c := newCluster(t, clusterConfig{nodes: 1, mem: 4 << 20, tune: quiet, client: func(cli *clientv3.Client) {
		kv.install(cli)
		w.install(cli)
	}})
	ctx := testCtx(t)
	n := c.nodes[0]
	for i, id := range []string{"kept", "vanished"} {
		if _, err := n.s.PutBytes(ctx, PutSpec{ID: id, Mode: Pinned}, pattern(objSize, byte(100+i))); err != nil {
			t.Fatal(err)
		}
	}
	wantStats(t, n, "copies committed", func(ls LocalStats) bool { return ls.Copies == 2 && ls.Staged == 0 })
	w.cut()
	w.waitHeld(t)
	c.deleteRecord(ctx, "vanished") // unseen by the watch: a record the new etcd lacks
	lists := kv.ranges.Load()
	n.s.EtcdReplaced()
	wantStats(t, n, "the vanished record's copy freed", func(ls LocalStats) bool {
		return ls.Copies == 1 && ls.Staged == 0 && ls.MemoryUsed == objSize
	})
	if got := kv.ranges.Load() - lists; got != 1 {
		t.Errorf("%d lists after EtcdReplaced, want 1", got)
	}
	indexMatches(t, c, n.s, 1, "index listed again")
	w.resume()
}

// The collector reads OrphanBatch records a pass and asks Orphans about
// them, in a cycle that reaches every object within ceil(N/OrphanBatch)
// passes, and never about an object the pass collects as expired.
func TestOrphanCheckBatched(t *testing.T) {
	const objects, batch = 23, 5
	var mu sync.Mutex
	var asked [][]string
	orphans := func(_ context.Context, recs []Record) ([]string, error) {
		mu.Lock()
		defer mu.Unlock()
		var ids []string
		for _, r := range recs {
			ids = append(ids, r.ID)
		}
		asked = append(asked, ids)
		return nil, nil
	}
	kv := &countingKV{}
	c := newCluster(t, clusterConfig{nodes: 1, orphans: orphans, client: kv.install, tune: func(cfg *Config) {
		quiet(cfg)
		cfg.OrphanBatch = batch
	}})
	ctx := testCtx(t)
	s := c.nodes[0].s
	var rev int64
	want := map[string]bool{}
	for i := range objects {
		rec := foreignRecord(fmt.Sprintf("obj-%02d", i))
		rec.Job = fmt.Sprintf("job-%02d", i)
		rev = c.putRecord(ctx, rec)
		want[rec.ID] = true
	}
	for _, id := range []string{"exp-a", "obj-05x"} {
		rec := foreignRecord(id)
		rec.ExpiresAt = time.Now().Add(-time.Hour)
		rev = c.putRecord(ctx, rec)
	}
	indexMatches(t, c, s, rev, "index loaded")
	reads := kv.pages.Load()

	passes := (objects + 2 + batch - 1) / batch
	seen := map[string]bool{}
	for p := range passes {
		s.maintain(ctx)
		mu.Lock()
		if len(asked) != p+1 {
			t.Fatalf("after %d passes Orphans was called %d times", p+1, len(asked))
		}
		last := asked[p]
		mu.Unlock()
		if len(last) == 0 || len(last) > batch {
			t.Errorf("pass %d asked about %d objects, want 1..%d", p, len(last), batch)
		}
		for _, id := range last {
			if !want[id] {
				t.Errorf("pass %d asked about %s, collected as expired", p, id)
			}
			seen[id] = true
		}
	}
	if len(seen) != objects {
		var missed []string
		for id := range want {
			if !seen[id] {
				missed = append(missed, id)
			}
		}
		slices.Sort(missed)
		t.Errorf("%d passes asked about %d of %d objects; never %v", passes, len(seen), objects, missed)
	}
	if st := s.LocalStats(); st.Collected != 2 {
		t.Errorf("%d collected, want the 2 expired", st.Collected)
	}
	if n := kv.pages.Load() - reads; n != int64(passes) {
		t.Errorf("%d passes read %d pages of records, want one each", passes, n)
	}
}

// BenchmarkMaintainPass times one maintenance pass over 2,000 records on
// the collector of a three-node mesh: as passes run now, from the index
// (index), and as they ran before, reading and decoding every record
// first (list+pass); list is that read alone. etcd-req/op counts the
// requests a pass sends to etcd.
func BenchmarkMaintainPass(b *testing.B) {
	const records = 2000
	kv := &countingKV{}
	noOrphans := func(context.Context, []Record) ([]string, error) { return nil, nil }
	c := newCluster(b, clusterConfig{nodes: 3, orphans: noOrphans, tune: quiet, client: kv.install})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	members := c.members()
	collector := rank(members, collectorKey)[0].Node
	s := c.node(collector).s
	var holders []Member // the other two: every object is held elsewhere, healthy
	for _, m := range members {
		if m.Node != collector {
			holders = append(holders, m)
		}
	}
	meta := transfer.TensorMeta{DType: transfer.BFloat16, Shape: []int64{1, 16, 64, 64}}
	var ops []clientv3.Op
	var rev int64
	for i := range records {
		job := fmt.Sprintf("job-%016x", i)
		rec := Record{ID: JobObjectID(job, "result"), Size: meta.Bytes(), Checksum: uint64(i), Meta: meta, ContentType: "image/png",
			Mode: Pinned, Job: job, Replicas: 2, CreatedAt: time.Now().UTC(), ExpiresAt: time.Now().Add(24 * time.Hour).UTC()}
		for _, m := range holders {
			rec.Holders = append(rec.Holders, Holder{Node: m.Node, Tier: Memory, Ref: transfer.Ref{
				ID: fmt.Sprintf("%s-%d", m.Node, i), Meta: meta, Checksum: uint64(i),
				Producer: transfer.Producer{PeerID: m.PeerID, P2PAddrs: m.P2PAddrs, Host: m.Host},
			}})
		}
		ops = append(ops, clientv3.OpPut(ObjectKey(c.prefix, rec.ID), encodeRecord(rec)))
		if len(ops) == 100 || i == records-1 {
			resp, err := c.cli.Txn(uncounted(ctx)).Then(ops...).Commit()
			if err != nil {
				b.Fatal(err)
			}
			rev, ops = resp.Header.Revision, nil
		}
	}
	deadline := time.Now().Add(time.Minute)
	for {
		if idx, at := indexOf(s); len(idx) == records && at >= rev {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("index never held every record")
		}
		time.Sleep(10 * time.Millisecond)
	}
	run := func(name string, pass func()) {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			before := kv.requests.Load()
			for b.Loop() {
				pass()
			}
			b.ReportMetric(float64(kv.requests.Load()-before)/float64(b.N), "etcd-req/op")
		})
	}
	run("index", func() { s.maintain(ctx) })
	run("list+pass", func() {
		ls, rev, err := s.list(ctx, "")
		if err != nil || len(ls) != records {
			b.Fatalf("list: %d records, %v", len(ls), err)
		}
		s.reconcile(ls, rev)
		s.tend(ctx, ls)
	})
	run("list", func() {
		if ls, _, err := s.list(ctx, ""); err != nil || len(ls) != records {
			b.Fatalf("list: %d records, %v", len(ls), err)
		}
	})
}
