package transfer

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

	"github.com/libp2p/go-libp2p/core/peer"
)

// countRequests makes cfg's producer count the ticket requests it judges.
func countRequests(cfg *Config) *atomic.Int64 {
	var n atomic.Int64
	cfg.AuthorizePayload = func(context.Context, string, peer.ID, []byte) error {
		n.Add(1)
		return nil
	}
	return &n
}

// A consumer given the ticket its producer issued it ahead (Issue,
// WithIssued) pulls over shm and over tcp without asking for a ticket,
// and gets the producer's bytes.
func TestIssuedTicketSkipsTheRequest(t *testing.T) {
	dir := shmDir(t)
	for _, transport := range []string{TransportShm, TransportTCP} {
		pcfg := arenaConfig(t, dir, 16<<20)
		asked := countRequests(&pcfg)
		prod := startService(t, pcfg)
		ccfg := arenaConfig(t, dir, 16<<20)
		ccfg.Transport = transport
		cons := startService(t, ccfg)
		data := randBytes(300<<10, 3)
		ref := publishArena(t, prod, u8Meta(int64(len(data))), data)
		raw, err := prod.Issue(ref.ID, cons.self)
		if err != nil {
			t.Fatal(err)
		}
		dst := make([]byte, len(data))
		if err := cons.PullInto(WithIssued(testCtx(t), ref.ID, raw), ref, dst); err != nil || !bytes.Equal(dst, data) {
			t.Fatalf("%s: pull with an issued ticket: %v (bytes equal %v)", transport, err, bytes.Equal(dst, data))
		}
		if n := asked.Load(); n != 0 {
			t.Fatalf("%s: %d ticket requests, want none", transport, n)
		}
		if st := cons.Stats(); st.IssuedPulls != 1 || st.Pulls[transport] != 1 {
			t.Fatalf("%s: issued pulls %d, pulls %v", transport, st.IssuedPulls, st.Pulls)
		}
		// Without it the same pull asks, as always.
		if err := cons.PullInto(testCtx(t), ref, dst); err != nil || asked.Load() != 1 {
			t.Fatalf("%s: pull without: %v, %d requests", transport, err, asked.Load())
		}
	}
}

// A ticket issued to another consumer does not let this one read over
// tcp: the producer refuses it on the data plane, and the pull asks for
// a ticket of its own (one request) and succeeds.
func TestIssuedTicketOfAnotherConsumer(t *testing.T) {
	pcfg := testConfig(t)
	asked := countRequests(&pcfg)
	prod := startService(t, pcfg)
	ccfg := testConfig(t)
	ccfg.Transport = TransportTCP
	cons := startService(t, ccfg)
	other := startService(t, testConfig(t))
	data := randBytes(64<<10, 4)
	ref, err := prod.Publish(u8Meta(int64(len(data))), data)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := prod.Issue(ref.ID, other.self)
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, len(data))
	if err := cons.PullInto(WithIssued(testCtx(t), ref.ID, raw), ref, dst); err != nil || !bytes.Equal(dst, data) {
		t.Fatalf("pull with another's ticket: %v", err)
	}
	if n := asked.Load(); n != 1 {
		t.Fatalf("%d ticket requests, want 1: the refused ticket is replaced by one of its own", n)
	}
}

// A ticket issued while the payload is still being written (an early
// handoff) is not Complete: an shm pull then asks the producer, whose
// chunk events say when each chunk may be read, and gets every byte.
func TestIssuedTicketOfAnUnfinishedPayload(t *testing.T) {
	dir := shmDir(t)
	pcfg := arenaConfig(t, dir, 16<<20)
	asked := countRequests(&pcfg)
	prod := startService(t, pcfg)
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	meta := TensorMeta{DType: Uint8, Shape: []int64{4, 64 << 10}, ChunkDim: 0, NumChunks: 4}
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(meta.Bytes(), 5)
	copy(p.Buf(), data[:64<<10])
	if err := p.ChunkReady(0); err != nil {
		t.Fatal(err)
	}
	raw, err := prod.Issue(ref.ID, cons.self)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	dst := make([]byte, meta.Bytes())
	go func() { done <- cons.PullInto(WithIssued(testCtx(t), ref.ID, raw), ref, dst) }()
	for k := 1; k < 4; k++ {
		off, n := meta.ChunkRange(k)
		copy(p.Buf()[off:off+n], data[off:off+n])
		if err := p.ChunkReady(k); err != nil {
			t.Fatal(err)
		}
	}
	p.Done()
	if err := <-done; err != nil || !bytes.Equal(dst, data) {
		t.Fatalf("pull of an unfinished payload: %v", err)
	}
	if asked.Load() != 1 || cons.Stats().IssuedPulls != 0 {
		t.Fatalf("%d requests and %d issued pulls: want the incomplete ticket ignored", asked.Load(), cons.Stats().IssuedPulls)
	}
}
