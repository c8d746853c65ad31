package transfer

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

// shmDir is a short directory for shm sockets (socket paths are limited to
// 107 bytes, and t.TempDir's can be long), removed at test end.
func shmDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("", "lm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// arenaConfig is testConfig with an arena of size bytes and shm sockets in dir.
func arenaConfig(t testing.TB, dir string, size int64) Config {
	cfg := testConfig(t)
	cfg.Arena = arena.DefaultTestConfig()
	cfg.Arena.Size = size
	cfg.ShmDir = dir
	return cfg
}

// eventually retries cond every few milliseconds for up to 5s.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// publishArena publishes data from a fresh arena buffer of s and releases
// the buffer (the payload keeps it alive).
func publishArena(t testing.TB, s *Service, meta TensorMeta, data []byte) Ref {
	t.Helper()
	b, err := s.Alloc(int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	copy(b.Bytes(), data)
	ref, err := s.Publish(meta, b.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	b.Release()
	return ref
}

func TestChooseTransport(t *testing.T) {
	a := caps{host: "h1/boot", shm: true, rdma: true}
	cases := []struct {
		name       string
		mode       string
		self, prod caps
		want       string // "" means an ErrTransport
	}{
		{"auto same host shm", TransportAuto, a, a, TransportShm},
		{"auto same host no consumer arena", TransportAuto, caps{host: a.host, rdma: true}, a, TransportRDMA},
		{"auto same host, producer socket unreachable", TransportAuto, caps{host: a.host, shm: true}, caps{host: a.host}, TransportTCP},
		{"auto other host rdma", TransportAuto, a, caps{host: "h2/boot", shm: true, rdma: true}, TransportRDMA},
		{"auto other host no rdma", TransportAuto, caps{host: a.host, shm: true}, caps{host: "h2/boot", shm: true, rdma: true}, TransportTCP},
		{"auto unknown hosts", TransportAuto, caps{shm: true}, caps{shm: true}, TransportTCP},
		{"auto same hostname other boot", TransportAuto, caps{host: "h1/b1", shm: true}, caps{host: "h1/b2", shm: true}, TransportTCP},
		{"tcp forced", TransportTCP, a, a, TransportTCP},
		{"shm forced", TransportShm, a, a, TransportShm},
		{"shm forced other host", TransportShm, a, caps{host: "h2/boot", shm: true}, ""},
		{"shm forced no producer arena", TransportShm, a, caps{host: a.host}, ""},
		{"shm forced no own arena", TransportShm, caps{host: a.host}, a, ""},
		{"rdma forced", TransportRDMA, a, caps{host: "h2/boot", rdma: true}, TransportRDMA},
		{"rdma forced producer without", TransportRDMA, a, caps{host: "h2/boot"}, ""},
		{"rdma forced self without", TransportRDMA, caps{host: a.host}, caps{rdma: true}, ""},
	}
	for _, tc := range cases {
		got, err := chooseTransport(tc.mode, tc.self, tc.prod)
		if tc.want == "" {
			if !errors.Is(err, ErrTransport) {
				t.Errorf("%s: got %q, %v; want ErrTransport", tc.name, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: got %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
}

func TestHostIdentity(t *testing.T) {
	id := hostIdentity()
	name, _ := os.Hostname()
	if id == "" || !bytes.HasPrefix([]byte(id), []byte(name+"/")) || len(id) < len(name)+30 {
		t.Fatalf("host identity %q: want hostname/boot_id", id)
	}
}

func TestShmPullOddSizes(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	for _, size := range []int64{1, 4095, 4097, 3<<20 + 7} {
		data := randBytes(size, uint64(size))
		ref := publishArena(t, prod, u8Meta(size), data)
		if ref.Producer.ShmSocket == "" || ref.Producer.Host == "" {
			t.Fatalf("ref lacks shm fields: %+v", ref.Producer)
		}
		if got := cons.TransportFor(ref); got != TransportShm {
			t.Fatalf("size %d: transport %q, want shm", size, got)
		}
		dst, err := cons.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		if err := cons.PullInto(testCtx(t), ref, dst.Bytes()); err != nil || !bytes.Equal(dst.Bytes(), data) {
			t.Fatalf("size %d: PullInto over shm: %v", size, err)
		}
		dst.Release()
		if got, err := cons.Pull(testCtx(t), ref); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("size %d: Pull over shm: %v", size, err)
		}
		prod.Release(ref.ID)
		if _, err := cons.Pull(testCtx(t), ref); !errors.Is(err, ErrNotFound) {
			t.Fatalf("size %d: released payload: %v, want ErrNotFound", size, err)
		}
	}
	eventually(t, "producer arena empty", func() bool { return prod.Stats().Arena.Used == 0 })
	if st := cons.Stats(); !st.HasArena || st.Arena.Used != 0 {
		t.Fatalf("consumer arena: %+v", st)
	}
	// A payload published from the heap is not in the arena: auto falls
	// back to tcp, forced shm refuses.
	data := randBytes(5000, 9)
	ref, err := prod.Publish(u8Meta(5000), data)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cons.Pull(testCtx(t), ref); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("heap payload in auto mode: %v", err)
	}
	cfg := arenaConfig(t, dir, 1<<20)
	cfg.Transport = TransportShm
	forced := startService(t, cfg)
	if _, err := forced.Pull(testCtx(t), ref); !errors.Is(err, ErrTransport) {
		t.Fatalf("heap payload with shm forced: %v, want ErrTransport", err)
	}
}

func TestShmChunked(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	meta := TensorMeta{DType: Float32, Shape: []int64{8, 3, 1000}, NumChunks: 8}
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	if prod.arenaOffset(p.Buf()) < 0 {
		t.Fatal("Begin did not allocate from the arena")
	}
	data := randBytes(meta.Bytes(), 7)
	dst, err := cons.Alloc(meta.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Release()
	pull, err := cons.PullChunks(testCtx(t), ref, dst.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	for k := range 8 {
		select {
		case c := <-pull.Chunks():
			t.Fatalf("chunk %d yielded before it was ready", c.Index)
		case <-time.After(10 * time.Millisecond):
		}
		off, n := meta.ChunkRange(k)
		copy(p.Buf()[off:off+n], data[off:off+n])
		if err := p.ChunkReady(k); err != nil {
			t.Fatal(err)
		}
		c := <-pull.Chunks()
		if c.Index != k || !bytes.Equal(c.Data, data[off:off+n]) {
			t.Fatalf("chunk %d: got index %d, equal=%v", k, c.Index, bytes.Equal(c.Data, data[off:off+n]))
		}
		if &c.Data[0] != &dst.Bytes()[off] {
			t.Fatalf("chunk %d is not a view into dst", k)
		}
	}
	if err := pull.Wait(); err != nil {
		t.Fatal(err)
	}
}

func TestPullViewZeroCopy(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	data := randBytes(2<<20, 3)
	ref := publishArena(t, prod, u8Meta(2<<20), data)
	view, release, err := cons.PullView(testCtx(t), ref)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(view, data) {
		t.Fatal("view differs")
	}
	if cons.arenaOffset(view) >= 0 {
		t.Fatal("view is a copy in the consumer's arena, not the producer's memory")
	}
	if st := prod.Stats().Arena; st.Pinned != 1 {
		t.Fatalf("producer pins while viewed: %+v", st)
	}
	// Releasing the payload while it is viewed defers the free.
	prod.Release(ref.ID)
	if st := prod.Stats().Arena; st.PendingFree != 1 || st.Used == 0 {
		t.Fatalf("after Release with a view held: %+v", st)
	}
	b, err := prod.Alloc(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	copy(b.Bytes(), bytes.Repeat([]byte{0xee}, 2<<20)) // must not land under the view
	if !bytes.Equal(view, data) {
		t.Fatal("view changed under a held reference")
	}
	b.Release()
	release()
	release() // idempotent
	eventually(t, "arena freed after the view's release", func() bool { return prod.Stats().Arena.Used == 0 })

	// A producer without an arena: PullView pulls into the consumer's arena.
	heap := startService(t, testConfig(t))
	hdata := randBytes(1000, 4)
	href, err := heap.Publish(u8Meta(1000), hdata)
	if err != nil {
		t.Fatal(err)
	}
	view, release, err = cons.PullView(testCtx(t), href)
	if err != nil || !bytes.Equal(view, hdata) || cons.arenaOffset(view) < 0 {
		t.Fatalf("PullView from a tcp producer: %v", err)
	}
	release()
	if st := cons.Stats().Arena; st.Used != 0 {
		t.Fatalf("consumer arena after release: %+v", st)
	}
}

// TestReleaseDuringReadKeepsMemory releases a payload while the producer is
// serving it over tcp: the arena keeps the region until the read is done.
// Releasing a payload whose later chunks are not written yet ends the pulls
// waiting for them with ErrNotFound (they would otherwise wait on
// heartbeats forever), and the arena region stays the writer's until it
// says it is done, so nobody else is handed memory it still writes.
func TestReleaseEndsWaitingPullAndKeepsWriterMemory(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	for _, mode := range []string{TransportTCP, TransportShm} {
		t.Run(mode, func(t *testing.T) {
			cfg := arenaConfig(t, dir, 16<<20)
			cfg.Transport = mode
			cons := startService(t, cfg)
			meta := TensorMeta{DType: Uint8, Shape: []int64{2, 1 << 20}, NumChunks: 2}
			p, ref, err := prod.Begin(meta)
			if err != nil {
				t.Fatal(err)
			}
			copy(p.Buf(), randBytes(meta.Bytes(), 11))
			if err := p.ChunkReady(0); err != nil {
				t.Fatal(err)
			}
			pull, err := cons.PullChunks(testCtx(t), ref, make([]byte, meta.Bytes()))
			if err != nil {
				t.Fatal(err)
			}
			<-pull.Chunks() // chunk 0; the pull now waits for chunk 1
			prod.Release(ref.ID)
			for range pull.Chunks() {
			}
			if err := pull.Wait(); !errors.Is(err, ErrNotFound) {
				t.Fatalf("pull of a released payload: %v, want ErrNotFound", err)
			}
			if st := prod.Stats().Arena; st.Used == 0 {
				t.Fatalf("region freed while its writer may still write: %+v", st)
			}
			copy(p.Buf()[1<<20:], randBytes(1<<20, 12)) // still the writer's memory
			p.Done()
			eventually(t, "region freed after release and done", func() bool { return prod.Stats().Arena.Used == 0 })
		})
	}
}

// A payload read in place over shm or rdma must not be read before its
// producer marked it ready, even when it is a single chunk.
func TestShmWaitsForSingleChunkBeginPayload(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	meta := u8Meta(1 << 20)
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	if got := cons.TransportFor(ref); got != TransportShm {
		t.Fatalf("transport %q, want shm", got)
	}
	want := randBytes(meta.Bytes(), 5)
	done := make(chan error, 1)
	dst := make([]byte, meta.Bytes())
	go func() { done <- cons.PullInto(testCtx(t), ref, dst) }()
	select {
	case err := <-done:
		t.Fatalf("pull returned before the payload was ready: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	copy(p.Buf(), want)
	if err := p.ChunkReady(0); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || !bytes.Equal(dst, want) {
		t.Fatalf("pull after ready: %v", err)
	}
}

func TestAllocStats(t *testing.T) {
	s := startService(t, arenaConfig(t, shmDir(t), 4<<20))
	st := s.Stats()
	if !st.HasArena || st.Arena.Free != 4<<20 {
		t.Fatalf("fresh arena: %+v", st)
	}
	b1, err := s.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := s.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Alloc(3 << 20); !errors.Is(err, arena.ErrNoSpace) {
		t.Fatalf("oversized alloc: %v", err)
	}
	b1.Release()
	b1.Release()
	st = s.Stats()
	if st.Arena.Used != 1<<20 || st.Arena.Fragmentation() == 0 {
		t.Fatalf("after one release: %+v frag %v", st.Arena, st.Arena.Fragmentation())
	}
	b2.Release()
	// Begin falls back to the heap when the arena is full.
	meta := TensorMeta{DType: Uint8, Shape: []int64{8 << 20}}
	if _, _, err := s.Begin(meta); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.HeapFallbacks != 1 || st.Payloads != 1 {
		t.Fatalf("heap fallback: %+v", st)
	}
	// Without an arena Alloc hands out heap memory.
	h := startService(t, testConfig(t))
	b, err := h.Alloc(10)
	if err != nil || len(b.Bytes()) != 10 || h.Stats().HasArena {
		t.Fatalf("heap alloc: %v", err)
	}
	b.Release()
}

func TestForcedTransports(t *testing.T) {
	dir := shmDir(t)
	heapProd := startService(t, testConfig(t))
	ref, err := heapProd.Publish(u8Meta(100), randBytes(100, 1))
	if err != nil {
		t.Fatal(err)
	}
	cfg := arenaConfig(t, dir, 1<<20)
	cfg.Transport = TransportShm
	shmCons := startService(t, cfg)
	if got := shmCons.TransportFor(ref); got != "" {
		t.Fatalf("forced shm towards a producer without arena: %q", got)
	}
	if _, err := shmCons.Pull(testCtx(t), ref); !errors.Is(err, ErrTransport) {
		t.Fatalf("forced shm: %v, want ErrTransport", err)
	}
	// A forced transport must come with what it needs.
	for _, mode := range []string{TransportShm, TransportRDMA} {
		c := testConfig(t)
		c.Transport = mode
		if err := c.validate(); err == nil {
			t.Errorf("%s without an arena accepted", mode)
		}
	}
	c := testConfig(t)
	c.Transport = "carrier-pigeon"
	if err := c.validate(); err == nil {
		t.Error("unknown transport accepted")
	}
	// No RDMA device here: forcing rdma fails at New, with the reason.
	cfg = arenaConfig(t, dir, 1<<20)
	cfg.Transport = TransportRDMA
	if _, err := newService(cfg, newHost(t), time.Now); !errors.Is(err, ErrTransport) {
		t.Fatalf("forced rdma without a device: %v, want ErrTransport", err)
	}
	// tcp forced between same-host arenas.
	prod := startService(t, arenaConfig(t, dir, 1<<20))
	cfg = arenaConfig(t, dir, 1<<20)
	cfg.Transport = TransportTCP
	tcpCons := startService(t, cfg)
	data := randBytes(4096, 2)
	aref := publishArena(t, prod, u8Meta(4096), data)
	if got := tcpCons.TransportFor(aref); got != TransportTCP {
		t.Fatalf("tcp forced: %q", got)
	}
	if got, err := tcpCons.Pull(testCtx(t), aref); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("tcp forced pull: %v", err)
	}
	if got := prod.TransportFor(aref); got != TransportLocal {
		t.Fatalf("own payload: %q", got)
	}
}

func TestRDMAFallbackLogsOnce(t *testing.T) {
	for _, tc := range []struct {
		mode  string
		arena bool
		want  int
	}{
		{TransportAuto, true, 1},
		{TransportAuto, false, 1},
		{TransportTCP, true, 0},
		{TransportShm, true, 0},
	} {
		core, logs := observer.New(zapcore.InfoLevel)
		cfg := testConfig(t)
		if tc.arena {
			cfg = arenaConfig(t, shmDir(t), 1<<20)
		}
		cfg.Transport = tc.mode
		cfg.Logger = zap.New(core)
		s, err := newService(cfg, newHost(t), time.Now)
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
		got := logs.FilterMessage(rdmaFallbackMsg).All()
		if len(got) != tc.want {
			t.Fatalf("%s arena=%v: %d fallback lines, want %d (all: %v)", tc.mode, tc.arena, len(got), tc.want, logs.All())
		}
		if tc.want == 1 && got[0].ContextMap()["reason"] == "" {
			t.Fatalf("fallback line without a reason: %v", got[0])
		}
	}
}

func TestCorruptBlockDetected(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	// Multi-block, multi-stripe payload; flip a byte in the third block.
	data := randBytes(6<<20+5, 21)
	ref, err := prod.Publish(u8Meta(6<<20+5), bytes.Clone(data))
	if err != nil {
		t.Fatal(err)
	}
	e := prod.reg.get(ref.ID)
	if want := (6<<20 + 5 + sumBlock - 1) / sumBlock; len(e.sums[0]) != want {
		t.Fatalf("%d block sums for 6 MiB + 5, want %d", len(e.sums[0]), want)
	}
	e.buf[2<<20+17] ^= 0x01
	prod.Held()
	if _, err := cons.Pull(testCtx(t), ref); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("flipped byte: %v, want ErrCorrupt", err)
	}
	// With checksums off the same bytes arrive unverified.
	cfg := testConfig(t)
	cfg.ChecksumTCP = false
	lax := startService(t, cfg)
	if got, err := lax.Pull(testCtx(t), ref); err != nil || bytes.Equal(got, data) {
		t.Fatalf("checksum off: %v", err)
	}
}

func TestStatsCountPullsByTransport(t *testing.T) {
	for _, mode := range []string{TransportTCP, TransportShm} {
		t.Run(mode, func(t *testing.T) {
			dir := shmDir(t)
			pc, cc := arenaConfig(t, dir, 4<<20), arenaConfig(t, dir, 4<<20)
			pc.Transport, cc.Transport = mode, mode
			prod, cons := startService(t, pc), startService(t, cc)
			ref := publishArena(t, prod, u8Meta(1<<20), randBytes(1<<20, 3))
			if _, err := cons.Pull(testCtx(t), ref); err != nil {
				t.Fatal(err)
			}
			if _, err := prod.Pull(testCtx(t), ref); err != nil {
				t.Fatal(err)
			}
			if got := cons.Stats().Pulls; got[mode] != 1 || got[TransportLocal] != 0 {
				t.Fatalf("consumer pulls %v, want one by %s", got, mode)
			}
			if got := prod.Stats().Pulls; got[TransportLocal] != 1 {
				t.Fatalf("producer pulls %v, want one local", got)
			}
		})
	}
}

func TestDeadlineMovesAtMostEveryQuarter(t *testing.T) {
	var sets []time.Time
	d := deadline{set: func(t time.Time) { sets = append(sets, t) }, timeout: 400 * time.Millisecond}
	d.progress() // first block: always sets
	d.progress() // right after: no timer reset
	if len(sets) != 1 {
		t.Fatalf("%d deadline sets, want 1", len(sets))
	}
	if ahead := time.Until(sets[0]); ahead < 300*time.Millisecond {
		t.Fatalf("deadline only %v ahead", ahead)
	}
	time.Sleep(110 * time.Millisecond) // past a quarter of the timeout
	d.progress()
	if len(sets) != 2 || !sets[1].After(sets[0]) {
		t.Fatalf("deadline not moved forward after a quarter: %v", sets)
	}
}

// Forget drops a departed producer's shm mapping and idle connections.
func TestForgetDropsProducerState(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	shmCons := startService(t, arenaConfig(t, dir, 16<<20))
	tcpCfg := arenaConfig(t, dir, 16<<20)
	tcpCfg.Transport = TransportTCP
	tcpCons := startService(t, tcpCfg)
	ref := publishArena(t, prod, u8Meta(4<<20), randBytes(4<<20, 9))
	for _, c := range []*Service{shmCons, tcpCons} {
		if _, err := c.Pull(testCtx(t), ref); err != nil {
			t.Fatal(err)
		}
	}
	count := func() (shmPeers, idle int) {
		shmCons.shmCli.mu.Lock()
		shmPeers = len(shmCons.shmCli.peers)
		shmCons.shmCli.mu.Unlock()
		tcpCons.pool.mu.Lock()
		for _, l := range tcpCons.pool.idle {
			idle += len(l)
		}
		tcpCons.pool.mu.Unlock()
		return
	}
	if p, i := count(); p != 1 || i == 0 {
		t.Fatalf("before Forget: %d shm peers, %d idle conns", p, i)
	}
	shmCons.Forget(ref.Producer.PeerID)
	tcpCons.Forget(ref.Producer.PeerID)
	if p, i := count(); p != 0 || i != 0 {
		t.Fatalf("after Forget: %d shm peers, %d idle conns", p, i)
	}
	// Pulls still work: the state is rebuilt on demand.
	for _, c := range []*Service{shmCons, tcpCons} {
		if _, err := c.Pull(testCtx(t), ref); err != nil {
			t.Fatal(err)
		}
	}
}

// availableCongestion lists the congestion controls the kernel has loaded.
func availableCongestion(t *testing.T) []string {
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_available_congestion_control")
	if err != nil {
		t.Skipf("no congestion control list: %v", err)
	}
	return strings.Fields(string(b))
}

// servingCongestion pulls a payload from prod to cons and returns the
// congestion control of every producer-side data connection.
func servingCongestion(t *testing.T, prod, cons *Service) []string {
	t.Helper()
	data := randBytes(3<<20, 5)
	ref, err := prod.Publish(u8Meta(int64(len(data))), data)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cons.Pull(testCtx(t), ref)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("pull: %v (equal %v)", err, bytes.Equal(got, data))
	}
	prod.mu.Lock()
	defer prod.mu.Unlock()
	var out []string
	for c := range prod.dataConns {
		name, err := congestionOf(c.(*net.TCPConn))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, name)
	}
	if len(out) == 0 {
		t.Fatal("the producer serves no data connection after a pull")
	}
	return out
}

func TestDataConnsRunConfiguredCongestion(t *testing.T) {
	system := systemCongestion()
	// reno is built into every kernel; cubic when reno is the default.
	want := "reno"
	if system == want {
		want = "cubic"
		if !slices.Contains(availableCongestion(t), want) {
			t.Skipf("the system default is reno and cubic is not loaded")
		}
	}
	cfg := testConfig(t)
	cfg.TCPCongestion = want
	prod := startService(t, cfg)
	for _, got := range servingCongestion(t, prod, startService(t, testConfig(t))) {
		if got != want {
			t.Fatalf("producer connection runs %q, want %q (system default %q)", got, want, system)
		}
	}

	// Empty keeps the system default.
	cfg.TCPCongestion = ""
	prod = startService(t, cfg)
	for _, got := range servingCongestion(t, prod, startService(t, testConfig(t))) {
		if got != system {
			t.Fatalf("producer connection runs %q, want the system default %q", got, system)
		}
	}
}

func TestUnavailableCongestionLogsOnceAndServes(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := testConfig(t)
	cfg.TCPCongestion = "nosuch_cc"
	cfg.Logger = zap.New(core)
	prod := startService(t, cfg)
	for _, got := range servingCongestion(t, prod, startService(t, testConfig(t))) {
		if got != systemCongestion() {
			t.Fatalf("producer connection runs %q, want the system default %q", got, systemCongestion())
		}
	}
	lines := logs.FilterMessage(congestionFallbackMsg).All()
	if len(lines) != 1 {
		t.Fatalf("%d fallback lines, want 1 (all: %v)", len(lines), logs.All())
	}
	if f := lines[0].ContextMap(); f["wanted"] != "nosuch_cc" || !strings.Contains(fmt.Sprint(f["error"]), "tcp_available_congestion_control") {
		t.Fatalf("fallback line fields %v", f)
	}
}

func TestCongestionNameValidated(t *testing.T) {
	for _, name := range []string{"Cubic", "cubic;rm", "a_name_far_too_long", "bb r"} {
		cfg := testConfig(t)
		cfg.TCPCongestion = name
		if _, err := newService(cfg, newHost(t), time.Now); err == nil || !strings.Contains(err.Error(), "TCPCongestion") {
			t.Fatalf("TCPCongestion %q: err %v, want a config error", name, err)
		}
	}
}

// congestionOf returns the congestion control a TCP socket runs.
func congestionOf(c syscall.Conn) (string, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return "", err
	}
	var name string
	var serr error
	if err := rc.Control(func(fd uintptr) {
		name, serr = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
	}); err != nil {
		return "", err
	}
	if serr != nil {
		return "", fmt.Errorf("getsockopt TCP_CONGESTION: %w", serr)
	}
	return name, nil
}
