package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/latentmesh/latentmesh/transfer"
)

// noRoomOn gives node name no Store room, so it puts without holding.
func noRoomOn(name string) func(*Config) {
	return func(c *Config) {
		if c.Node == name {
			c.MemoryCapacity = 0
		}
	}
}

// fetchFrom reads rec's bytes from holder h alone, on n.
func fetchFrom(ctx context.Context, n *node, rec Record, h Holder) ([]byte, error) {
	one := rec
	one.Holders = []Holder{h}
	buf := make([]byte, rec.Size)
	return buf, n.s.Fetch(ctx, one, buf)
}

// fillPending writes data into p chunk by chunk and marks each ready.
func fillPending(t *testing.T, p *transfer.Pending, meta transfer.TensorMeta, data []byte) {
	t.Helper()
	for k := range meta.Chunks() {
		off, n := meta.ChunkRange(k)
		copy(p.Buf()[off:off+n], data[off:off+n])
		if err := p.ChunkReady(k); err != nil {
			t.Fatal(err)
		}
	}
}

// A chained put sends the source once, whatever R: the first holder pulls
// it, each next holder pulls the holder before it. With FirstCopy the put
// is done at the first copy (FirstCopied), and the source may go then:
// the chain completes from the holders. The record, written once, names
// every copy and carries the source's checksum, and each copy reads back
// whole; over tcp each read is checked against the block checksums the
// source was published with, which every copy in flight serves on as its
// pull verified them.
func TestChainedPutSendsSourceOnce(t *testing.T) {
	for _, tc := range []struct {
		name      string
		meta      transfer.TensorMeta
		transport string
	}{
		{"OneChunk", transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}, transfer.TransportAuto},
		{"FourChunks", transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4, 256 << 10}, NumChunks: 4}, transfer.TransportAuto},
		{"FourChunksTCP", transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4, 256 << 10}, NumChunks: 4}, transfer.TransportTCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 4, mem: 4 << 20, tune: noRoomOn("n0"),
				xtune: func(x *transfer.Config) { x.Transport = tc.transport }})
			ctx := testCtx(t)
			p := c.nodes[0]
			data := pattern(int(tc.meta.Bytes()), 7)
			// In the arena, so that a pull is one ticket (shm), not one
			// refused over shm and a second over tcp.
			buf, err := p.x.Alloc(tc.meta.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			copy(buf.Bytes(), data)
			src, err := p.x.Publish(tc.meta, buf.Bytes())
			buf.Release()
			if err != nil {
				t.Fatal(err)
			}
			var tickets atomic.Int64
			p.x.OnTicket(func(id string) {
				if id == src.ID {
					tickets.Add(1)
				}
			})
			st, err := p.s.Stage(ctx, PutSpec{ID: "job-1.ckpt", Mode: TTL, TTL: time.Minute, Replicas: 3, FirstCopy: true}, src)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := st.FirstCopied(ctx); err != nil {
				t.Fatal(err)
			}
			p.x.Release(src.ID) // the chain needs the source no more
			if n := len(st.Record.Holders); n != 3 {
				t.Fatalf("record names %d holders, want 3", n)
			}
			if st.Record.Checksum != src.Checksum || src.Checksum == 0 {
				t.Fatalf("record checksum %x, want the source's %x", st.Record.Checksum, src.Checksum)
			}
			if r := st.Replication(); r.Complete < 1 || r.Wanted != 3 {
				t.Fatalf("once the first copy is done: %+v, want a complete copy of 3", r)
			}
			r, err := st.WaitReplicated(ctx)
			if err != nil || r.Complete != 3 || r.AllCopies < r.FirstCopy {
				t.Fatalf("replication %+v (%v), want 3 complete copies", r, err)
			}
			if n := tickets.Load(); n != 1 {
				t.Errorf("the source was pulled %d times, want once", n)
			}
			rec, err := p.s.Lookup(ctx, st.Record.ID)
			if err != nil {
				t.Fatal(err)
			}
			for _, h := range rec.Holders {
				got, err := fetchFrom(ctx, p, rec, h)
				if err != nil || !bytes.Equal(got, data) {
					t.Errorf("copy on %s: %v (bytes equal %v)", h.Node, err, bytes.Equal(got, data))
				}
			}
		})
	}
}

// Without FirstCopy a chained put returns once every copy is complete.
func TestChainedPutWaitsForEveryCopy(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: noRoomOn("n0")})
	ctx := testCtx(t)
	p := c.nodes[0]
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4, 256 << 10}, NumChunks: 4}
	data := pattern(int(meta.Bytes()), 8)
	src, err := p.x.Publish(meta, data)
	if err != nil {
		t.Fatal(err)
	}
	st, err := p.s.Stage(ctx, PutSpec{ID: "job-1.latent", Mode: Consume}, src)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-st.Replicated():
	default:
		t.Fatal("Stage returned before every copy was complete")
	}
	if r := st.Replication(); r.Complete != 2 || r.Err != nil {
		t.Fatalf("replication %+v, want 2 complete copies", r)
	}
	p.x.Release(src.ID)
	for _, h := range st.Record.Holders {
		n := c.node(h.Node)
		if f, held := n.s.hold.filling(st.Record.ID, h.Ref.ID); !held || (f != nil && !isClosed(f.done)) {
			t.Errorf("%s: copy held %v, still filling", h.Node, held)
		}
	}
	st.Abort(ctx)
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// A reader that reaches a copy in flight waits for its chunks; when that
// copy's fill fails, the holder drops it, the reader's wait ends, and it
// reads the next holder.
func TestReaderOfCopyInFlight(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20})
	ctx := testCtx(t)
	reader, early, whole := c.nodes[0], c.nodes[1], c.nodes[2]
	// The reader dials the holder while the holder dials it for the
	// source: connect first, so the two dials do not meet (libp2p's
	// simultaneous open may then fail one of them).
	for _, n := range []*node{early, whole} {
		if err := reader.h.Connect(ctx, peer.AddrInfo{ID: n.h.ID(), Addrs: n.h.Addrs()}); err != nil {
			t.Fatal(err)
		}
	}
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4, 64 << 10}, NumChunks: 4}
	data := pattern(int(meta.Bytes()), 9)

	t.Run("Waits", func(t *testing.T) {
		p, src, err := reader.x.Begin(meta)
		if err != nil {
			t.Fatal(err)
		}
		h, err := early.s.stageEarly(ctx, "obj-wait", TTL, []transfer.Ref{src}, nil, false)
		if err != nil {
			t.Fatal(err)
		}
		rec := Record{ID: "obj-wait", Size: meta.Bytes(), Meta: meta, Holders: []Holder{h}}
		type result struct {
			b   []byte
			err error
		}
		done := make(chan result, 1)
		go func() {
			b, err := fetchFrom(ctx, reader, rec, h)
			done <- result{b, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("Fetch of a copy none of whose chunks landed returned: %v", r.err)
		case <-time.After(50 * time.Millisecond):
		}
		fillPending(t, p, meta, data)
		r := <-done
		if r.err != nil || !bytes.Equal(r.b, data) {
			t.Fatalf("Fetch: %v (bytes equal %v)", r.err, bytes.Equal(r.b, data))
		}
		if err := reader.s.waitOn(ctx, h, rec.ID, false); err != nil {
			t.Fatalf("wait for the complete copy: %v", err)
		}
		reader.x.Release(src.ID)
	})

	t.Run("FallsBack", func(t *testing.T) {
		p, src, err := reader.x.Begin(meta)
		if err != nil {
			t.Fatal(err)
		}
		h1, err := early.s.stageEarly(ctx, "obj-fail", TTL, []transfer.Ref{src}, nil, false)
		if err != nil {
			t.Fatal(err)
		}
		full, err := reader.x.Publish(meta, data)
		if err != nil {
			t.Fatal(err)
		}
		defer reader.x.Release(full.ID)
		h2, err := whole.s.stageLocal(ctx, "obj-fail", TTL, source{ref: full}, false)
		if err != nil {
			t.Fatal(err)
		}
		rec := Record{ID: "obj-fail", Size: meta.Bytes(), Meta: meta, Holders: []Holder{h1, h2}}
		if got := reader.s.Nearest(rec); got[0].Node != early.name {
			t.Fatalf("nearest holder %s, want the copy in flight on %s first", got[0].Node, early.name)
		}
		done := make(chan error, 1)
		buf := make([]byte, meta.Bytes())
		go func() { done <- reader.s.Fetch(ctx, rec, buf) }()
		// The source goes before any chunk landed: the fill has nothing to
		// fall back on and fails.
		reader.x.Release(src.ID)
		p.Done()
		if err := <-done; err != nil || !bytes.Equal(buf, data) {
			t.Fatalf("Fetch: %v (bytes equal %v)", err, bytes.Equal(buf, data))
		}
		if err := reader.s.waitOn(ctx, h1, rec.ID, false); err == nil {
			t.Fatal("the failed copy in flight reported complete")
		}
		if cs := early.s.hold.copiesOf(rec.ID); len(cs) != 0 {
			t.Fatalf("%s still holds %d copies of the failed fill", early.name, len(cs))
		}
	})
}

// A holder that fails in the middle of a chain: the next holder falls
// back to an earlier holder, the put still returns at its first copy,
// Replicated reports the copy lost, and repair restores R.
func TestChainHolderFailsMidChain(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 5, mem: 4 << 20, tune: noRoomOn("n0")})
	ctx := testCtx(t)
	p := c.nodes[0]
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{4, 256 << 10}, NumChunks: 4}
	data := pattern(int(meta.Bytes()), 10)
	pend, src, err := p.x.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	const id = "job-1.ckpt-30"
	order := place(c.members(), id, meta.Bytes(), nil)
	if len(order) < 4 || order[0].Node == p.name {
		t.Fatalf("placement %v", order)
	}
	type staged struct {
		st  *Staged
		err error
	}
	done := make(chan staged, 1)
	go func() {
		st, err := p.s.Stage(ctx, PutSpec{ID: id, Mode: TTL, TTL: time.Minute, Replicas: 3, FirstCopy: true}, src)
		done <- staged{st, err}
	}()
	// Every copy of a multi-chunk chain is staged in flight before a chunk
	// of the source exists; then the middle one dies.
	eventually(t, 10*time.Second, "three copies in flight", func() error {
		for _, m := range order[:3] {
			if len(c.node(m.Node).s.hold.copiesOf(id)) == 0 {
				return fmt.Errorf("%s has no copy yet", m.Node)
			}
		}
		return nil
	})
	mid := order[1].Node
	c.kill(mid)
	fillPending(t, pend, meta, data)
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	st := r.st
	if err := st.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := st.FirstCopied(ctx); err != nil {
		t.Fatal(err)
	}
	p.x.Release(src.ID)
	rep, err := st.WaitReplicated(ctx)
	if err == nil || rep.Complete != 2 {
		t.Fatalf("replication %+v (%v), want 2 complete and the dead holder's failure", rep, err)
	}
	last := st.Record.Holders[2]
	if last.Node != order[2].Node {
		t.Fatalf("third copy on %s, want %s", last.Node, order[2].Node)
	}
	if got, err := fetchFrom(ctx, p, st.Record, last); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the copy after the dead holder: %v (bytes equal %v)", err, bytes.Equal(got, data))
	}
	// The dead holder stays named until a new copy takes its place.
	c.kick()
	eventually(t, 15*time.Second, "R restored", func() error {
		rec, err := p.s.Lookup(ctx, id)
		if err != nil {
			return err
		}
		alive := 0
		for _, h := range rec.Holders {
			if h.Node == mid {
				return fmt.Errorf("still names %s", mid)
			}
			if got, err := fetchFrom(ctx, p, rec, h); err != nil || !bytes.Equal(got, data) {
				return fmt.Errorf("copy on %s: %v", h.Node, errors.Join(err))
			}
			alive++
		}
		if alive != 3 {
			return fmt.Errorf("%d live copies", alive)
		}
		return nil
	})
}

// buildOf serves the store protocol as a build that speaks versions up to
// v did, reading frames of at most maxFrame: a newer request is refused
// as bad.
func buildOf(s *Store, v, maxFrame int) network.StreamHandler {
	return func(str network.Stream) {
		defer str.Close()
		var req request
		err := transfer.ReadFrame(str, maxFrame, &req)
		if err == nil && req.V > v {
			err = fmt.Errorf("%w: request v%d", transfer.ErrVersion, req.V)
		}
		if err != nil {
			transfer.WriteFrame(str, &response{V: baseVersion, ErrCode: codeBad, ErrMsg: err.Error()})
			return
		}
		r := s.serve(str.Conn().RemotePeer(), &req)
		r.V = baseVersion
		transfer.WriteFrame(str, &r)
	}
}

// A putter's stage request to the first holder of a chain carries a
// ticket for the putter's own payload, so that holder's pull asks for
// none, whether it copies whole or in flight (several chunks); a holder of
// a build before issued tickets is asked again without one and copies all
// the same, and one before deferred fills is asked again to fill at once.
func TestChainIssuesTheSourceTicket(t *testing.T) {
	for _, tc := range []struct {
		name      string
		transport string
		chunks    int
		build     int // the holders' build speaks up to this version; 0: this one
	}{
		{"Shm", transfer.TransportAuto, 1, 0},
		{"TCP", transfer.TransportTCP, 1, 0},
		{"InFlightShm", transfer.TransportAuto, 4, 0},
		{"InFlightTCP", transfer.TransportTCP, 4, 0},
		{"HoldersBeforeTickets", transfer.TransportAuto, 1, chainVersion},
		{"HoldersBeforeDeferral", transfer.TransportAuto, 1, issuedVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: noRoomOn("n0"),
				xtune: func(x *transfer.Config) { x.Transport = tc.transport }})
			if tc.build > 0 {
				for _, n := range c.nodes[1:] {
					n.h.SetStreamHandler(ProtocolID, buildOf(n.s, tc.build, n.s.cfg.MaxFrame))
				}
			}
			old := tc.build > 0 && tc.build < issuedVersion
			ctx := testCtx(t)
			p := c.nodes[0]
			meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(tc.chunks), 1 << 20}, NumChunks: tc.chunks}
			data := pattern(int(meta.Bytes()), 12)
			buf, err := p.x.Alloc(meta.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			copy(buf.Bytes(), data)
			src, err := p.x.Publish(meta, buf.Bytes())
			buf.Release()
			if err != nil {
				t.Fatal(err)
			}
			var asked atomic.Int64 // tickets issued for src, ahead or asked for
			p.x.OnTicket(func(id string) {
				if id == src.ID {
					asked.Add(1)
				}
			})
			st, err := p.s.Stage(ctx, PutSpec{ID: "job-1.ckpt", Mode: TTL, TTL: time.Minute, Replicas: 2, FirstCopy: true}, src)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := st.FirstCopied(ctx); err != nil {
				t.Fatal(err)
			}
			if r, err := st.WaitReplicated(ctx); err != nil || r.Complete != 2 || len(st.Record.Holders) != 2 {
				t.Fatalf("replication %+v (%v) of %d holders, want 2 complete copies", r, err, len(st.Record.Holders))
			}
			first := c.node(st.Record.Holders[0].Node)
			issued := first.x.Stats().IssuedPulls
			switch {
			case old && (issued != 0 || asked.Load() != 2):
				t.Errorf("old holder: %d issued pulls, %d tickets for the source; want 0 and 2 (issued, refused, then asked)", issued, asked.Load())
			case !old && (issued != 1 || asked.Load() != 1):
				t.Errorf("first holder: %d issued pulls, %d tickets for the source; want 1 and 1", issued, asked.Load())
			}
			for _, h := range st.Record.Holders {
				if got, err := fetchFrom(ctx, p, st.Record, h); err != nil || !bytes.Equal(got, data) {
					t.Errorf("copy on %s: %v (bytes equal %v)", h.Node, err, bytes.Equal(got, data))
				}
			}
		})
	}
}
