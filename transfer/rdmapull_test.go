package transfer

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/transfer/rdma"
)

// rdmaService starts a service with an arena of size bytes whose RDMA
// device is opened on fab, with transport forced to rdma (both ends are on
// this host, where auto would pick shm).
func rdmaService(t *testing.T, fab *rdma.Fabric, size int64) *Service {
	t.Helper()
	cfg := arenaConfig(t, shmDir(t), size)
	cfg.Transport = TransportRDMA
	cfg.RDMA.MaxWR = 64 << 10 // a 1 MiB pull takes several work requests
	cfg.openRDMA = fab.Open
	s := startService(t, cfg)
	if !s.Stats().RDMA {
		t.Fatal("no RDMA device open on the fabric")
	}
	return s
}

// Whole and chunked pulls over RDMA land in the consumer's arena: a chunk is
// read once the producer marks it ready, and yielded as a view.
func TestRDMAPullOnFabric(t *testing.T) {
	fab := rdma.NewFabric()
	prod := rdmaService(t, fab, 8<<20)
	cons := rdmaService(t, fab, 8<<20)

	data := randBytes(1<<20+333, 3)
	ref := publishArena(t, prod, u8Meta(int64(len(data))), data)
	if !ref.Producer.RDMA || cons.TransportFor(ref) != TransportRDMA {
		t.Fatalf("ref %+v: transport %q, want rdma", ref.Producer, cons.TransportFor(ref))
	}
	dst, err := cons.Alloc(int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	if err := cons.PullInto(testCtx(t), ref, dst.Bytes()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.Bytes(), data) {
		t.Fatal("rdma pull delivered different bytes")
	}

	meta := TensorMeta{DType: Float32, Shape: []int64{4, 2, 5000}, NumChunks: 4}
	p, cref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	want := randBytes(meta.Bytes(), 9)
	cdst, err := cons.Alloc(meta.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	defer cdst.Release()
	pull, err := cons.PullChunks(testCtx(t), cref, cdst.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	for k := range 4 {
		select {
		case c := <-pull.Chunks():
			t.Fatalf("chunk %d yielded before it was ready", c.Index)
		case <-time.After(10 * time.Millisecond):
		}
		off, n := meta.ChunkRange(k)
		copy(p.Buf()[off:off+n], want[off:off+n])
		if err := p.ChunkReady(k); err != nil {
			t.Fatal(err)
		}
		c := <-pull.Chunks()
		if c.Index != k || !bytes.Equal(c.Data, want[off:off+n]) || &c.Data[0] != &cdst.Bytes()[off] {
			t.Fatalf("chunk %d: index %d, equal %v", k, c.Index, bytes.Equal(c.Data, want[off:off+n]))
		}
	}
	p.Done()
	if err := pull.Wait(); err != nil {
		t.Fatal(err)
	}
	if got := cons.Stats().Pulls[TransportRDMA]; got != 2 {
		t.Fatalf("%d rdma pulls counted, want 2 (all: %v)", got, cons.Stats().Pulls)
	}
}

// RDMA reads into registered memory only: a forced rdma pull into a heap
// slice is an error, not a silent tcp pull.
func TestRDMARejectsHeapDestination(t *testing.T) {
	fab := rdma.NewFabric()
	prod := rdmaService(t, fab, 4<<20)
	cons := rdmaService(t, fab, 4<<20)
	data := randBytes(64<<10, 4)
	ref := publishArena(t, prod, u8Meta(int64(len(data))), data)
	err := cons.PullInto(testCtx(t), ref, make([]byte, len(data)))
	if !errors.Is(err, ErrTransport) {
		t.Fatalf("pull into the heap: %v, want ErrTransport", err)
	}
}

// Forget closes the queue pairs to and from a departed peer, on both ends;
// the next pull connects new ones.
func TestRDMAForgetClosesQueuePairs(t *testing.T) {
	fab := rdma.NewFabric()
	prod := rdmaService(t, fab, 4<<20)
	cons := rdmaService(t, fab, 4<<20)
	data := randBytes(256<<10, 5)
	ref := publishArena(t, prod, u8Meta(int64(len(data))), data)
	dst, err := cons.Alloc(int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	pull := func() {
		t.Helper()
		clear(dst.Bytes())
		if err := cons.PullInto(testCtx(t), ref, dst.Bytes()); err != nil || !bytes.Equal(dst.Bytes(), data) {
			t.Fatalf("pull: %v (equal %v)", err, bytes.Equal(dst.Bytes(), data))
		}
	}
	pull()
	pull() // the queue pair is reused, not reconnected
	if n := fab.ClosedQPs(); n != 0 {
		t.Fatalf("%d queue pairs closed before Forget", n)
	}
	// The producer files its end of the queue pair after the exchange,
	// possibly after the consumer's first READ has already landed.
	eventually(t, "the producer's queue pair to the consumer", func() bool {
		prod.rdma.mu.Lock()
		defer prod.rdma.mu.Unlock()
		return prod.rdma.served[cons.self] != nil
	})
	cons.Forget(prod.self.String())
	if n := fab.ClosedQPs(); n != 1 {
		t.Fatalf("consumer's Forget closed %d queue pairs, want its one", n)
	}
	prod.Forget(cons.self.String())
	if n := fab.ClosedQPs(); n != 2 {
		t.Fatalf("after the producer's Forget %d queue pairs are closed, want 2", n)
	}
	pull()
	if got := cons.Stats().Pulls[TransportRDMA]; got != 3 {
		t.Fatalf("%d rdma pulls counted, want 3", got)
	}
}

// A queue pair is connected only for a consumer that shows a valid ticket
// the producer issued to it; a forged ticket, or one issued to another
// peer, gets none, and the refusal is logged.
func TestRDMAQueuePairNeedsTicket(t *testing.T) {
	fab := rdma.NewFabric()
	cfg := arenaConfig(t, shmDir(t), 1<<20)
	logs := observed(&cfg)
	cfg.Transport = TransportRDMA
	cfg.openRDMA = fab.Open
	prod := startService(t, cfg)
	cons := rdmaService(t, fab, 1<<20)
	other := rdmaService(t, fab, 1<<20)
	ref := publishArena(t, prod, u8Meta(4096), randBytes(4096, 6))
	cons.h.Peerstore().AddAddrs(prod.self, prod.h.Addrs(), time.Minute)
	other.h.Peerstore().AddAddrs(prod.self, prod.h.Addrs(), time.Minute)

	forged := prod.key.mint(ticket{payloadID: ref.ID, consumer: cons.self, expiry: time.Now().Add(time.Minute)})
	forged[len(forged)-1] ^= 1
	if _, err := cons.qpTo(testCtx(t), prod.self, forged); err == nil {
		t.Fatal("queue pair connected on a forged ticket")
	}
	refusedLogged(t, logs, "rdma", cons.self)
	resp, err := cons.requestTicket(testCtx(t), prod.self, ref)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.qpTo(testCtx(t), prod.self, resp.Ticket); err == nil {
		t.Fatal("queue pair connected on another peer's ticket")
	}
	if _, err := cons.qpTo(testCtx(t), prod.self, resp.Ticket); err != nil {
		t.Fatalf("queue pair on a valid ticket: %v", err)
	}
}

// A ticket's rkey reads its payload's bytes and nothing else: not the
// payload next to it in the arena, not the arena through its own
// registration, and not the payload itself once released.
func TestRDMATicketReadsOnlyItsPayload(t *testing.T) {
	fab := rdma.NewFabric()
	prod := rdmaService(t, fab, 1<<20)
	cons := rdmaService(t, fab, 1<<20)
	a := publishArena(t, prod, u8Meta(4096), randBytes(4096, 7))
	b := publishArena(t, prod, u8Meta(4096), randBytes(4096, 8))
	resp, err := cons.requestTicket(testCtx(t), prod.self, a)
	if err != nil {
		t.Fatal(err)
	}
	reg := resp.RDMA
	if reg == nil || reg.Off != 0 || reg.Len != 4096 {
		t.Fatalf("region for a 4096-byte payload: %+v", reg)
	}
	cons.h.Peerstore().AddAddrs(prod.self, prod.h.Addrs(), time.Minute)
	q, err := cons.qpTo(testCtx(t), prod.self, resp.Ticket)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := cons.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	local := cons.arenaOffset(dst.Bytes())
	mi := rdma.MemInfo{Addr: reg.Addr, RKey: reg.RKey, Len: reg.Len}
	if err := q.Read(testCtx(t), cons.rdma.mr, local, mi, 0, 4096); err != nil {
		t.Fatalf("read of the ticket's payload: %v", err)
	}
	// Where b lies relative to a in the producer's arena.
	bOff := prod.arenaOffset(prod.reg.get(b.ID).buf) - prod.arenaOffset(prod.reg.get(a.ID).buf)
	wide := rdma.MemInfo{Addr: reg.Addr, RKey: reg.RKey, Len: uint64(bOff + 4096)}
	if err := q.Read(testCtx(t), cons.rdma.mr, local, wide, bOff, 4096); err == nil {
		t.Fatal("a's rkey read b's bytes")
	}
	// A failed READ breaks the queue pair, as on hardware: connect anew.
	cons.dropQP(prod.self, q)
	arenaMI := prod.rdma.mr.MemInfo()
	if q, err = cons.qpTo(testCtx(t), prod.self, resp.Ticket); err != nil {
		t.Fatal(err)
	}
	if err := q.Read(testCtx(t), cons.rdma.mr, local, arenaMI, 0, 4096); err == nil {
		t.Fatal("the producer's arena registration is remotely readable")
	}
	cons.dropQP(prod.self, q)
	prod.Release(a.ID)
	if q, err = cons.qpTo(testCtx(t), prod.self, resp.Ticket); err != nil {
		t.Fatal(err)
	}
	if err := q.Read(testCtx(t), cons.rdma.mr, local, mi, 0, 4096); err == nil {
		t.Fatal("a released payload's region is still readable")
	}
}
