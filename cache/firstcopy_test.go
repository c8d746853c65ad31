package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// firstCopyPut stages, as a step checkpoint is, an object of meta from a
// source published with Begin on the cluster's n0, so that no copy can
// complete before the test fills the source. The put returns with every
// copy published in flight.
func firstCopyPut(t *testing.T, c *cluster, id string, meta transfer.TensorMeta, replicas int) (*Staged, *transfer.Pending, transfer.Ref) {
	t.Helper()
	p := c.nodes[0]
	pend, src, err := p.x.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	st, err := p.s.Stage(testCtx(t), PutSpec{ID: id, Mode: TTL, TTL: time.Minute, Replicas: replicas, FirstCopy: true}, src)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(st.Record.Holders); n != replicas {
		t.Fatalf("record names %d holders, want %d", n, replicas)
	}
	select {
	case <-st.repl.first:
		t.Fatal("the first copy ended before any byte of its source existed")
	default:
	}
	return st, pend, src
}

type fetched struct {
	b   []byte
	err error
}

// fetchAsync reads the record of id, as a reader starting from an object
// id does, and its bytes from the nearest holder.
func fetchAsync(ctx context.Context, n *node, id string) <-chan fetched {
	out := make(chan fetched, 1)
	go func() {
		b, _, err := n.s.ReadAll(ctx, id)
		out <- fetched{b, err}
	}()
	return out
}

// A FirstCopy put returns before its first copy's bytes land, and its
// record is committed while they do: a reader that finds the record
// meanwhile waits on the copy and gets the right bytes, the watch commits
// the copy in flight and maintenance passes leave it and the record
// alone, the second copy is published with its fill deferred until the
// putter has seen the first whole, and FirstCopied returns once it is.
func TestFirstCopyCommitsWhileItLands(t *testing.T) {
	for _, tc := range []struct{ name, transport string }{
		{"Shm", transfer.TransportAuto},
		{"TCP", transfer.TransportTCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: noRoomOn("n0"),
				xtune: func(x *transfer.Config) { x.Transport = tc.transport }})
			ctx := testCtx(t)
			p := c.nodes[0]
			meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}
			data := pattern(int(meta.Bytes()), 21)
			const id = "job-1.ckpt.000010"
			st, pend, src := firstCopyPut(t, c, id, meta, 2)
			defer p.x.Release(src.ID)
			if err := st.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			h1, h2 := st.Record.Holders[0], st.Record.Holders[1]
			first, second := c.node(h1.Node), c.node(h2.Node)
			rev := c.rawRecord(ctx, id).Kvs[0].ModRevision

			read := fetchAsync(ctx, p, id)
			done := make(chan error, 1)
			go func() { done <- st.FirstCopied(ctx) }()
			eventually(t, 5*time.Second, "the watch commits the copy in flight", func() error {
				for _, cp := range first.s.hold.copiesOf(id) {
					if cp.committed && cp.fill != nil {
						return nil
					}
				}
				return fmt.Errorf("%s: no committed copy in flight of %s", first.name, id)
			})
			c.kick()
			select {
			case r := <-read:
				t.Fatalf("a read returned before the copy's bytes existed: %v", r.err)
			case err := <-done:
				t.Fatalf("FirstCopied returned before the copy was whole: %v", err)
			case <-time.After(3 * c.nodes[1].s.cfg.MaintainEvery): // passes run meanwhile
			}
			if got := c.rawRecord(ctx, id); len(got.Kvs) != 1 || got.Kvs[0].ModRevision != rev {
				t.Fatal("maintenance rewrote or removed the record of a copy in flight")
			}
			if f, held := second.s.hold.filling(id, h2.Ref.ID); !held || f == nil || isClosed(f.done) || isClosed(f.start) {
				t.Fatalf("%s: second copy held %v, want it published with its fill deferred", second.name, held)
			}

			fillPending(t, pend, meta, data)
			if r := <-read; r.err != nil || !bytes.Equal(r.b, data) {
				t.Fatalf("read mid-copy: %v (bytes equal %v)", r.err, bytes.Equal(r.b, data))
			}
			if err := <-done; err != nil {
				t.Fatalf("FirstCopied: %v", err)
			}
			if r, err := st.WaitReplicated(ctx); err != nil || r.Complete != 2 || r.FirstCopy > r.AllCopies {
				t.Fatalf("replication %+v (%v), want 2 complete copies", r, err)
			}
			rec, err := p.s.Lookup(ctx, id)
			if err != nil || len(rec.Holders) != 2 {
				t.Fatalf("record %+v (%v), want both holders", rec, err)
			}
			for _, h := range rec.Holders {
				if got, err := fetchFrom(ctx, p, rec, h); err != nil || !bytes.Equal(got, data) {
					t.Errorf("copy on %s: %v (bytes equal %v)", h.Node, err, bytes.Equal(got, data))
				}
			}
		})
	}
}

// A first copy that fails after its record was committed fails the put:
// FirstCopied takes the record back, so none names a copy that never was,
// a reader waiting on the copy gets an error, never bytes, every copy is
// freed, and the checkpoint before (another object) is untouched.
func TestFirstCopyFailsAfterCommit(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(t *testing.T, pend *transfer.Pending, src transfer.Ref, p *node) context.Context
	}{
		{"SourceGone", func(t *testing.T, pend *transfer.Pending, src transfer.Ref, p *node) context.Context {
			p.x.Release(src.ID) // the putter lost its source before a byte was written
			pend.Done()
			return testCtx(t)
		}},
		{"WaitAbandoned", func(t *testing.T, pend *transfer.Pending, src transfer.Ref, p *node) context.Context {
			ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
			t.Cleanup(cancel)
			return ctx
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: noRoomOn("n0")})
			ctx := testCtx(t)
			p := c.nodes[0]
			meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}
			before := pattern(int(meta.Bytes()), 22)
			const prev, id = "job-1.ckpt.000010", "job-1.ckpt.000020"
			if _, err := p.s.PutBytes(ctx, PutSpec{ID: prev, Mode: TTL, TTL: time.Minute, Replicas: 2, FirstCopy: true}, before); err != nil {
				t.Fatal(err)
			}
			st, pend, src := firstCopyPut(t, c, id, meta, 2)
			defer p.x.Release(src.ID)
			if err := st.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			read := fetchAsync(ctx, p, id)
			wctx := tc.fail(t, pend, src, p)
			if err := st.FirstCopied(wctx); err == nil {
				t.Fatal("FirstCopied succeeded for a copy that never landed")
			}
			if got := c.rawRecord(ctx, id); len(got.Kvs) != 0 {
				t.Fatal("the record of a failed put still names its copies")
			}
			if tc.name == "WaitAbandoned" {
				fillPending(t, pend, meta, pattern(int(meta.Bytes()), 23)) // too late: nothing comes back
			}
			r := <-read
			if r.err == nil {
				t.Fatal("a reader of the failed put got bytes")
			}
			if !errors.Is(r.err, ErrNotFound) && !errors.Is(r.err, transfer.ErrNotFound) {
				t.Errorf("reader: %v, want not found", r.err)
			}
			eventually(t, 10*time.Second, "every copy of the failed put freed", func() error {
				for _, n := range c.nodes {
					if cs := n.s.hold.copiesOf(id); len(cs) != 0 {
						return fmt.Errorf("%s holds %d copies", n.name, len(cs))
					}
				}
				return nil
			})
			if got, _, err := p.s.ReadAll(ctx, prev); err != nil || !bytes.Equal(got, before) {
				t.Fatalf("the checkpoint before: %v (bytes equal %v)", err, bytes.Equal(got, before))
			}
		})
	}
}

// Repair reads a first copy still in flight as any reader does: a record
// whose second holder died while the first copy still fills is repaired
// from that copy, the new holder's pull waiting on its chunks, and ends
// naming two whole copies.
func TestRepairFromFirstCopyInFlight(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 4, mem: 4 << 20, tune: noRoomOn("n0")})
	ctx := testCtx(t)
	p := c.nodes[0]
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}
	data := pattern(int(meta.Bytes()), 24)
	const id = "job-1.ckpt.000030"
	st, pend, src := firstCopyPut(t, c, id, meta, 2)
	defer p.x.Release(src.ID)
	if err := st.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h1, dead := st.Record.Holders[0], st.Record.Holders[1].Node
	var spare *node
	for _, n := range c.nodes[1:] {
		if n.name != h1.Node && n.name != dead {
			spare = n
		}
	}
	c.kill(dead)
	c.kick()
	eventually(t, 10*time.Second, "a repair copy asked of "+spare.name, func() error {
		if spare.s.LocalStats().MemoryUsed == 0 {
			return fmt.Errorf("%s has reserved nothing", spare.name)
		}
		return nil
	})
	fillPending(t, pend, meta, data)
	if err := st.FirstCopied(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 15*time.Second, "repaired from the copy in flight", func() error {
		rec, err := p.s.Lookup(ctx, id)
		if err != nil {
			return err
		}
		if got := holderNodes(rec); len(got) != 2 || got[0] != h1.Node || got[1] != spare.name {
			return fmt.Errorf("holders %v, want [%s %s]", got, h1.Node, spare.name)
		}
		for _, h := range rec.Holders {
			if got, err := fetchFrom(ctx, p, rec, h); err != nil || !bytes.Equal(got, data) {
				return fmt.Errorf("copy on %s: %v (bytes equal %v)", h.Node, err, bytes.Equal(got, data))
			}
		}
		return nil
	})
}

// A copy staged with its fill deferred is published at once and fills
// when its putter asks (the fill op), when a reader asks for it (its
// ticket: the reader waits on the copy), or, if no one does (the putter
// is gone), once half its fill's time has passed.
func TestDeferredCopy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout time.Duration // RequestTimeout: a deferral lasts half
		ask     string
	}{
		// Asked: a deferral (1 min) outlasts the test's context (45 s), so
		// only the ask can have started the fill.
		{"AskedByPutter", 2 * time.Minute, "fill"},
		{"AskedByReader", 2 * time.Minute, "read"},
		{"NeverAsked", 2 * time.Second, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20, tune: func(c *Config) { c.RequestTimeout = tc.timeout }})
			ctx := testCtx(t)
			p, h := c.nodes[0], c.nodes[1]
			meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}
			data := pattern(int(meta.Bytes()), 25)
			src, err := p.x.Publish(meta, data)
			if err != nil {
				t.Fatal(err)
			}
			defer p.x.Release(src.ID)
			const id = "job-1.ckpt.000040"
			held, err := h.s.stageEarly(ctx, id, TTL, []transfer.Ref{src}, nil, true)
			if err != nil {
				t.Fatal(err)
			}
			f, ok := h.s.hold.filling(id, held.Ref.ID)
			if !ok || f == nil || isClosed(f.start) {
				t.Fatal("a deferred copy started filling before it was asked")
			}
			rec := Record{ID: id, Size: meta.Bytes(), Meta: meta, Holders: []Holder{held}}
			var got []byte
			switch tc.ask {
			case "fill":
				if err := p.s.waitOn(ctx, held, id, true); err != nil {
					t.Fatal(err)
				}
			case "read":
				if got, err = fetchFrom(ctx, p, rec, held); err != nil {
					t.Fatal(err)
				}
			default:
				if err := h.s.waitLocal(ctx, id, held.Ref.ID, false); err != nil {
					t.Fatalf("a deferred copy nobody asked for: %v", err)
				}
			}
			if got == nil {
				got, err = fetchFrom(ctx, p, rec, held)
			}
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("deferred copy: %v (bytes equal %v)", err, bytes.Equal(got, data))
			}
			h.s.dropStaged(id, held.Ref.ID)
		})
	}
}
