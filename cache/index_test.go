package cache

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
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
// with a limit) apart again, and of markers. Reads under a context from
// uncounted (the test's own) are not counted.
type countingKV struct {
	clientv3.KV
	requests atomic.Int64
	ranges   atomic.Int64 // range reads under some <prefix>/objects/, but pages
	pages    atomic.Int64 // range reads with a limit under some <prefix>/objects/
	markers  atomic.Int64 // range reads under some <prefix>/holders/
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
	key := string(op.KeyBytes())
	switch {
	case !op.IsGet():
	case strings.Contains(key, "/holders/"):
		k.markers.Add(1)
	case !strings.Contains(key, "/objects/"):
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

// Txn counts a transaction as one request, not as range reads (the
// Store's are conditional writes, and the loads of a node's records when
// its markers are listed).
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

// countingWatcher counts the events an etcd client's watches receive, by
// the key each watch was opened on.
type countingWatcher struct {
	clientv3.Watcher

	mu sync.Mutex
	// mu guards events.
	events map[string]int
}

func (w *countingWatcher) install(cli *clientv3.Client) {
	w.Watcher = cli.Watcher
	w.events = map[string]int{}
	cli.Watcher = w
}

func (w *countingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	in := w.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for wr := range in {
			w.mu.Lock()
			w.events[key] += len(wr.Events)
			w.mu.Unlock()
			select {
			case out <- wr:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// snapshot returns the events counted so far, by watch key.
func (w *countingWatcher) snapshot() map[string]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.events)
}

// quiet leaves the maintenance passes to the test: the periodic ones are
// an hour apart.
func quiet(cfg *Config) { cfg.MaintainEvery = time.Hour }

// recordOn is a record of an object whose one copy node holds (a copy the
// test never made: no pass is run on node while it names it).
func recordOn(id, node string) Record {
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4096}}
	return Record{
		ID: id, Size: 4096, Checksum: 1, Meta: meta, Mode: Cache, Replicas: 1, CreatedAt: time.Now().UTC(),
		Holders: []Holder{{Node: node, Tier: Memory, Ref: transfer.Ref{ID: "p-" + id, Meta: meta, Checksum: 1}}},
	}
}

// foreignRecord is a record of an object held by a node that is not in
// the test's mesh: no pass of the mesh repairs, unlists or (within
// LostGrace) collects it.
func foreignRecord(id string) Record { return recordOn(id, "elsewhere") }

// putRecord writes rec to etcd as a put would, with its holders' markers,
// and returns its revision.
func (c *cluster) putRecord(ctx context.Context, rec Record) int64 {
	c.t.Helper()
	resp, err := c.cli.Txn(uncounted(ctx)).Then(writeOps(c.prefix, rec.ID, &rec, 0, nil)...).Commit()
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Header.Revision
}

// deleteRecord deletes id's record (blind, as a consuming commit does),
// and returns the revision.
func (c *cluster) deleteRecord(ctx context.Context, id string) int64 {
	c.t.Helper()
	resp, err := c.cli.Delete(uncounted(ctx), ObjectKey(c.prefix, id))
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Header.Revision
}

// recordsOn reads what etcd holds under the cluster's objects prefix that
// names node: each object's record revision.
func (c *cluster) recordsOn(ctx context.Context, node string) map[string]int64 {
	c.t.Helper()
	resp, err := c.cli.Get(uncounted(ctx), ObjectsPrefix(c.prefix), clientv3.WithPrefix())
	if err != nil {
		c.t.Fatal(err)
	}
	out := map[string]int64{}
	for _, kv := range resp.Kvs {
		if rec, err := decodeRecord(kv.Value); err == nil && names(rec.Holders, node) {
			out[rec.ID] = kv.ModRevision
		}
	}
	return out
}

// markersOf reads node's markers: the object ids.
func (c *cluster) markersOf(ctx context.Context, node string) []string {
	c.t.Helper()
	prefix := markersPrefix(c.prefix, node)
	resp, err := c.cli.Get(uncounted(ctx), prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		c.t.Fatal(err)
	}
	var out []string
	for _, kv := range resp.Kvs {
		out = append(out, strings.TrimPrefix(string(kv.Key), prefix))
	}
	return out
}

// indexOf reads s's index: each object's record revision, for the loaded
// entries with a record.
func indexOf(s *Store) map[string]int64 {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	out := map[string]int64{}
	for _, l := range s.idx.recordsLocked() {
		out[l.ID] = l.modRev
	}
	return out
}

// indexMatches waits until s's index holds the records etcd holds that
// name s's node.
func indexMatches(t *testing.T, c *cluster, s *Store, what string) {
	t.Helper()
	ctx := testCtx(t)
	eventually(t, 10*time.Second, what, func() error {
		if idx, want := indexOf(s), c.recordsOn(ctx, s.cfg.Node); !maps.Equal(idx, want) {
			return fmt.Errorf("index %v; etcd %v", idx, want)
		}
		return nil
	})
}

// The watches keep each node's index to the records that name it (here
// objects whose holders watch their records; a result is followed by its
// markers alone, TestResultFollowedByMarkers): records put, rewritten and
// deleted through etcd appear in it, change and leave without any pass, a
// record naming another node never does, and no pass reads the records
// from etcd. A record deleted blind leaves its holder's marker, which the
// holder's next pass drops.
func TestIndexFollowsOwnRecords(t *testing.T) {
	kv := &countingKV{}
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: quiet, client: kv.install})
	ctx := testCtx(t)
	collector := rank(c.members(), collectorKey)[0].Node
	n, other := c.nodes[0], c.nodes[1]
	if n.name == collector { // the collector's pass reads a page of records
		n, other = other, n
	}
	s := n.s
	passes := func() {
		for range 5 {
			s.maintain(ctx)
		}
	}
	put := func(on *node, id string) Record {
		t.Helper()
		rec, err := on.s.PutBytes(ctx, PutSpec{ID: id, Mode: TTL, TTL: time.Hour, Local: true}, pattern(4096, 9))
		if err != nil {
			t.Fatal(err)
		}
		return rec
	}
	reads := kv.ranges.Load()
	a := put(n, "a")
	put(n, "b")
	put(other, "c")
	indexMatches(t, c, s, "puts indexed")
	if idx := indexOf(s); len(idx) != 2 || idx["c"] != 0 {
		t.Fatalf("index %v, want a and b alone", idx)
	}
	// Each holder took the new record from its marker, which carries it.
	if n := kv.ranges.Load() - reads; n != 0 {
		t.Errorf("three puts cost %d reads of records, want 0", n)
	}
	reads = kv.ranges.Load()
	a.ContentType = "image/png"
	c.putRecord(ctx, a)
	indexMatches(t, c, s, "rewrite indexed")
	s.idx.mu.Lock()
	if e := s.idx.getLocked("a"); e == nil || e.rec == nil || e.rec.ContentType != "image/png" {
		t.Errorf("index entry after the rewrite: %+v", e)
	}
	s.idx.mu.Unlock()
	c.deleteRecord(ctx, "b")
	indexMatches(t, c, s, "delete indexed")
	wantStats(t, n, "b's copy freed", func(ls LocalStats) bool { return ls.Copies == 1 })
	if got := c.markersOf(ctx, n.name); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("%s's markers %v before a pass, want a and b (b's record deleted blind)", n.name, got)
	}
	passes()
	if got := c.markersOf(ctx, n.name); !slices.Equal(got, []string{"a"}) {
		t.Errorf("%s's markers %v after a pass, want a alone", n.name, got)
	}
	if n := kv.ranges.Load() - reads; n != 0 {
		t.Errorf("5 passes read records from etcd %d times, want 0", n)
	}
}

// A record written for two holders reaches those two Stores' watches and
// no other, however many nodes the mesh has: a write costs each holder one
// event (its marker, which carries the record); a delete (Delete deletes
// the markers with the record) one more for a result, which its holders
// follow by their markers alone and never watch, and two for an object
// its holders watch (the record, the marker). No watch is opened on all
// of objects/.
func TestRecordReachesOnlyItsHolders(t *testing.T) {
	for _, tc := range []struct {
		spec  PutSpec
		byKey bool // its holders watch the record's key
	}{
		{PutSpec{ID: "j1.result", Mode: Pinned, Replicas: 2}, false},
		{PutSpec{ID: "j1.ckpt.000010", Mode: TTL, TTL: time.Hour, Replicas: 2}, true},
	} {
		t.Run(string(tc.spec.Mode), func(t *testing.T) {
			w := &countingWatcher{}
			c := newCluster(t, clusterConfig{nodes: 4, mem: 4 << 20, tune: quiet, client: w.install})
			ctx := testCtx(t)
			before := map[string]int64{}
			for _, n := range c.nodes {
				before[n.name] = n.s.LocalStats().WatchEvents
			}
			rec, err := c.nodes[0].s.PutBytes(ctx, tc.spec, pattern(objSize, 5))
			if err != nil {
				t.Fatal(err)
			}
			holders := holderNodes(rec)
			if len(holders) != 2 {
				t.Fatalf("holders %v, want 2", holders)
			}
			events := func(n *node) int64 { return n.s.LocalStats().WatchEvents - before[n.name] }
			for _, h := range holders {
				n := c.node(h)
				wantStats(t, n, "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
				eventually(t, 10*time.Second, h+" follows the record", func() error {
					n.s.idx.mu.Lock()
					defer n.s.idx.mu.Unlock()
					if e := n.s.idx.getLocked(rec.ID); e == nil || e.rev == 0 {
						return errors.New("not yet")
					}
					return nil
				})
				if got := events(n); got != 1 {
					t.Errorf("holder %s received %d events, want 1 (its marker)", h, got)
				}
			}
			if err := c.nodes[0].s.Delete(ctx, rec.ID); err != nil {
				t.Fatal(err)
			}
			want := int64(2)
			if tc.byKey {
				want = 3
			}
			for _, h := range holders {
				n := c.node(h)
				wantStats(t, n, "freed by the delete's event", func(ls LocalStats) bool { return ls.Copies == 0 })
				eventually(t, 10*time.Second, h+" saw its marker go", func() error {
					if got := events(n); got != want {
						return fmt.Errorf("%d events, want %d", got, want)
					}
					return nil
				})
			}
			for _, n := range c.nodes {
				if !slices.Contains(holders, n.name) {
					if got := events(n); got != 0 {
						t.Errorf("%s, no holder, received %d events of the record", n.name, got)
					}
				}
			}
			var total int
			for key, n := range w.snapshot() {
				total += n
				if key == ObjectsPrefix(c.prefix) || key == c.prefix+"/" {
					t.Errorf("a watch of %s received %d events", key, n)
				}
				if key == ObjectKey(c.prefix, rec.ID) && !tc.byKey {
					t.Errorf("a result's record was watched (%d events): its holders follow it by their markers", n)
				}
			}
			if total != 2*int(want) {
				t.Errorf("the mesh's watches received %d events, want %d: %v", total, 2*want, w.snapshot())
			}
		})
	}
}

// A watch resumed below etcd's compaction lost events: each record's
// watch reads its record again, the markers are listed again (finding a
// record that came to name the node meanwhile), and the index holds
// exactly what etcd does.
func TestIndexReloadsAfterCompaction(t *testing.T) {
	kv, w := &countingKV{}, &gatedWatcher{}
	c := newCluster(t, clusterConfig{nodes: 1, tune: quiet, client: func(cli *clientv3.Client) {
		kv.install(cli)
		w.install(cli)
	}})
	ctx := testCtx(t)
	s := c.nodes[0].s
	var rev int64
	for _, id := range []string{"a", "b", "c"} {
		rev = c.putRecord(ctx, recordOn(id, "n0"))
	}
	indexMatches(t, c, s, "index loaded")
	lists := kv.markers.Load()

	w.cut() // as a leader loss would
	w.waitHeld(t)
	c.deleteRecord(ctx, "a")
	moved := recordOn("b", "n0")
	moved.Holders[0].Ref.ID = "p-moved"
	c.putRecord(ctx, moved)
	rev = c.putRecord(ctx, recordOn("d", "n0"))
	if _, err := c.cli.Compact(ctx, rev); err != nil {
		t.Fatal(err)
	}
	w.resume()
	indexMatches(t, c, s, "index after the compacted watches")
	if n := kv.markers.Load() - lists; n != 1 {
		t.Errorf("%d lists of the markers after the compacted watch, want 1", n)
	}
	s.idx.mu.Lock()
	if e := s.idx.getLocked("b"); e == nil || e.rec == nil || e.rec.Holders[0].Ref.ID != "p-moved" {
		t.Errorf("b's entry after the reload: %+v", e)
	}
	s.idx.mu.Unlock()
	// Each record is followed from there.
	c.deleteRecord(ctx, "c")
	c.deleteRecord(ctx, "d")
	indexMatches(t, c, s, "index follows after the reload")
}

// A replaced etcd's history is not the one the Store followed: it lists
// its markers again at once, with the watches held back, and a copy whose
// record the new etcd lacks is freed.
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
	// Unseen by the watches: a record (and marker) the new etcd lacks.
	if _, err := c.cli.Txn(ctx).Then(writeOps(c.prefix, "vanished", nil, 0, []Holder{{Node: n.name}})...).Commit(); err != nil {
		t.Fatal(err)
	}
	lists := kv.markers.Load()
	n.s.EtcdReplaced()
	wantStats(t, n, "the vanished record's copy freed", func(ls LocalStats) bool {
		return ls.Copies == 1 && ls.Staged == 0 && ls.MemoryUsed == objSize
	})
	if got := kv.markers.Load() - lists; got != 1 {
		t.Errorf("%d lists of the markers after EtcdReplaced, want 1", got)
	}
	w.resume()
	indexMatches(t, c, n.s, "index listed again")
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
	want := map[string]bool{}
	for i := range objects {
		rec := foreignRecord(fmt.Sprintf("obj-%02d", i))
		rec.Job = fmt.Sprintf("job-%02d", i)
		c.putRecord(ctx, rec)
		want[rec.ID] = true
	}
	for _, id := range []string{"exp-a", "obj-05x"} {
		rec := foreignRecord(id)
		rec.ExpiresAt = time.Now().Add(-time.Hour)
		c.putRecord(ctx, rec)
	}
	indexMatches(t, c, s, "index loaded") // the pass skips until it is
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

// BenchmarkMaintainPass times one maintenance pass of a three-node mesh
// keeping 2,000 objects, all held by one node: on that holder, whose pass
// works from the records that name it (its index) and reads none, and on
// the collector, whose pass reads and judges one page of OrphanBatch
// records. etcd-req/op counts the requests a pass sends to etcd.
func BenchmarkMaintainPass(b *testing.B) {
	const records = 2000
	kv := &countingKV{}
	noOrphans := func(context.Context, []Record) ([]string, error) { return nil, nil }
	c := newCluster(b, clusterConfig{nodes: 3, mem: 8 << 20, orphans: noOrphans, tune: quiet, client: kv.install})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	members := c.members()
	collector := c.node(rank(members, collectorKey)[0].Node)
	var holder *node
	for _, n := range c.nodes {
		if n != collector {
			holder = n
		}
	}
	for i := range records {
		job := fmt.Sprintf("job-%016x", i)
		spec := PutSpec{ID: JobObjectID(job, "result"), Mode: Pinned, Job: job, TTL: 24 * time.Hour, ContentType: "image/png", Local: true}
		if _, err := holder.s.PutBytes(uncounted(ctx), spec, pattern(1024, byte(i))); err != nil {
			b.Fatal(err)
		}
	}
	deadline := time.Now().Add(time.Minute)
	for len(indexOf(holder.s)) != records {
		if time.Now().After(deadline) {
			b.Fatal("the holder's index never held every record")
		}
		time.Sleep(10 * time.Millisecond)
	}
	run := func(name string, s *Store) {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			before := kv.requests.Load()
			for b.Loop() {
				s.maintain(ctx)
			}
			b.ReportMetric(float64(kv.requests.Load()-before)/float64(b.N), "etcd-req/op")
		})
	}
	run("holder", holder.s)
	run("collector", collector.s)
}

// A marker carries its record thinned: each holder learns what its copy
// needs from the marker's event (no read), the marker stays small, and
// the whole record is read only to act on it, never written back thin.
func TestMarkersCarryThinRecords(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: quiet})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "job1.result", Mode: Pinned, Replicas: 2, ContentType: "image/png"}, pattern(objSize, 3))
	if err != nil {
		t.Fatal(err)
	}
	whole, err := c.cli.Get(uncounted(ctx), ObjectKey(c.prefix, rec.ID))
	if err != nil || len(whole.Kvs) != 1 {
		t.Fatalf("record: %v %v", whole, err)
	}
	for _, h := range holderNodes(rec) {
		resp, err := c.cli.Get(uncounted(ctx), markerKey(c.prefix, h, rec.ID))
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("%s's marker: %v %v", h, resp, err)
		}
		m := resp.Kvs[0]
		got, err := decodeThin(m.Value)
		if err != nil {
			t.Fatalf("%s's marker does not carry a record: %q", h, m.Value)
		}
		for i, gh := range got.Holders {
			if wh := rec.Holders[i]; gh.Node != wh.Node || gh.Tier != wh.Tier || gh.Ref.ID != wh.Ref.ID {
				t.Errorf("%s's marker names holder %+v, want %+v", h, gh, wh)
			}
		}
		if got.ID != rec.ID || got.Checksum != rec.Checksum || got.Mode != rec.Mode || got.Replicas != rec.Replicas || len(got.Holders) != len(rec.Holders) {
			t.Errorf("%s's marker carries %+v, want the thin copy of %+v", h, got, rec)
		}
		if len(m.Value) > 300 || len(m.Value) >= len(whole.Kvs[0].Value)/4 || m.ModRevision != whole.Kvs[0].ModRevision {
			t.Errorf("%s's marker: %d bytes at revision %d, the record %d bytes at %d: want at most 300 and under a quarter, same revision", h, len(m.Value), m.ModRevision, len(whole.Kvs[0].Value), whole.Kvs[0].ModRevision)
		}
		n := c.node(h)
		wantStats(t, n, "committed from the marker", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
		n.s.idx.mu.Lock()
		l := n.s.idx.getLocked(rec.ID).rec
		n.s.idx.mu.Unlock()
		if l == nil || !l.thin {
			t.Fatalf("%s's entry %+v, want the marker's thin copy", h, l)
		}
		// Acting on it reads the record: whole, and the entry keeps it.
		w, err := n.s.whole(ctx, l)
		if err != nil || w == nil || w.thin || !reflect.DeepEqual(w.Record, rec) {
			t.Fatalf("whole: %+v %v, want the record %+v", w, err, rec)
		}
		n.s.idx.mu.Lock()
		if e := n.s.idx.getLocked(rec.ID); e.rec != w {
			t.Errorf("%s's entry kept %+v after the read, want the whole record", h, e.rec)
		}
		n.s.idx.mu.Unlock()
	}
}

// A result's holders follow its record by their markers alone: no watch
// of its key; a rewrite that read it (here as a repair writes) reaches
// every holder through its marker, which carries the new record; a blind
// delete, which tells no marker, is found by the next verification
// (VerifyEvery) and frees the copies.
func TestResultFollowedByMarkers(t *testing.T) {
	w := &countingWatcher{}
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: quiet, client: w.install})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "j1.result", Mode: Pinned, Replicas: 2}, pattern(objSize, 4))
	if err != nil {
		t.Fatal(err)
	}
	holders := holderNodes(rec)
	entry := func(n *node) entry {
		n.s.idx.mu.Lock()
		defer n.s.idx.mu.Unlock()
		if e := n.s.idx.getLocked(rec.ID); e != nil {
			return *e
		}
		return entry{}
	}
	for _, h := range holders {
		n := c.node(h)
		wantStats(t, n, "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
		eventually(t, 10*time.Second, h+" follows the record by its marker", func() error {
			if e := entry(n); !e.byMarker || e.stop != nil || e.rec == nil {
				return fmt.Errorf("entry %+v, want one followed by its marker alone", e)
			}
			return nil
		})
	}
	// A rewrite that read the record: the other holder hears of it.
	n := c.node(holders[0])
	l, err := n.s.whole(ctx, entry(n).rec)
	if err != nil || l == nil {
		t.Fatalf("whole: %v %v", l, err)
	}
	next := l.Record
	next.ContentType = "image/webp"
	if resp, err := n.s.writeIf(ctx, l, &next); err != nil || !resp.Succeeded {
		t.Fatalf("rewrite: %v %v", resp, err)
	}
	other := c.node(holders[1])
	eventually(t, 10*time.Second, holders[1]+" hears of the rewrite", func() error {
		if e := entry(other); e.rev <= l.modRev || e.rec == nil || !e.rec.thin {
			return fmt.Errorf("entry %+v, want the rewrite's thin record after revision %d", e, l.modRev)
		}
		return nil
	})
	if n := w.snapshot()[ObjectKey(c.prefix, rec.ID)]; n != 0 {
		t.Errorf("the result's record was watched: %d events", n)
	}
	// A blind delete tells no holder: the copies stay until verified.
	c.deleteRecord(ctx, rec.ID)
	for _, h := range holders {
		n := c.node(h)
		if ls := n.s.LocalStats(); ls.Copies != 1 {
			t.Fatalf("%s: %d copies right after a blind delete, want its copy kept until verified", h, ls.Copies)
		}
		n.s.idx.mu.Lock()
		n.s.idx.getLocked(rec.ID).checked = time.Time{} // due
		n.s.idx.mu.Unlock()
		n.s.verify(ctx)
		wantStats(t, n, "freed by the verification", func(ls LocalStats) bool { return ls.Copies == 0 })
	}
}
