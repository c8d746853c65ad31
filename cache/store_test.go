package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/zeebo/xxh3"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/transfer"
)

const objSize = 256 << 10

func TestPutReadFromEveryNode(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20})
	ctx := testCtx(t)
	data := pattern(objSize+123, 1)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "job-1.latent", Mode: Pinned, Job: "job-1"}, data)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Size != int64(len(data)) || rec.Checksum != xxh3.Hash(data) || rec.Replicas != 2 || rec.Job != "job-1" {
		t.Fatalf("record size %d xxh3 %x replicas %d job %q; want %d %x 2 job-1", rec.Size, rec.Checksum, rec.Replicas, rec.Job, len(data), xxh3.Hash(data))
	}
	holders := holderNodes(rec)
	if len(holders) != 2 || holders[0] == holders[1] {
		t.Fatalf("holders %v, want 2 distinct", holders)
	}
	for _, h := range rec.Holders {
		if h.Tier != Memory || h.Ref.Checksum != rec.Checksum {
			t.Errorf("holder %s tier %s xxh3 %x", h.Node, h.Tier, h.Ref.Checksum)
		}
	}

	for _, n := range c.nodes {
		got, r, err := n.s.ReadAll(ctx, rec.ID)
		if err != nil {
			t.Fatalf("%s: read: %v", n.name, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("%s: read bytes differ", n.name)
		}
		if !slices.Equal(holderNodes(r), holders) {
			t.Errorf("%s: looked-up holders %v, put returned %v", n.name, holderNodes(r), holders)
		}
	}

	raw := c.rawRecord(ctx, rec.ID)
	if len(raw.Kvs) != 1 {
		t.Fatalf("%d keys at %s", len(raw.Kvs), ObjectKey(c.prefix, rec.ID))
	}
	v := raw.Kvs[0].Value
	if len(v) >= 2<<10 {
		t.Errorf("record is %d bytes, want < 2 KiB", len(v))
	}
	for off := 0; off+32 <= len(data); off += len(data) / 7 {
		if bytes.Contains(v, data[off:off+32]) {
			t.Fatalf("record holds object bytes at %d", off)
		}
	}

	// Holders commit their copies when they see the record; others hold
	// nothing, and the putter's own published source is gone.
	for _, n := range c.nodes {
		if _, ok := rec.Holds(n.name); ok {
			wantStats(t, n, "committed copy", func(st LocalStats) bool {
				return st.Copies == 1 && st.Staged == 0 && st.MemoryUsed == rec.Size
			})
		} else if st := n.s.LocalStats(); st.Copies != 0 || st.MemoryUsed != 0 {
			t.Errorf("%s holds nothing but reports %+v", n.name, st)
		}
		want := 0
		if _, ok := rec.Holds(n.name); ok {
			want = 1
		}
		if held, _ := n.x.Held(); held != want {
			t.Errorf("%s: transfer service holds %d payloads, want %d", n.name, held, want)
		}
	}
	if st := c.nodes[0].s.LocalStats(); st.Puts != 1 || st.Gets != 1 {
		t.Errorf("putter puts %d gets %d, want 1 1", st.Puts, st.Gets)
	}
}

func TestTwoPhasePut(t *testing.T) {
	holdersOf := func(c *cluster, st *Staged) []*node {
		var out []*node
		for _, h := range st.Record.Holders {
			out = append(out, c.node(h.Node))
		}
		return out
	}
	invisible := func(t *testing.T, c *cluster, id string) {
		t.Helper()
		ctx := testCtx(t)
		_, err := c.nodes[0].s.Lookup(ctx, id)
		notFound(t, "lookup of a staged object", err)
		_, _, err = c.nodes[1].s.ReadAll(ctx, id)
		notFound(t, "read of a staged object", err)
	}

	t.Run("StageTimeout", func(t *testing.T) {
		const timeout = time.Second
		c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: func(cfg *Config) {
			cfg.StageTimeout = timeout
			cfg.MaintainEvery = 200 * time.Millisecond
		}})
		ctx := testCtx(t)
		start := time.Now()
		st, err := c.nodes[0].s.StageBytes(ctx, PutSpec{ID: "staged", Mode: Pinned}, pattern(objSize, 2))
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Record.Holders) != 2 {
			t.Fatalf("staged on %v", holderNodes(st.Record))
		}
		for _, n := range holdersOf(c, st) {
			if ls := n.s.LocalStats(); ls.Copies != 1 || ls.Staged != 1 || ls.MemoryUsed != objSize {
				t.Errorf("%s right after Stage: %+v", n.name, ls)
			}
		}
		invisible(t, c, "staged")
		for _, n := range holdersOf(c, st) {
			wantStats(t, n, "staged copy dropped", func(ls LocalStats) bool {
				return ls.Copies == 0 && ls.Staged == 0 && ls.MemoryUsed == 0
			})
		}
		if el := time.Since(start); el < timeout {
			t.Errorf("staged copies dropped after %v, before StageTimeout %v", el, timeout)
		}
		invisible(t, c, "staged")
	})

	t.Run("Abort", func(t *testing.T) {
		c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: func(cfg *Config) {
			cfg.StageTimeout = time.Minute
		}})
		ctx := testCtx(t)
		st, err := c.nodes[0].s.StageBytes(ctx, PutSpec{ID: "aborted", Mode: Pinned}, pattern(objSize, 3))
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range holdersOf(c, st) {
			if ls := n.s.LocalStats(); ls.Staged != 1 {
				t.Errorf("%s after Stage: %+v", n.name, ls)
			}
		}
		st.Abort(ctx)
		for _, n := range c.nodes {
			// Far below the minute a timed-out stage would take.
			eventually(t, 3*time.Second, n.name+": aborted copy dropped", func() error {
				if ls := n.s.LocalStats(); ls.Copies != 0 || ls.MemoryUsed != 0 {
					return fmt.Errorf("stats %+v", ls)
				}
				if held, _ := n.x.Held(); held != 0 {
					return fmt.Errorf("%d payloads held", held)
				}
				return nil
			})
		}
		invisible(t, c, "aborted")
	})

	t.Run("OpInOwnTxn", func(t *testing.T) {
		c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20})
		ctx := testCtx(t)
		data := pattern(objSize, 4)
		st, err := c.nodes[1].s.StageBytes(ctx, PutSpec{ID: "j.out", Mode: Consume, Job: "j"}, data)
		if err != nil {
			t.Fatal(err)
		}
		invisible(t, c, "j.out")
		// A fenced commit: the record is written only if the fence holds.
		fence := c.prefix + "/fence"
		resp, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(fence), "=", 0)).
			Then(st.Op(), clientv3.OpPut(fence, "x")).Commit()
		if err != nil || !resp.Succeeded {
			t.Fatalf("txn: %v %v", resp, err)
		}
		got, _, err := c.nodes[0].s.ReadAll(ctx, "j.out")
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read after commit: %v", err)
		}
		for _, n := range holdersOf(c, st) {
			wantStats(t, n, "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
		}
		// The consuming stage's fenced commit frees it.
		if _, err := c.cli.Txn(ctx).Then(c.nodes[0].s.DeleteOp("j.out")).Commit(); err != nil {
			t.Fatal(err)
		}
		for _, n := range c.nodes {
			wantStats(t, n, "consumed copy freed", func(ls LocalStats) bool { return ls.Copies == 0 && ls.MemoryUsed == 0 })
		}
	})
}

func TestDeleteFreesCopies(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20})
	ctx := testCtx(t)
	ids := []string{"del-a", "del-b", "del-c"}
	for i, id := range ids {
		if _, err := c.nodes[i].s.PutBytes(ctx, PutSpec{ID: id, Mode: Pinned}, pattern(objSize, byte(10+i))); err != nil {
			t.Fatal(err)
		}
	}
	var total int64
	eventually(t, 10*time.Second, "every copy committed", func() error {
		total = 0
		for _, n := range c.nodes {
			ls := n.s.LocalStats()
			if ls.Staged != 0 {
				return fmt.Errorf("%s: %+v", n.name, ls)
			}
			total += ls.MemoryUsed
		}
		if total != int64(len(ids))*2*objSize {
			return fmt.Errorf("%d bytes held in all", total)
		}
		return nil
	})
	for _, id := range ids {
		if err := c.nodes[2].s.Delete(ctx, id); err != nil {
			t.Fatal(err)
		}
		_, err := c.nodes[0].s.Lookup(ctx, id)
		notFound(t, "lookup after delete", err)
	}
	for _, n := range c.nodes {
		eventually(t, 5*time.Second, n.name+": copies freed", func() error {
			if ls := n.s.LocalStats(); ls.Copies != 0 || ls.MemoryUsed != 0 {
				return fmt.Errorf("stats %+v", ls)
			}
			if held, _ := n.x.Held(); held != 0 {
				return fmt.Errorf("%d payloads held", held)
			}
			return nil
		})
	}
}

func TestSpillToDisk(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: objSize, disk: 4 * objSize})
	ctx := testCtx(t)
	a, b := pattern(objSize, 20), pattern(objSize, 21)
	ra, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "in-memory", Mode: Consume}, a)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "on-disk", Mode: Consume}, b)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range ra.Holders {
		if h.Tier != Memory {
			t.Errorf("first object: holder %d tier %s", i, h.Tier)
		}
	}
	if len(rb.Holders) != 2 {
		t.Fatalf("second object on %v", holderNodes(rb))
	}
	for i, h := range rb.Holders {
		if h.Tier != Disk {
			t.Errorf("second object: holder %d tier %s, want disk", i, h.Tier)
		}
	}
	for _, n := range c.nodes {
		if fs := spillFiles(t, n.spill); len(fs) != 1 || !strings.Contains(fs[0], "on-disk") {
			t.Errorf("%s: spill files %v", n.name, fs)
		}
		ls := n.s.LocalStats()
		if ls.DiskUsed != objSize || ls.MemoryUsed != objSize || ls.Spills != 1 {
			t.Errorf("%s: %+v", n.name, ls)
		}
		got, _, err := n.s.ReadAll(ctx, "on-disk")
		if err != nil || !bytes.Equal(got, b) {
			t.Fatalf("%s: read spilled object: %v", n.name, err)
		}
		got, _, err = n.s.ReadAll(ctx, "in-memory")
		if err != nil || !bytes.Equal(got, a) {
			t.Fatalf("%s: read memory object: %v", n.name, err)
		}
	}
	// A reader pulling the other node's disk copy goes over the network.
	for _, h := range rb.Holders {
		reader := c.nodes[0]
		if h.Node == reader.name {
			reader = c.nodes[1]
		}
		only := rb
		only.Holders = []Holder{h}
		buf := make([]byte, rb.Size)
		if err := reader.s.Fetch(ctx, only, buf); err != nil || !bytes.Equal(buf, b) {
			t.Fatalf("%s reading %s's disk copy: %v", reader.name, h.Node, err)
		}
	}

	if err := c.nodes[1].s.Delete(ctx, "on-disk"); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		eventually(t, 5*time.Second, n.name+": spill file removed", func() error {
			if fs := spillFiles(t, n.spill); len(fs) != 0 {
				return fmt.Errorf("spill files %v", fs)
			}
			if ls := n.s.LocalStats(); ls.DiskUsed != 0 || ls.MemoryUsed != objSize || ls.Copies != 1 {
				return fmt.Errorf("stats %+v", ls)
			}
			return nil
		})
	}
}

func TestStoreFull(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mem, disk int64
		fill      int   // objects of objSize put first
		size      int64 // the object that does not fit
	}{
		// Every member gossips less room than the object needs.
		{name: "NoMemberHasRoom", mem: objSize, disk: objSize, fill: 2, size: objSize},
		// Members gossip room in memory and on disk together, but neither
		// tier alone has it: each refuses, locally and over the wire.
		{name: "EveryMemberRefuses", mem: objSize, disk: objSize, size: objSize + objSize/2},
		{name: "NoDiskTier", mem: objSize, fill: 1, size: objSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 2, mem: tc.mem, disk: tc.disk})
			ctx := testCtx(t)
			for i := range tc.fill {
				if _, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: fmt.Sprintf("fill-%d", i), Mode: Consume}, pattern(objSize, byte(i))); err != nil {
					t.Fatal(err)
				}
			}
			before := make([]LocalStats, len(c.nodes))
			for i, n := range c.nodes {
				before[i] = n.s.LocalStats()
			}
			_, err := c.nodes[1].s.StageBytes(ctx, PutSpec{ID: "too-much", Mode: Consume}, pattern(int(tc.size), 9))
			if !errors.Is(err, ErrFull) {
				t.Fatalf("stage = %v, want ErrFull", err)
			}
			for i, n := range c.nodes {
				ls := n.s.LocalStats()
				if ls.MemoryUsed != before[i].MemoryUsed || ls.DiskUsed != before[i].DiskUsed || ls.Copies != tc.fill {
					t.Errorf("%s: a refused stage left %+v (before %+v)", n.name, ls, before[i])
				}
				if fs := spillFiles(t, n.spill); len(fs) != max(0, tc.fill-1) {
					t.Errorf("%s: spill files %v", n.name, fs)
				}
			}
		})
	}
}

func TestReReplication(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20})
	ctx := testCtx(t)
	data := pattern(objSize, 30)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "precious", Mode: Consume}, data)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 2 {
		t.Fatalf("holders %v", holderNodes(rec))
	}
	now := c.killFirstHolder(t, ctx, rec)
	for _, n := range c.alive() {
		wantStats(t, n, "holds the committed copy", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
		got, _, err := n.s.ReadAll(ctx, rec.ID)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: read after repair: %v", n.name, err)
		}
	}
	var repairs int64
	for _, n := range c.alive() {
		repairs += n.s.LocalStats().Repairs
	}
	if repairs != 1 {
		t.Errorf("%d repairs, want 1", repairs)
	}
	if now.Checksum != rec.Checksum || now.Size != rec.Size || now.Mode != Consume {
		t.Errorf("repair changed the record: %+v", now)
	}
}

// With nowhere to copy to, a record keeps its live holder and the holder
// that is not alive (cut off or paused, it may come back with its copy;
// dropping it would only lose that copy), and passes that can change
// nothing leave the record alone.
func TestRepairWithoutRoomKeepsHolders(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: func(cfg *Config) {
		cfg.MaintainEvery = 50 * time.Millisecond
	}})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "alone", Mode: Pinned}, pattern(objSize, 31))
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 2 {
		t.Fatalf("holders %v", holderNodes(rec))
	}
	raw := c.rawRecord(ctx, rec.ID)
	if len(raw.Kvs) != 1 {
		t.Fatal("record missing")
	}
	rev := raw.Kvs[0].ModRevision
	c.kill("n1")
	c.kick()
	// Negative check: many passes (50 ms apart), then three more by hand.
	time.Sleep(500 * time.Millisecond)
	for range 3 {
		c.nodes[0].s.maintain(ctx)
	}
	raw = c.rawRecord(ctx, rec.ID)
	if len(raw.Kvs) != 1 || raw.Kvs[0].ModRevision != rev {
		t.Fatalf("record rewritten or deleted with no new holder to name")
	}
	if r := c.nodes[0].s.LocalStats().Repairs; r != 0 {
		t.Errorf("%d repairs, want 0", r)
	}
}

func TestLostObjectCollected(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: func(cfg *Config) { cfg.LostGrace = 0 }})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "fragile", Mode: Pinned, Replicas: 1}, pattern(objSize, 40))
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 1 {
		t.Fatalf("holders %v, want 1", holderNodes(rec))
	}
	keep, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "sturdy", Mode: Pinned, Replicas: 3}, pattern(objSize, 41))
	if err != nil {
		t.Fatal(err)
	}
	c.kill(rec.Holders[0].Node)
	c.kick()
	survivor := c.alive()[0]
	eventually(t, 10*time.Second, "lost record collected", func() error {
		if _, err := survivor.s.Lookup(ctx, rec.ID); !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("lookup: %v", err)
		}
		return nil
	})
	// The collector counts after its delete, which a reader may see first.
	eventually(t, 5*time.Second, "collection counted", func() error {
		var lost, collected int64
		for _, n := range c.alive() {
			ls := n.s.LocalStats()
			lost += ls.Lost
			collected += ls.Collected
		}
		if lost != 1 || collected != 1 {
			return fmt.Errorf("lost %d collected %d, want 1 1", lost, collected)
		}
		return nil
	})
	if _, err := survivor.s.Lookup(ctx, keep.ID); err != nil {
		t.Errorf("an object with live holders went too: %v", err)
	}
}

func TestTTLExpires(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20})
	ctx := testCtx(t)
	start := time.Now()
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "preview", Mode: TTL, TTL: 2 * time.Second, Replicas: 1}, pattern(objSize, 50))
	if err != nil {
		t.Fatal(err)
	}
	if rec.ExpiresAt.Before(start.Add(2*time.Second)) || rec.ExpiresAt.After(start.Add(5*time.Second)) {
		t.Errorf("expires at %v, %v after put", rec.ExpiresAt, rec.ExpiresAt.Sub(start))
	}
	raw := c.rawRecord(ctx, rec.ID)
	if len(raw.Kvs) != 1 || raw.Kvs[0].Lease == 0 {
		t.Fatalf("record without a lease: %v", raw.Kvs)
	}
	holder := c.node(rec.Holders[0].Node)
	wantStats(t, holder, "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
	eventually(t, 10*time.Second, "record expired", func() error {
		_, err := c.nodes[1].s.Lookup(ctx, rec.ID)
		if !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("lookup: %v", err)
		}
		return nil
	})
	if el := time.Since(start); el < 2*time.Second {
		t.Errorf("gone after %v, before its TTL", el)
	}
	wantStats(t, holder, "expired copy freed", func(ls LocalStats) bool { return ls.Copies == 0 && ls.MemoryUsed == 0 })
}

func TestCacheEviction(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reader int // node that reads the first entry: the holder itself, or a peer (a ticket)
	}{
		{"LocalRead", 0},
		{"RemoteRead", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 2, mem: 2 * objSize})
			ctx := testCtx(t)
			holder := c.nodes[0]
			put := func(id string, mode Mode, seed byte) []byte {
				data := pattern(objSize, seed)
				rec, err := holder.s.PutBytes(ctx, PutSpec{ID: id, Mode: mode, Local: true}, data)
				if err != nil {
					t.Fatalf("put %s: %v", id, err)
				}
				if hs := holderNodes(rec); len(hs) != 1 || hs[0] != holder.name {
					t.Fatalf("local put %s on %v", id, hs)
				}
				return data
			}
			first := put("cache-1", Cache, 60)
			put("cache-2", Cache, 61)
			wantStats(t, holder, "both entries committed", func(ls LocalStats) bool { return ls.Copies == 2 && ls.Staged == 0 })
			got, _, err := c.nodes[tc.reader].s.ReadAll(ctx, "cache-1")
			if err != nil || !bytes.Equal(got, first) {
				t.Fatalf("read cache-1: %v", err)
			}
			pinned := put("pinned", Pinned, 62)

			eventually(t, 5*time.Second, "cache-2 evicted", func() error {
				_, err := holder.s.Lookup(ctx, "cache-2")
				if !errors.Is(err, ErrNotFound) {
					return fmt.Errorf("lookup: %v", err)
				}
				return nil
			})
			ls := holder.s.LocalStats()
			if ls.Evictions != 1 || ls.Copies != 2 || ls.MemoryUsed != 2*objSize {
				t.Errorf("stats %+v", ls)
			}
			for id, want := range map[string][]byte{"cache-1": first, "pinned": pinned} {
				got, _, err := c.nodes[1].s.ReadAll(ctx, id)
				if err != nil || !bytes.Equal(got, want) {
					t.Errorf("read %s after eviction: %v", id, err)
				}
			}
		})
	}
}

func TestRequestFromNonMemberDenied(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 4 << 20})
	ctx := testCtx(t)
	target := c.nodes[0]

	foreign, err := transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer foreign.Close()
	if err := foreign.Connect(ctx, peer.AddrInfo{ID: target.h.ID(), Addrs: target.h.Addrs()}); err != nil {
		t.Fatal(err)
	}
	str, err := foreign.NewStream(ctx, target.h.ID(), ProtocolID)
	if err != nil {
		t.Fatal(err)
	}
	defer str.Close()
	str.SetDeadline(time.Now().Add(10 * time.Second))
	req := validRequests()[0]
	if err := transfer.WriteFrame(str, &req); err != nil {
		t.Fatal(err)
	}
	var resp response
	if err := transfer.ReadFrame(str, 16<<10, &resp); err != nil {
		t.Fatal(err)
	}
	if resp.ErrCode != codeDenied {
		t.Fatalf("response %+v, want code %q", resp, codeDenied)
	}
	if ls := target.s.LocalStats(); ls.Copies != 0 {
		t.Errorf("a denied request staged a copy: %+v", ls)
	}

	// A Store that is not in the mesh's member list sees ErrDenied.
	x, err := transfer.New(transfer.DefaultConfig(), foreign)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	cfg := testStoreConfig(t, c.prefix, "outsider")
	outsider, err := New(cfg, c.cli, x, foreign, c.members, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer outsider.Close()
	src, err := x.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1024}}, pattern(1024, 70))
	if err != nil {
		t.Fatal(err)
	}
	_, err = outsider.stageOn(ctx, c.members()[0], "intruder", Pinned, source{ref: src}, nil)
	if !errors.Is(err, ErrDenied) {
		t.Fatalf("stage from an outsider = %v, want ErrDenied", err)
	}
}

func TestOrphansCollected(t *testing.T) {
	var mu sync.Mutex
	orphaned := map[string]bool{}
	var seen []string
	orphans := func(_ context.Context, recs []Record) ([]string, error) {
		mu.Lock()
		defer mu.Unlock()
		var ids []string
		for _, r := range recs {
			seen = append(seen, r.ID)
			if orphaned[r.Job] {
				ids = append(ids, r.ID)
			}
		}
		return ids, nil
	}
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, orphans: orphans})
	ctx := testCtx(t)
	for _, id := range []string{JobObjectID("gone", "latent"), JobObjectID("live", "latent")} {
		job, _, _ := strings.Cut(id, ".")
		if _, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: id, Mode: Pinned, Job: job}, pattern(objSize, 80)); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	orphaned["gone"] = true
	mu.Unlock()
	c.kick()
	eventually(t, 10*time.Second, "orphan collected", func() error {
		_, err := c.nodes[1].s.Lookup(ctx, "gone.latent")
		if !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("lookup: %v", err)
		}
		return nil
	})
	collector := rank(c.members(), collectorKey)[0].Node
	wantStats(t, c.node(collector), "collection counted", func(ls LocalStats) bool { return ls.Collected == 1 && ls.Lost == 0 })
	for _, n := range c.nodes {
		if ls := n.s.LocalStats(); n.name != collector && ls.Collected != 0 {
			t.Errorf("%s collected %d, but %s is the collector", n.name, ls.Collected, collector)
		}
	}
	if _, err := c.nodes[1].s.Lookup(ctx, "live.latent"); err != nil {
		t.Errorf("a live job's object went too: %v", err)
	}
	// The collector asks about what its index holds, which the watch
	// brings up to date a moment after each put: a pass may run before.
	eventually(t, 5*time.Second, "orphans asked about live.latent", func() error {
		mu.Lock()
		defer mu.Unlock()
		if !slices.Contains(seen, "live.latent") {
			c.kick()
			return fmt.Errorf("asked about %v", seen)
		}
		return nil
	})
	eventually(t, 5*time.Second, "orphan's copies freed", func() error {
		var held int64
		for _, n := range c.nodes {
			held += n.s.LocalStats().MemoryUsed
		}
		if held != 2*objSize {
			return fmt.Errorf("%d bytes held", held)
		}
		return nil
	})
}

func TestCloseIdempotentAndRefuses(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20})
	ctx := testCtx(t)
	n := c.nodes[1]
	if _, err := n.s.PutBytes(ctx, PutSpec{ID: "before", Mode: Pinned}, pattern(objSize, 90)); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	delete(c.live, n.name)
	c.mu.Unlock()
	n.s.Close()
	n.s.Close()
	if ls := n.s.LocalStats(); ls.Copies != 0 || ls.MemoryUsed != 0 {
		t.Errorf("closed store holds %+v", ls)
	}
	if held, _ := n.x.Held(); held != 0 {
		t.Errorf("closed store left %d payloads in its service", held)
	}
	if _, err := n.s.stageLocal(ctx, "after", Pinned, source{}, false); !errors.Is(err, ErrClosed) {
		t.Errorf("stage on a closed store = %v, want ErrClosed", err)
	}
	n.x.Close()
	n.h.Close()
}

func TestNewValidatesConfig(t *testing.T) {
	base := DefaultConfig()
	base.Node = "n"
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"NoNode", func(c *Config) { c.Node = "" }},
		{"SlashInNode", func(c *Config) { c.Node = "a/b" }},
		{"NegativeEntryTTL", func(c *Config) { c.EntryTTL = -1 }},
		{"RelativePrefix", func(c *Config) { c.Prefix = "x" }},
		{"NegativeMemory", func(c *Config) { c.MemoryCapacity = -1 }},
		{"SpillWithoutDir", func(c *Config) { c.SpillCapacity = 1 }},
		{"ZeroReplicas", func(c *Config) { c.Replicas = 0 }},
		{"NineReplicas", func(c *Config) { c.Replicas = 9 }},
		{"NoStageTimeout", func(c *Config) { c.StageTimeout = 0 }},
		{"SmallFrame", func(c *Config) { c.MaxFrame = 100 }},
		{"NegativeInline", func(c *Config) { c.InlineMax = -1 }},
		{"InlineOverBound", func(c *Config) { c.InlineMax, c.MaxFrame = maxInline+1, 2*maxInline }},
		{"FrameTooSmallForInline", func(c *Config) { c.MaxFrame = c.InlineMax + requestRoom - 1 }},
		{"NoOrphanBatch", func(c *Config) { c.OrphanBatch = 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			tc.mod(&cfg)
			if _, err := cfg.validate(); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	if _, err := base.validate(); err != nil {
		t.Fatalf("DefaultConfig with a Node: %v", err)
	}
	noInline := base
	noInline.InlineMax, noInline.MaxFrame = 0, 16<<10
	if _, err := noInline.validate(); err != nil {
		t.Fatalf("InlineMax 0 with the old 16 KiB frame: %v", err)
	}
}

func TestValidID(t *testing.T) {
	for id, want := range map[string]bool{
		"job-1.latent": true, "a": true, "A_b-c.9": true, strings.Repeat("x", MaxIDLen): true,
		"": false, ".": false, "..": false, "a/b": false, "a b": false, "é": false,
		strings.Repeat("x", MaxIDLen+1): false, "../etc": false,
	} {
		if got := ValidID(id); got != want {
			t.Errorf("ValidID(%q) = %v, want %v", id, got, want)
		}
	}
}

func TestPlacementIsStable(t *testing.T) {
	ms := []Member{{Node: "a", Free: 10}, {Node: "b", Free: 10}, {Node: "c", Free: 1}, {Node: "d", Free: 10}}
	got := place(ms, "obj", 5, map[string]bool{"d": true})
	if len(got) != 2 || slices.ContainsFunc(got, func(m Member) bool { return m.Node == "c" || m.Node == "d" }) {
		t.Fatalf("place = %v", got)
	}
	// Every node computes the same order, whatever order it lists members in.
	rev := slices.Clone(ms)
	slices.Reverse(rev)
	a, b := rank(ms, "obj"), rank(rev, "obj")
	for i := range a {
		if a[i].Node != b[i].Node {
			t.Fatalf("rank differs with member order: %v vs %v", a, b)
		}
	}
}

// etcd restarts lease countdowns on a leader change, so the collector also
// deletes records whose recorded retention (plus ExpiryGrace) has passed.
func TestExpiredRecordCollected(t *testing.T) {
	var skew atomic.Int64
	now := func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: func(cfg *Config) {
		cfg.Now = now
		cfg.ExpiryGrace = time.Minute
	}})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "old", Mode: Pinned, TTL: time.Hour}, pattern(objSize, 95))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "forever", Mode: Pinned}, pattern(objSize, 96)); err != nil {
		t.Fatal(err)
	}
	// The clock jumps past StageTimeout too: every copy must have seen its
	// record first, or a pass would drop it as a put that never committed.
	for _, n := range c.nodes {
		wantStats(t, n, "both copies committed", func(ls LocalStats) bool { return ls.Copies == 2 && ls.Staged == 0 })
	}
	skew.Store(int64(rec.ExpiresAt.Sub(time.Now()) + 30*time.Second)) // past retention, within grace
	for range 2 {
		for _, n := range c.nodes {
			n.s.maintain(ctx)
		}
	}
	if _, err := c.nodes[1].s.Lookup(ctx, "old"); err != nil {
		t.Fatalf("collected within ExpiryGrace: %v", err)
	}
	skew.Store(int64(rec.ExpiresAt.Sub(time.Now()) + 2*time.Minute))
	c.kick()
	eventually(t, 10*time.Second, "expired record collected", func() error {
		if _, err := c.nodes[1].s.Lookup(ctx, "old"); !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("lookup: %v", err)
		}
		return nil
	})
	if _, err := c.nodes[1].s.Lookup(ctx, "forever"); err != nil {
		t.Errorf("a record without retention went too: %v", err)
	}
}

// A record forged in etcd cannot point a reader at a peer of its choosing:
// Nearest (and so Fetch) leaves out holders Config.VerifyHolder refuses,
// never this node's own copy.
func TestNearestSkipsUnverifiedHolders(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 4 << 20})
	s := c.nodes[0].s
	s.cfg.VerifyHolder = func(node, peerID string) bool { return node == "b" && peerID == "peer-b" }
	holder := func(node, peerID string) Holder {
		return Holder{Node: node, Ref: transfer.Ref{ID: "x", Producer: transfer.Producer{PeerID: peerID}}}
	}
	rec := Record{ID: "obj", Holders: []Holder{
		holder("b", "peer-evil"), holder("evil", "peer-evil"), holder("b", "peer-b"), holder(s.cfg.Node, "whatever"),
	}}
	got := s.Nearest(rec)
	if len(got) != 2 || got[0].Node != s.cfg.Node || got[1].Ref.Producer.PeerID != "peer-b" {
		t.Fatalf("Nearest = %+v, want this node's copy and b's registered one", got)
	}
}

// A holder that gossip no longer shows but etcd still registers (a stale
// view after a partition) does not make its objects lost: the collector
// deletes them only once etcd has had no registration for any holder for
// LostGrace (a partitioned or paused holder loses its registration but
// keeps its copy, and comes back).
func TestLostNeedsEtcdToAgree(t *testing.T) {
	var mu sync.Mutex
	gone := map[string]bool{} // deregistered in "etcd"
	registered := func(context.Context) (map[string]bool, error) {
		mu.Lock()
		defer mu.Unlock()
		m := map[string]bool{}
		for _, n := range []string{"n0", "n1", "n2"} {
			if !gone[n] {
				m[n] = true
			}
		}
		return m, nil
	}
	const grace = 3 * time.Second
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: func(cfg *Config) {
		cfg.Registered, cfg.LostGrace = registered, grace
	}})
	ctx := testCtx(t)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "single", Mode: Pinned, Replicas: 1}, pattern(objSize, 42))
	if err != nil {
		t.Fatal(err)
	}
	holder := rec.Holders[0].Node
	c.kill(holder) // gone from every member list, still registered
	survivor := c.alive()[0]
	// Negative check: several maintenance passes (300 ms apart) leave it.
	for range 5 {
		c.kick()
		time.Sleep(400 * time.Millisecond)
	}
	if _, err := survivor.s.Lookup(ctx, rec.ID); err != nil {
		t.Fatalf("collected while etcd still registers its holder %s: %v", holder, err)
	}
	mu.Lock()
	gone[holder] = true
	mu.Unlock()
	deregistered := time.Now()
	// Deregistered for less than the grace: the record stays.
	for range 3 {
		c.kick()
		time.Sleep(400 * time.Millisecond)
	}
	if _, err := survivor.s.Lookup(ctx, rec.ID); err != nil && time.Since(deregistered) < grace {
		t.Fatalf("collected %v after etcd dropped its holder, before the %v grace: %v", time.Since(deregistered), grace, err)
	}
	eventually(t, 10*time.Second, "lost record collected once etcd agrees", func() error {
		c.kick()
		if _, err := survivor.s.Lookup(ctx, rec.ID); !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("lookup: %v", err)
		}
		return nil
	})
}

// killFirstHolder waits for rec's copies to be committed, kills its first
// holder and returns the record once repair has named two distinct live
// holders again.
func (c *cluster) killFirstHolder(t *testing.T, ctx context.Context, rec Record) Record {
	t.Helper()
	for _, h := range rec.Holders {
		wantStats(t, c.node(h.Node), "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
	}
	dead := rec.Holders[0].Node
	c.kill(dead)
	c.kick()
	var now Record
	eventually(t, 10*time.Second, "two live holders again", func() error {
		r, err := c.alive()[0].s.Lookup(ctx, rec.ID)
		if err != nil {
			return err
		}
		now = r
		hs := holderNodes(r)
		if len(hs) != 2 || slices.Contains(hs, dead) || hs[0] == hs[1] {
			return fmt.Errorf("holders %v", hs)
		}
		return nil
	})
	return now
}
