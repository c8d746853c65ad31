package arena

import (
	"bytes"
	"errors"
	"fmt"
	"go/build"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newTestArena(t *testing.T, size, align int64) *Arena {
	t.Helper()
	cfg := DefaultTestConfig()
	cfg.Size, cfg.Align = size, align
	a, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := a.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return a
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"zero size", func(c *Config) { c.Size = 0 }},
		{"negative size", func(c *Config) { c.Size = -1 }},
		{"align not power of two", func(c *Config) { c.Align = 3000 }},
		{"align zero", func(c *Config) { c.Align = 0 }},
		{"align too big", func(c *Config) { c.Align = 1 << 31 }},
		{"name with NUL", func(c *Config) { c.Name = "a\x00b" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultTestConfig()
			tc.mod(&cfg)
			a, err := New(cfg)
			if !errors.Is(err, ErrBadConfig) {
				if a != nil {
					a.Close()
				}
				t.Fatalf("New = %v, want ErrBadConfig", err)
			}
		})
	}
}

func TestAllocAlignment(t *testing.T) {
	for _, tc := range []struct {
		align int64
		sizes []int64
	}{
		{1, []int64{1, 3, 7, 100}},
		{256, []int64{1, 255, 256, 257, 1000}},
		{4096, []int64{1, 4095, 4096, 4097, 12345}},
		{1 << 20, []int64{1, 1 << 20, 1<<20 + 1}},
	} {
		t.Run(fmt.Sprint(tc.align), func(t *testing.T) {
			a := newTestArena(t, 8<<20, tc.align)
			var used int64
			for _, n := range tc.sizes {
				b, err := a.Alloc(n)
				if err != nil {
					t.Fatalf("Alloc(%d): %v", n, err)
				}
				if b.Off%tc.align != 0 {
					t.Errorf("Alloc(%d).Off = %d, not aligned to %d", n, b.Off, tc.align)
				}
				if b.Len != n {
					t.Errorf("Alloc(%d).Len = %d", n, b.Len)
				}
				if got := len(a.Slice(b)); int64(got) != n {
					t.Errorf("len(Slice) = %d, want %d", got, n)
				}
				used += roundUp(n, tc.align)
			}
			if s := a.Stats(); s.Used != used || s.Used+s.Free != s.Size {
				t.Errorf("stats %+v, want used %d", s, used)
			}
		})
	}
}

func TestAllocRejectsNonPositive(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	for _, n := range []int64{0, -1} {
		if _, err := a.Alloc(n); err == nil {
			t.Errorf("Alloc(%d) succeeded", n)
		}
	}
}

func TestExhaustion(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	if _, err := a.Alloc(1<<20 + 1); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("oversize Alloc = %v, want ErrNoSpace", err)
	}
	var bufs []Buf
	for {
		b, err := a.Alloc(64 << 10)
		if errors.Is(err, ErrNoSpace) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
	}
	if len(bufs) != 16 {
		t.Fatalf("got %d 64 KiB buffers from 1 MiB, want 16", len(bufs))
	}
	if s := a.Stats(); s.Free != 0 || s.FreeBlocks != 0 || s.LargestFree != 0 {
		t.Fatalf("full arena stats %+v", s)
	}
	if err := a.Free(bufs[3]); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Alloc(64<<10 + 1); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Alloc larger than the one hole = %v, want ErrNoSpace", err)
	}
	if b, err := a.Alloc(64 << 10); err != nil || b.Off != bufs[3].Off {
		t.Fatalf("Alloc into hole = %+v, %v; want off %d", b, err, bufs[3].Off)
	}
}

// TestCoalescing frees four adjacent blocks in every order and checks that
// the arena ends as one free block each time.
func TestCoalescing(t *testing.T) {
	for _, order := range permutations([]int{0, 1, 2, 3}) {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			a := newTestArena(t, 4*4096, 4096)
			bufs := make([]Buf, 4)
			for i := range bufs {
				var err error
				if bufs[i], err = a.Alloc(4096); err != nil {
					t.Fatal(err)
				}
			}
			for _, i := range order {
				if err := a.Free(bufs[i]); err != nil {
					t.Fatal(err)
				}
				checkInvariants(t, a)
			}
			s := a.Stats()
			if s.FreeBlocks != 1 || s.LargestFree != s.Size || s.Used != 0 || s.Allocs != 0 {
				t.Fatalf("after freeing all: %+v", s)
			}
		})
	}
}

func TestFragmentationStats(t *testing.T) {
	a := newTestArena(t, 8*4096, 4096)
	bufs := make([]Buf, 8)
	for i := range bufs {
		bufs[i], _ = a.Alloc(4096)
	}
	if f := a.Stats().Fragmentation(); f != 0 {
		t.Fatalf("full arena fragmentation = %v, want 0", f)
	}
	// Free every other block: 4 separate 1-page holes.
	for i := 0; i < 8; i += 2 {
		if err := a.Free(bufs[i]); err != nil {
			t.Fatal(err)
		}
	}
	s := a.Stats()
	if s.FreeBlocks != 4 || s.Free != 4*4096 || s.LargestFree != 4096 {
		t.Fatalf("stats %+v", s)
	}
	if f := s.Fragmentation(); f != 0.75 {
		t.Fatalf("fragmentation = %v, want 0.75", f)
	}
	// Freeing block 1 joins holes 0 and 2.
	if err := a.Free(bufs[1]); err != nil {
		t.Fatal(err)
	}
	s = a.Stats()
	if s.FreeBlocks != 3 || s.LargestFree != 3*4096 {
		t.Fatalf("stats %+v", s)
	}
	if f, want := s.Fragmentation(), 1-3.0/5.0; f != want {
		t.Fatalf("fragmentation = %v, want %v", f, want)
	}
}

func TestBestFit(t *testing.T) {
	a := newTestArena(t, 16*4096, 4096)
	// Layout: [A 4 pages][B 1][C 2 pages][D 1][rest 8]. Free A and C: holes of 4 and 2.
	sizes := []int64{4, 1, 2, 1}
	bufs := make([]Buf, len(sizes))
	for i, n := range sizes {
		bufs[i], _ = a.Alloc(n * 4096)
	}
	a.Free(bufs[0])
	a.Free(bufs[2])
	b, err := a.Alloc(2 * 4096)
	if err != nil || b.Off != bufs[2].Off {
		t.Fatalf("Alloc(2 pages) = %+v, %v; want the 2-page hole at %d", b, err, bufs[2].Off)
	}
}

func TestDoubleAndForeignFree(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	b, _ := a.Alloc(10000)
	other, _ := a.Alloc(4096)
	for _, tc := range []struct {
		name string
		buf  Buf
	}{
		{"wrong offset", Buf{Off: b.Off + 4096, Len: b.Len, Gen: b.Gen}},
		{"wrong len", Buf{Off: b.Off, Len: b.Len - 1, Gen: b.Gen}},
		{"wrong gen", Buf{Off: b.Off, Len: b.Len, Gen: b.Gen + 100}},
		{"never allocated", Buf{Off: 512 << 10, Len: 4096, Gen: 1}},
		{"negative", Buf{Off: -4096, Len: 4096, Gen: 1}},
	} {
		if err := a.Free(tc.buf); !errors.Is(err, ErrBadBuf) {
			t.Errorf("%s: Free = %v, want ErrBadBuf", tc.name, err)
		}
	}
	before := a.Stats()
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); !errors.Is(err, ErrBadBuf) {
		t.Fatalf("double Free = %v, want ErrBadBuf", err)
	}
	// The same region reallocated at the same size: the stale Buf must not free it.
	b2, _ := a.Alloc(10000)
	if b2.Off != b.Off {
		t.Fatalf("expected reuse of offset %d, got %d", b.Off, b2.Off)
	}
	if err := a.Free(b); !errors.Is(err, ErrBadBuf) {
		t.Fatalf("stale Free = %v, want ErrBadBuf", err)
	}
	if s := a.Stats(); s.Used != before.Used || s.Allocs != 2 {
		t.Fatalf("stats changed by bad frees: %+v vs %+v", s, before)
	}
	if err := a.Free(other); err != nil {
		t.Fatal(err)
	}
	checkInvariants(t, a)
}

func TestPinDefersFree(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	b, _ := a.Alloc(8192)
	if err := a.Unpin(b); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("Unpin unpinned = %v", err)
	}
	if err := a.Pin(b); err != nil {
		t.Fatal(err)
	}
	if err := a.Pin(b); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	s := a.Stats()
	if s.PendingFree != 1 || s.Pinned != 1 || s.Used != 8192 {
		t.Fatalf("after Free of pinned: %+v", s)
	}
	if err := a.Pin(b); !errors.Is(err, ErrBadBuf) {
		t.Fatalf("Pin of freed buffer = %v, want ErrBadBuf", err)
	}
	if err := a.Free(b); !errors.Is(err, ErrBadBuf) {
		t.Fatalf("second Free of pinned = %v, want ErrBadBuf", err)
	}
	if err := a.Unpin(b); err != nil {
		t.Fatal(err)
	}
	if s := a.Stats(); s.Used != 8192 {
		t.Fatalf("released with a pin left: %+v", s)
	}
	if err := a.Unpin(b); err != nil {
		t.Fatal(err)
	}
	if s := a.Stats(); s.Used != 0 || s.PendingFree != 0 || s.Pinned != 0 || s.FreeBlocks != 1 {
		t.Fatalf("after last Unpin: %+v", s)
	}
	if err := a.Unpin(b); !errors.Is(err, ErrBadBuf) {
		t.Fatalf("Unpin after release = %v, want ErrBadBuf", err)
	}
}

// TestRandomAllocFree runs random allocs and frees against a model and checks
// that live buffers never overlap, stay aligned and keep their contents.
func TestRandomAllocFree(t *testing.T) {
	const size, align = 4 << 20, 256
	a := newTestArena(t, size, align)
	rng := rand.New(rand.NewPCG(1, 2))
	var live []Buf
	for step := 0; step < 20000; step++ {
		if len(live) > 0 && rng.IntN(100) < 45 {
			i := rng.IntN(len(live))
			b := live[i]
			want := byte(b.Gen)
			for _, c := range a.Slice(b) {
				if c != want {
					t.Fatalf("step %d: buffer %+v overwritten", step, b)
				}
			}
			if err := a.Free(b); err != nil {
				t.Fatalf("step %d: Free(%+v): %v", step, b, err)
			}
			live[i] = live[len(live)-1]
			live = live[:len(live)-1]
			continue
		}
		n := 1 + rng.Int64N(64<<10)
		b, err := a.Alloc(n)
		if errors.Is(err, ErrNoSpace) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if b.Off%align != 0 || b.Off+roundUp(n, align) > size {
			t.Fatalf("bad buffer %+v", b)
		}
		s := a.Slice(b)
		for i := range s {
			s[i] = byte(b.Gen)
		}
		live = append(live, b)
		if step%500 == 0 {
			checkNoOverlap(t, live, align)
			checkInvariants(t, a)
		}
	}
	checkNoOverlap(t, live, align)
	for _, b := range live {
		if err := a.Free(b); err != nil {
			t.Fatal(err)
		}
	}
	if s := a.Stats(); s.FreeBlocks != 1 || s.Free != size {
		t.Fatalf("after freeing everything: %+v", s)
	}
}

func TestAllocHeapIndependentOfSize(t *testing.T) {
	a := newTestArena(t, 64<<20, 4096)
	for _, n := range []int64{4096, 32 << 20} {
		allocs := testing.AllocsPerRun(100, func() {
			b, err := a.Alloc(n)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Free(b); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 2 {
			t.Errorf("Alloc+Free of %d bytes: %v heap allocs", n, allocs)
		}
	}
}

func TestMemfdVisibleThroughSecondMapping(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	b, _ := a.Alloc(1000)
	copy(a.Slice(b), "hello from the arena")
	m, err := Map(a.Fd(), a.Size(), ReadOnly)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	got := m.Bytes()[b.Off : b.Off+b.Len]
	if !bytes.HasPrefix(got, []byte("hello from the arena")) {
		t.Fatalf("second mapping sees %q", got[:20])
	}
	// Writes after mapping show up too: it is the same memory.
	a.Slice(b)[0] = 'J'
	if got[0] != 'J' {
		t.Fatalf("write not visible through second mapping")
	}
	rw, err := Map(a.Fd(), a.Size(), ReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	rw.Bytes()[b.Off+1] = 'E'
	if a.Slice(b)[1] != 'E' {
		t.Fatalf("write through ReadWrite mapping not visible in arena")
	}
	if err := rw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := rw.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestMapRejects(t *testing.T) {
	a := newTestArena(t, 1<<20, 4096)
	if _, err := Map(a.Fd(), a.Size()+4096, ReadOnly); !errors.Is(err, ErrBadFd) {
		t.Errorf("wrong size: %v", err)
	}
	if _, err := Map(a.Fd(), 0, ReadOnly); !errors.Is(err, ErrBadFd) {
		t.Errorf("zero size: %v", err)
	}
	if _, err := Map(-1, a.Size(), ReadOnly); !errors.Is(err, ErrBadFd) {
		t.Errorf("bad fd: %v", err)
	}
	f, err := createUnsealed(t, a.Size())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Map(f, a.Size(), ReadOnly); !errors.Is(err, ErrBadFd) {
		t.Errorf("unsealed memfd: %v", err)
	}
}

func TestCloseIdempotent(t *testing.T) {
	a, err := New(DefaultTestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := a.Alloc(1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Alloc after Close = %v", err)
	}
}

func TestPrefaultAndHugePages(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Size = 8 << 20
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s := a.Stats()
	if !s.Prefaulted {
		t.Errorf("not prefaulted")
	}
	if s.HugePages != (s.PageMode != PageBase) {
		t.Errorf("inconsistent page stats %+v", s)
	}
	t.Logf("page mode on this host: %s (size %d)", s.PageMode, s.Size)
	mem := a.Bytes()
	mem[0], mem[len(mem)-1] = 1, 2
}

// TestNoForbiddenImports keeps the arena at the bottom of the stack.
func TestNoForbiddenImports(t *testing.T) {
	pkg, err := build.ImportDir(".", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range pkg.Imports {
		if strings.HasPrefix(imp, "github.com/latentmesh/") {
			t.Errorf("arena imports %s; it must not depend on other latentmesh packages", imp)
		}
	}
}

func checkNoOverlap(t *testing.T, live []Buf, align int64) {
	t.Helper()
	s := append([]Buf(nil), live...)
	sort.Slice(s, func(i, j int) bool { return s[i].Off < s[j].Off })
	for i := 1; i < len(s); i++ {
		if s[i-1].Off+roundUp(s[i-1].Len, align) > s[i].Off {
			t.Fatalf("overlap: %+v and %+v", s[i-1], s[i])
		}
	}
}

// checkInvariants verifies the free list: sorted, non-adjacent, within
// bounds, and covering exactly what the live set does not.
func checkInvariants(t *testing.T, a *Arena) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	al := &a.alloc
	var free int64
	for i, e := range al.free {
		if e.size <= 0 || e.off < 0 || e.off+e.size > al.size || e.off%al.align != 0 {
			t.Fatalf("bad extent %+v", e)
		}
		if i > 0 && al.free[i-1].off+al.free[i-1].size >= e.off {
			t.Fatalf("extents %+v and %+v overlap or touch", al.free[i-1], e)
		}
		free += e.size
	}
	var used int64
	for _, x := range al.live {
		used += x.size
	}
	if used != al.used || free+used != al.size {
		t.Fatalf("accounting: free %d used %d (tracked %d) size %d", free, used, al.used, al.size)
	}
}

func permutations(xs []int) [][]int {
	if len(xs) <= 1 {
		return [][]int{append([]int(nil), xs...)}
	}
	var out [][]int
	for i := range xs {
		rest := append(append([]int(nil), xs[:i]...), xs[i+1:]...)
		for _, p := range permutations(rest) {
			out = append(out, append([]int{xs[i]}, p...))
		}
	}
	return out
}
