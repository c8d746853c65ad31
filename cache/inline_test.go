package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/zeebo/xxh3"

	"github.com/latentmesh/latentmesh/transfer"
)

// storePulls counts the pulls n made for the Store, by any transport.
func storePulls(n *node) int64 {
	var sum int64
	for _, v := range n.x.Stats().StorePulls {
		sum += v
	}
	return sum
}

// member is node name as c's members list it.
func (c *cluster) member(name string) Member {
	c.t.Helper()
	for _, m := range c.members() {
		if m.Node == name {
			return m
		}
	}
	c.t.Fatalf("no member %q", name)
	return Member{}
}

// remoteHolders lists the nodes other than putter that hold rec.
func remoteHolders(c *cluster, rec Record, putter string) []*node {
	var out []*node
	for _, h := range rec.Holders {
		if h.Node != putter {
			out = append(out, c.node(h.Node))
		}
	}
	return out
}

// An object of at most InlineMax bytes travels inside the store request:
// it lands on R holders, in memory or spilled, without a pull, carrying
// the XXH3 the holders checked it against, and reads back byte-identical
// from every node. A payload published without a checksum (Begin) gets
// one computed by the putter.
func TestInlinePut(t *testing.T) {
	const size = 4 << 10
	for _, tc := range []struct {
		name      string
		mem, disk int64
		tier      Tier
		chunked   bool // the source is published with Begin, in chunks
	}{
		{"Memory", 1 << 20, 0, Memory, false},
		{"Spill", 0, 1 << 20, Disk, false},
		{"Chunked", 1 << 20, 0, Memory, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: tc.mem, disk: tc.disk})
			ctx := testCtx(t)
			putter := c.nodes[0]
			data := pattern(size, 80)
			var rec Record
			var err error
			if tc.chunked {
				p, ref, berr := putter.x.Begin(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{size}, NumChunks: 4})
				if berr != nil {
					t.Fatal(berr)
				}
				copy(p.Buf(), data)
				for k := range 4 {
					if err := p.ChunkReady(k); err != nil {
						t.Fatal(err)
					}
				}
				p.Done()
				if ref.Checksum != 0 {
					t.Fatalf("a Begin payload carries checksum %x", ref.Checksum)
				}
				rec, err = putter.s.Put(ctx, PutSpec{ID: "job-1.latent", Mode: Consume}, ref)
				putter.x.Release(ref.ID)
			} else {
				rec, err = putter.s.PutBytes(ctx, PutSpec{ID: "job-1.png", Mode: Pinned, ContentType: "image/png"}, data)
			}
			if err != nil {
				t.Fatal(err)
			}
			if rec.Size != size || rec.Checksum != xxh3.Hash(data) {
				t.Fatalf("record size %d xxh3 %x, want %d %x", rec.Size, rec.Checksum, size, xxh3.Hash(data))
			}
			if hs := holderNodes(rec); len(hs) != 2 || hs[0] == hs[1] {
				t.Fatalf("holders %v, want 2 distinct", hs)
			}
			for _, h := range rec.Holders {
				if h.Tier != tc.tier || h.Ref.Checksum != rec.Checksum {
					t.Errorf("holder %s: tier %s xxh3 %x, want %s %x", h.Node, h.Tier, h.Ref.Checksum, tc.tier, rec.Checksum)
				}
			}
			remote := remoteHolders(c, rec, putter.name)
			if len(remote) == 0 {
				t.Fatalf("holders %v: no remote one", holderNodes(rec))
			}
			for _, n := range remote {
				if p := storePulls(n); p != 0 {
					t.Errorf("%s made %d store pulls for an inline copy", n.name, p)
				}
			}
			for _, n := range c.nodes {
				got, _, err := n.s.ReadAll(ctx, rec.ID)
				if err != nil {
					t.Fatalf("%s: read: %v", n.name, err)
				}
				if !bytes.Equal(got, data) {
					t.Fatalf("%s: read bytes differ", n.name)
				}
			}
		})
	}
}

// InlineMax decides: an object of exactly InlineMax bytes goes inline, a
// byte more is pulled by each remote holder, and InlineMax 0 pulls all.
func TestInlineMaxDecides(t *testing.T) {
	const max = 8 << 10
	for _, tc := range []struct {
		name      string
		inlineMax int
		size      int
		pulled    bool
	}{
		{"AtMax", max, max, false},
		{"OverMax", max, max + 1, true},
		{"Off", 0, 64, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: 1 << 20, tune: func(cfg *Config) { cfg.InlineMax = tc.inlineMax }})
			ctx := testCtx(t)
			data := pattern(tc.size, 81)
			rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "obj", Mode: Pinned}, data)
			if err != nil {
				t.Fatal(err)
			}
			for _, n := range remoteHolders(c, rec, c.nodes[0].name) {
				if p := storePulls(n); (p > 0) != tc.pulled {
					t.Errorf("%s made %d store pulls; pulled = %v, want %v", n.name, p, p > 0, tc.pulled)
				}
				got, _, err := n.s.ReadAll(ctx, rec.ID)
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("%s: read: %v", n.name, err)
				}
			}
		})
	}
}

// A holder refuses an inline request whose bytes do not match the size or
// the checksum it declares, and stages nothing: no copy, no room taken, no
// payload published, no pull made instead.
func TestInlineMismatchRefused(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 1 << 20})
	ctx := testCtx(t)
	putter, holder := c.nodes[0], c.nodes[1]
	data := pattern(4096, 82)
	ref, err := putter.x.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(len(data))}}, data)
	if err != nil {
		t.Fatal(err)
	}
	defer putter.x.Release(ref.ID)
	flipped := bytes.Clone(data)
	flipped[1000] ^= 0x10
	for _, tc := range []struct {
		name string
		mod  func(*request)
		want error
	}{
		{"Checksum", func(r *request) { r.Data = flipped }, transfer.ErrCorrupt},
		{"DeclaredChecksum", func(r *request) { r.Src.Checksum++ }, transfer.ErrCorrupt},
		{"Size", func(r *request) { r.Data = data[:len(data)-1] }, ErrProtocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := request{V: inlineVersion, Op: opStage, Object: "bad-" + tc.name, Mode: Pinned, Src: ref, Data: data}
			tc.mod(&req)
			if _, err := putter.s.call(ctx, c.member(holder.name), &req); !errors.Is(err, tc.want) {
				t.Fatalf("call = %v, want %v", err, tc.want)
			}
			if ls := holder.s.LocalStats(); ls.Copies != 0 || ls.MemoryUsed != 0 {
				t.Errorf("a refused inline request left %+v", ls)
			}
			if held, _ := holder.x.Held(); held != 0 {
				t.Errorf("holder publishes %d payloads after a refused request", held)
			}
			if p := storePulls(holder); p != 0 {
				t.Errorf("holder made %d store pulls for a refused request", p)
			}
		})
	}
}

// oldBuild serves the store protocol as a version-1 build did: a frame of
// at most 16 KiB, version 1 only, no Data.
func oldBuild(s *Store) network.StreamHandler { return buildOf(s, baseVersion, 16<<10) }

// A holder that refuses an inline request as malformed, being of an older
// build or reading smaller frames, is asked again to pull, and the put
// lands on it all the same.
func TestInlineRefusedFallsBackToPull(t *testing.T) {
	for _, tc := range []struct {
		name  string
		tune  func(*Config)
		setup func(*cluster)
		size  int
	}{
		{"OldBuild", nil, func(c *cluster) { c.node("n1").h.SetStreamHandler(ProtocolID, oldBuild(c.node("n1").s)) }, 4 << 10},
		{"OldBuildFrameOverItsBound", nil, func(c *cluster) { c.node("n1").h.SetStreamHandler(ProtocolID, oldBuild(c.node("n1").s)) }, 32 << 10},
		{"SmallFrame", func(cfg *Config) {
			if cfg.Node == "n1" {
				cfg.InlineMax, cfg.MaxFrame = 0, 2048
			}
		}, nil, 4 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 2, mem: 1 << 20, tune: tc.tune})
			if tc.setup != nil {
				tc.setup(c)
			}
			ctx := testCtx(t)
			data := pattern(tc.size, 83)
			rec, err := c.node("n0").s.PutBytes(ctx, PutSpec{ID: "mixed", Mode: Pinned}, data)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Contains(holderNodes(rec), "n1") {
				t.Fatalf("holders %v, want n1 among them", holderNodes(rec))
			}
			old := c.node("n1")
			if p := storePulls(old); p == 0 {
				t.Error("n1 holds a copy without having pulled it")
			}
			got, _, err := old.s.ReadAll(ctx, rec.ID)
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("n1: read: %v", err)
			}
		})
	}
}

// A small object is re-replicated inline by its surviving holder, from a
// copy in memory or spilled to disk.
func TestInlineRepair(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mem, disk int64
	}{
		{"Memory", 1 << 20, 0},
		{"Spill", 0, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: tc.mem, disk: tc.disk})
			ctx := testCtx(t)
			data := pattern(4<<10, 84)
			rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "small", Mode: Consume}, data)
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range rec.Holders { // committed before the pulls are counted
				wantStats(t, c.node(h.Node), "committed", func(ls LocalStats) bool { return ls.Copies == 1 && ls.Staged == 0 })
			}
			pullsBefore := map[string]int64{}
			for _, n := range c.nodes {
				pullsBefore[n.name] = storePulls(n)
			}
			now := c.killFirstHolder(t, ctx, rec)
			for _, h := range now.Holders {
				if slices.Contains(holderNodes(rec), h.Node) {
					continue
				}
				n := c.node(h.Node)
				if p := storePulls(n) - pullsBefore[n.name]; p != 0 {
					t.Errorf("new holder %s made %d store pulls for an inline repair", n.name, p)
				}
				got, _, err := n.s.ReadAll(ctx, rec.ID)
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("%s: read after repair: %v", n.name, err)
				}
			}
		})
	}
}

// BenchmarkStagePut stages an object with R=2 on a three-node mesh, the
// put of a decode's result, once with every remote copy pulled (InlineMax
// 0) and once inline. Only Stage is timed; the copies are dropped (Abort)
// with the timer stopped. Placement varies with the object id, so the
// putter holds one of the two copies of some objects and none of others,
// alike in both modes.
//
//	go test -run '^$' -bench BenchmarkStagePut -benchtime 3000x ./cache/
func BenchmarkStagePut(b *testing.B) {
	for _, size := range []int{4 << 10, 64 << 10} {
		for _, mode := range []struct {
			name      string
			inlineMax int
		}{{"pull", 0}, {"inline", 64 << 10}} {
			b.Run(fmt.Sprintf("%dKiB/%s", size>>10, mode.name), func(b *testing.B) {
				c := newCluster(b, clusterConfig{nodes: 3, mem: 64 << 20, tune: func(cfg *Config) { cfg.InlineMax = mode.inlineMax }})
				ctx := context.Background()
				putter := c.nodes[0]
				data := pattern(size, 90)
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for i := 0; b.Loop(); i++ {
					st, err := putter.s.StageBytes(ctx, PutSpec{ID: fmt.Sprintf("bench-%d", i%64), Mode: Pinned}, data)
					if err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					st.Abort(ctx)
					b.StartTimer()
				}
			})
		}
	}
}
