package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/build"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// producer is a test producer: an arena exported by a Server on a Unix
// socket in a temp dir.
type producer struct {
	a    *arena.Arena
	srv  *Server
	path string
}

func newArena(tb testing.TB, size int64) *arena.Arena {
	tb.Helper()
	cfg := arena.DefaultTestConfig()
	cfg.Size = size
	cfg.Prefault = true
	a, err := arena.New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { a.Close() })
	return a
}

func startProducer(tb testing.TB, size int64, mod func(*ServerConfig)) *producer {
	tb.Helper()
	a := newArena(tb, size)
	cfg := DefaultServerConfig("producer-1")
	if t, ok := tb.(*testing.T); ok {
		cfg.Logger = zaptest.NewLogger(t)
	}
	if mod != nil {
		mod(&cfg)
	}
	srv, err := NewServer(a, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(tb.TempDir(), "shm.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		tb.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()
	tb.Cleanup(func() {
		srv.Close()
		// ErrClosed: the test ended before the Serve goroutine got going.
		if err := <-served; err != nil && !errors.Is(err, ErrClosed) {
			tb.Errorf("Serve: %v", err)
		}
	})
	return &producer{a: a, srv: srv, path: path}
}

func dial(tb testing.TB, p *producer) *Peer {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	peer, err := Dial(ctx, p.path, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { peer.Close() })
	return peer
}

// put allocates n bytes in the producer's arena, fills them with a pattern
// derived from seed and returns the Buf and its Handle.
func (p *producer) put(tb testing.TB, n int64, seed byte) (arena.Buf, Handle) {
	tb.Helper()
	b, err := p.a.Alloc(n)
	if err != nil {
		tb.Fatal(err)
	}
	s := p.a.Slice(b)
	for i := range s {
		s[i] = byte(i*7) ^ seed
	}
	return b, p.srv.Handle(b)
}

// eventually retries cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for delay := time.Millisecond; ; delay = min(2*delay, 100*time.Millisecond) {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(delay)
	}
}

func TestViewSeesProducerWrites(t *testing.T) {
	p := startProducer(t, 4<<20, nil)
	peer := dial(t, p)
	if peer.ArenaID() != "producer-1" || peer.Size() != p.a.Size() {
		t.Fatalf("peer id %q size %d", peer.ArenaID(), peer.Size())
	}
	if peer.Cred().Pid != int32(os.Getpid()) {
		t.Fatalf("producer pid %d, want %d", peer.Cred().Pid, os.Getpid())
	}
	b, h := p.put(t, 100000, 3)
	v, err := peer.View(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(v, p.a.Slice(b)) {
		t.Fatal("view differs from producer bytes")
	}
	if st := p.srv.Stats(); st.Pins != 1 || st.Peers != 1 {
		t.Fatalf("server stats %+v", st)
	}
	// In place: later producer writes are visible without another handoff.
	p.a.Slice(b)[42] = 0xAB
	if v[42] != 0xAB {
		t.Fatal("producer write not visible in view")
	}
	if err := peer.Release(h); err != nil {
		t.Fatal(err)
	}
	if err := peer.Release(h); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second Release = %v, want ErrNotHeld", err)
	}
	eventually(t, "pin released", func() bool { return p.srv.Stats().Pins == 0 && p.a.Stats().Pinned == 0 })
}

func TestCopyIntoOddSizes(t *testing.T) {
	p := startProducer(t, 64<<20, nil)
	peer := dial(t, p)
	dstArena := newArena(t, 64<<20)
	for _, n := range []int64{1, 3, 4095, 4097, 1<<20 + 3, 2<<20 + 1, 3<<20 + 17, 9<<20 + 4093, 33<<20 + 1} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			b, h := p.put(t, n, byte(n))
			db, err := dstArena.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			dst := dstArena.Slice(db)
			if err := peer.CopyInto(context.Background(), h, dst); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, p.a.Slice(b)) {
				t.Fatal("copy differs from source")
			}
			dstArena.Free(db)
			eventually(t, "pin released", func() bool { return p.srv.Stats().Pins == 0 })
			if err := p.a.Free(b); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestBoundsAndStaleHandlesRejected(t *testing.T) {
	p := startProducer(t, 1<<20, nil)
	peer := dial(t, p)
	b, h := p.put(t, 8192, 1)
	size := p.a.Size()
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		h    Handle
		want error
	}{
		{"negative off", Handle{ArenaID: h.ArenaID, Off: -4096, Len: 10}, ErrBadHandle},
		{"zero len", Handle{ArenaID: h.ArenaID, Off: 0, Len: 0}, ErrBadHandle},
		{"past end", Handle{ArenaID: h.ArenaID, Off: size - 4096, Len: 8192}, ErrBadHandle},
		{"overflow", Handle{ArenaID: h.ArenaID, Off: size - 1, Len: math.MaxInt64}, ErrBadHandle},
		{"other arena", Handle{ArenaID: "someone-else", Off: h.Off, Len: h.Len, Gen: h.Gen}, ErrBadHandle},
		{"in bounds, never allocated", Handle{ArenaID: h.ArenaID, Off: 512 << 10, Len: 4096, Gen: 1}, ErrUnknownBuf},
		{"wrong gen", Handle{ArenaID: h.ArenaID, Off: h.Off, Len: h.Len, Gen: h.Gen + 1}, ErrUnknownBuf},
		{"wrong len", Handle{ArenaID: h.ArenaID, Off: h.Off, Len: h.Len - 1, Gen: h.Gen}, ErrUnknownBuf},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if v, err := peer.View(ctx, tc.h); !errors.Is(err, tc.want) || v != nil {
				t.Fatalf("View = %d bytes, %v; want %v", len(v), err, tc.want)
			}
		})
	}
	if err := peer.CopyInto(ctx, h, make([]byte, h.Len+1)); !errors.Is(err, ErrBadHandle) {
		t.Fatalf("CopyInto with wrong dst size = %v", err)
	}
	// A freed buffer is gone for consumers, and so is its stale handle after reuse.
	if err := p.a.Free(b); err != nil {
		t.Fatal(err)
	}
	if _, err := peer.View(ctx, h); !errors.Is(err, ErrUnknownBuf) {
		t.Fatalf("View of freed = %v", err)
	}
	p.put(t, 8192, 2)
	if _, err := peer.View(ctx, h); !errors.Is(err, ErrUnknownBuf) {
		t.Fatalf("View of stale handle after reuse = %v", err)
	}
	// The connection survived all of that.
	_, h2 := p.put(t, 4096, 3)
	if _, err := peer.View(ctx, h2); err != nil {
		t.Fatal(err)
	}
	peer.Release(h2)
}

func TestPinDefersProducerFree(t *testing.T) {
	p := startProducer(t, 1<<20, nil)
	peer := dial(t, p)
	b, h := p.put(t, 64<<10, 9)
	v, err := peer.View(context.Background(), h)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.a.Free(b); err != nil {
		t.Fatal(err)
	}
	// The pinned region is not handed out again while the consumer reads it.
	b2, err := p.a.Alloc(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	if b2.Off == b.Off {
		t.Fatal("pinned region reused")
	}
	want := append([]byte(nil), v...)
	clear(p.a.Slice(b2))
	if !bytes.Equal(v, want) {
		t.Fatal("view changed while pinned")
	}
	peer.Release(h)
	eventually(t, "deferred free", func() bool {
		s := p.a.Stats()
		return s.PendingFree == 0 && s.Allocs == 1
	})
}

func TestDisconnectDropsPins(t *testing.T) {
	p := startProducer(t, 1<<20, nil)
	peer := dial(t, p)
	_, h1 := p.put(t, 4096, 1)
	_, h2 := p.put(t, 4096, 2)
	for _, h := range []Handle{h1, h1, h2} {
		if _, err := peer.View(context.Background(), h); err != nil {
			t.Fatal(err)
		}
	}
	if st := p.srv.Stats(); st.Pins != 3 {
		t.Fatalf("pins %d, want 3", st.Pins)
	}
	if err := peer.Close(); err != nil {
		t.Fatal(err)
	}
	if err := peer.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	eventually(t, "pins dropped on disconnect", func() bool {
		return p.srv.Stats().Pins == 0 && p.srv.Stats().Peers == 0 && p.a.Stats().Pinned == 0
	})
	if _, err := peer.View(context.Background(), h1); !errors.Is(err, ErrClosed) {
		t.Fatalf("View after Close = %v", err)
	}
}

func TestTooManyPins(t *testing.T) {
	p := startProducer(t, 1<<20, func(c *ServerConfig) { c.MaxPinsPerPeer = 2 })
	peer := dial(t, p)
	_, h := p.put(t, 4096, 1)
	ctx := context.Background()
	for range 2 {
		if _, err := peer.View(ctx, h); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := peer.View(ctx, h); !errors.Is(err, ErrTooManyPins) {
		t.Fatalf("third View = %v, want ErrTooManyPins", err)
	}
	peer.Release(h)
	eventually(t, "release", func() bool { return p.srv.Stats().Pins == 1 })
	if _, err := peer.View(ctx, h); err != nil {
		t.Fatalf("View after release: %v", err)
	}
}

func TestCredentialRejection(t *testing.T) {
	t.Run("producer rejects consumer", func(t *testing.T) {
		p := startProducer(t, 1<<20, func(c *ServerConfig) { c.Check = AllowUIDs(uint32(os.Getuid()) + 1) })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		peer, err := Dial(ctx, p.path, nil)
		if err == nil {
			peer.Close()
			t.Fatal("Dial succeeded against a producer that rejects us")
		}
		eventually(t, "rejection counted", func() bool { return p.srv.Stats().Rejected == 1 })
		if st := p.srv.Stats(); st.Peers != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("consumer rejects producer", func(t *testing.T) {
		p := startProducer(t, 1<<20, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		targets := []string{fdTarget(t, p.a.Fd())}
		fds := fdsOpenOn(t, targets)
		_, err := Dial(ctx, p.path, AllowUIDs(uint32(os.Getuid())+1))
		if !errors.Is(err, ErrPeerRejected) {
			t.Fatalf("Dial = %v, want ErrPeerRejected", err)
		}
		if n := fdsOpenOn(t, targets); n != fds {
			t.Fatalf("%d fds open on the producer's arena after the rejection, %d before", n, fds)
		}
	})
	t.Run("same uid accepted", func(t *testing.T) {
		if err := SameUID()(unix.Ucred{Uid: uint32(os.Getuid())}); err != nil {
			t.Fatal(err)
		}
		if err := SameUID()(unix.Ucred{Uid: uint32(os.Getuid()) + 1}); !errors.Is(err, ErrPeerRejected) {
			t.Fatalf("other uid: %v", err)
		}
	})
}

// fakeProducer accepts one connection on a temp socket and runs fn on it.
func fakeProducer(t *testing.T, fn func(c *net.UnixConn)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		fn(c)
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return path
}

func TestDialRejectsBadHandshake(t *testing.T) {
	a := newArena(t, 1<<20)
	// Start the network poller now so its fds are not counted as leaks.
	if l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(t.TempDir(), "warm.sock"), Net: "unix"}); err == nil {
		l.Close()
	}
	good := func() []byte {
		var b [headerSize]byte
		header{ArenaSize: a.Size(), ArenaID: "fake"}.encode(&b)
		return b[:]
	}
	for _, tc := range []struct {
		name string
		hdr  func() []byte
		fds  []int
	}{
		{"no fd", good, nil},
		{"two fds", good, []int{a.Fd(), a.Fd()}},
		{"bad magic", func() []byte { b := good(); b[0] = 'X'; return b }, []int{a.Fd()}},
		{"size mismatch", func() []byte {
			var b [headerSize]byte
			header{ArenaSize: a.Size() * 2, ArenaID: "fake"}.encode(&b)
			return b[:]
		}, []int{a.Fd()}},
		{"not a memfd", good, []int{int(os.Stdin.Fd())}},
		{"short header", func() []byte { return good()[:10] }, []int{a.Fd()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Count the fds open on what the fake sends (the arena's memfd,
			// stdin): unrelated fds opening or closing elsewhere in the
			// process cannot disturb that count.
			targets := []string{fdTarget(t, a.Fd()), fdTarget(t, int(os.Stdin.Fd()))}
			before := fdsOpenOn(t, targets)
			path := fakeProducer(t, func(c *net.UnixConn) {
				var oob []byte
				if tc.fds != nil {
					oob = unix.UnixRights(tc.fds...)
				}
				c.WriteMsgUnix(tc.hdr(), oob, nil)
				c.CloseWrite()
				var b [1]byte
				c.Read(b[:]) // until the consumer hangs up
			})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			peer, err := Dial(ctx, path, nil)
			if err == nil {
				peer.Close()
				t.Fatal("Dial accepted a bad handshake")
			}
			// Dial closed every fd it received before returning its error.
			if after := fdsOpenOn(t, targets); after != before {
				t.Fatalf("%d fds open on the sent files after Dial failed, %d before", after, before)
			}
		})
	}
}

// TestViewHonoursContext runs against a producer that hands over its arena
// and then never answers: View must give up at the deadline and the peer must
// report itself broken afterwards rather than read a late reply out of step.
func TestViewHonoursContext(t *testing.T) {
	a := newArena(t, 1<<20)
	path := fakeProducer(t, func(c *net.UnixConn) {
		var b [headerSize]byte
		header{ArenaSize: a.Size(), ArenaID: "mute"}.encode(&b)
		c.WriteMsgUnix(b[:], unix.UnixRights(a.Fd()), nil)
		var sink [frameSize]byte
		for {
			if _, err := c.Read(sink[:]); err != nil {
				return
			}
		}
	})
	peer, err := Dial(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	h := Handle{ArenaID: "mute", Off: 0, Len: 4096}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := peer.View(cancelled, h); !errors.Is(err, context.Canceled) {
		t.Fatalf("View with cancelled ctx = %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := peer.View(ctx, h); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("View = %v, want deadline exceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("View took %v", d)
	}
	if _, err := peer.View(context.Background(), h); err == nil || !strings.Contains(err.Error(), "broken") {
		t.Fatalf("View on broken peer = %v", err)
	}
}

func TestServeStopsOnContext(t *testing.T) {
	a := newArena(t, 1<<20)
	srv, err := NewServer(a, DefaultServerConfig("ctx"))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, l) }()
	peer, err := Dial(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("Serve = %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after cancel")
	}
	if st := srv.Stats(); st.Peers != 0 {
		t.Fatalf("peers after Serve returned: %d", st.Peers)
	}
	srv.Close()
	l2, _ := net.ListenUnix("unix", &net.UnixAddr{Name: path + "2", Net: "unix"})
	if err := srv.Serve(context.Background(), l2); !errors.Is(err, ErrClosed) {
		t.Fatalf("Serve after Close = %v", err)
	}
}

func TestNewServerRejectsBadConfig(t *testing.T) {
	a := newArena(t, 1<<20)
	for _, mod := range []func(*ServerConfig){
		func(c *ServerConfig) { c.ArenaID = "" },
		func(c *ServerConfig) { c.ArenaID = strings.Repeat("x", MaxArenaIDLen+1) },
		func(c *ServerConfig) { c.MaxPinsPerPeer = 0 },
		func(c *ServerConfig) { c.HandshakeTimeout = 0 },
	} {
		cfg := DefaultServerConfig("ok")
		mod(&cfg)
		if _, err := NewServer(a, cfg); err == nil {
			t.Errorf("NewServer accepted %+v", cfg)
		}
	}
}

// TestCopyIntoAllocsIndependentOfSize: the heap cost of a transfer must not
// grow with the payload. Counted by hand because testing.AllocsPerRun pins
// GOMAXPROCS to 1, which would skip the parallel copy.
func TestCopyIntoAllocsIndependentOfSize(t *testing.T) {
	p := startProducer(t, 40<<20, nil)
	peer := dial(t, p)
	var allocs []float64
	for _, n := range []int64{64 << 10, 4 << 20, 32 << 20} {
		b, h := p.put(t, n, 1)
		dst := make([]byte, n)
		const runs = 20
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range runs {
			if err := peer.CopyInto(context.Background(), h, dst); err != nil {
				t.Fatal(err)
			}
		}
		runtime.ReadMemStats(&after)
		allocs = append(allocs, float64(after.Mallocs-before.Mallocs)/runs)
		eventually(t, "release", func() bool { return p.srv.Stats().Pins == 0 })
		p.a.Free(b)
	}
	t.Logf("allocs per CopyInto at 64 KiB, 4 MiB, 32 MiB (GOMAXPROCS %d): %v", runtime.GOMAXPROCS(0), allocs)
	for _, x := range allocs {
		if x > 16 {
			t.Errorf("allocs per CopyInto %v, want a small constant", allocs)
		}
	}
}

func TestNoForbiddenImports(t *testing.T) {
	pkg, err := build.ImportDir(".", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range pkg.Imports {
		if strings.HasPrefix(imp, "github.com/latentmesh/") && imp != "github.com/latentmesh/latentmesh/transfer/arena" {
			t.Errorf("shm imports %s; only transfer/arena is allowed", imp)
		}
	}
}

// fdTarget is what /proc/self/fd/<fd> links to.
func fdTarget(t *testing.T, fd int) string {
	t.Helper()
	s, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// fdsOpenOn counts this process's fds that link to one of targets.
func fdsOpenOn(t *testing.T, targets []string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		s, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err != nil {
			continue // the fd ReadDir itself used, closed by now
		}
		for _, tgt := range targets {
			if s == tgt {
				n++
			}
		}
	}
	return n
}
