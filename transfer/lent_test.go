package transfer

import (
	"bytes"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
)

// lent is memory handed to PublishLent whose free counts its calls and
// poisons the bytes, so a read after free shows as corrupt data.
type lent struct {
	data  []byte
	freed atomic.Int32
}

func newLent(n int64, seed uint64) *lent { return &lent{data: randBytes(n, seed)} }

func (l *lent) free() {
	l.freed.Add(1)
	for i := range l.data {
		l.data[i] = 0xAA
	}
}

func TestPublishLentFreedOnceAfterRelease(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	ctx := testCtx(t)
	l := newLent(1<<20+7, 1)
	want := bytes.Clone(l.data)
	ref, err := prod.PublishLent(u8Meta(int64(len(l.data))), l.data, l.free)
	if err != nil {
		t.Fatal(err)
	}
	// Pulls, remote and local, leave the memory lent.
	got, err := cons.Pull(ctx, ref)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("remote pull: %v", err)
	}
	dst := make([]byte, len(want))
	if err := prod.PullInto(ctx, ref, dst); err != nil || !bytes.Equal(dst, want) {
		t.Fatalf("local pull: %v", err)
	}
	if n := l.freed.Load(); n != 0 {
		t.Fatalf("freed %d times before Release", n)
	}
	prod.Release(ref.ID)
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times after Release with no reader, want 1", n)
	}
	if _, err := cons.Pull(ctx, ref); !errors.Is(err, ErrNotFound) {
		t.Fatalf("pull after release = %v, want ErrNotFound", err)
	}
	prod.Release(ref.ID)
	prod.Close()
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times after a second Release and Close, want 1", n)
	}
}

// A transfer reading lent memory holds off its free past Release; the
// last reader frees it.
func TestPublishLentFreeWaitsForReader(t *testing.T) {
	prod := startService(t, testConfig(t))
	l := newLent(4096, 2)
	ref, err := prod.PublishLent(u8Meta(4096), l.data, l.free)
	if err != nil {
		t.Fatal(err)
	}
	e := prod.reg.get(ref.ID)
	if err := e.pin(); err != nil { // as a data connection serving a range does
		t.Fatal(err)
	}
	if err := e.pin(); err != nil {
		t.Fatal(err)
	}
	prod.Release(ref.ID)
	if n := l.freed.Load(); n != 0 {
		t.Fatalf("freed %d times while read", n)
	}
	if err := e.pin(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("pin after release = %v, want ErrNotFound", err)
	}
	e.unpin()
	if n := l.freed.Load(); n != 0 {
		t.Fatalf("freed %d times with a reader left", n)
	}
	e.unpin()
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times after the last reader, want 1", n)
	}
}

// Pulls racing a Release either get the right bytes or ErrNotFound; the
// memory is freed once, after the last of them.
func TestPublishLentReleaseDuringPulls(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 256 << 10 // several ranges per pull: releases land between them
	prod := startService(t, cfg)
	cons := startService(t, cfg)
	ctx := testCtx(t)
	l := newLent(4<<20, 3)
	want := bytes.Clone(l.data)
	ref, err := prod.PublishLent(u8Meta(int64(len(l.data))), l.data, l.free)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	started := make(chan struct{}, 4)
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			started <- struct{}{}
			dst := make([]byte, len(want))
			if errs[i] = cons.PullInto(ctx, ref, dst); errs[i] == nil && !bytes.Equal(dst, want) {
				errs[i] = errors.New("pulled bytes differ")
			}
		})
	}
	for range errs {
		<-started
	}
	prod.Release(ref.ID)
	wg.Wait()
	for i, err := range errs {
		if err != nil && !errors.Is(err, ErrNotFound) {
			t.Errorf("pull %d: %v", i, err)
		}
	}
	eventually(t, "lent memory freed", func() bool { return l.freed.Load() == 1 })
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times", n)
	}
}

// Closing an arena service frees what is still lent.
func TestPublishLentFreedOnClose(t *testing.T) {
	prod := startService(t, arenaConfig(t, shmDir(t), 1<<20))
	l := newLent(4096, 4)
	if _, err := prod.PublishLent(u8Meta(4096), l.data, l.free); err != nil {
		t.Fatal(err)
	}
	prod.Close()
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times on Close, want 1", n)
	}
}

// A lent payload of a service with an arena lies outside it: a same-host
// consumer with an arena still gets it (by tcp).
func TestPublishLentSameHostArena(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 1<<20))
	cons := startService(t, arenaConfig(t, dir, 1<<20))
	l := newLent(64<<10, 5)
	want := bytes.Clone(l.data)
	ref, err := prod.PublishLent(u8Meta(int64(len(want))), l.data, l.free)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cons.Pull(testCtx(t), ref)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("pull: %v", err)
	}
}

func TestPublishLentRefusedFreesAtOnce(t *testing.T) {
	prod := startService(t, testConfig(t))
	for _, tc := range []struct {
		name string
		meta TensorMeta
		n    int
		want error
	}{
		{"BadDType", TensorMeta{DType: "int4", Shape: []int64{16}}, 16, ErrBadMeta},
		{"NoShape", TensorMeta{DType: Uint8}, 16, ErrBadMeta},
		{"SizeMismatch", u8Meta(32), 16, ErrBufferSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLent(int64(tc.n), 6)
			_, err := prod.PublishLent(tc.meta, l.data, l.free)
			if !errors.Is(err, tc.want) {
				t.Fatalf("PublishLent = %v, want %v", err, tc.want)
			}
			if n := l.freed.Load(); n != 1 {
				t.Fatalf("freed %d times, want 1", n)
			}
		})
	}
	if _, err := prod.PublishLent(u8Meta(4), make([]byte, 4), nil); err == nil {
		t.Fatal("PublishLent without a free function accepted")
	}
	if held, _ := prod.Held(); held != 0 {
		t.Fatalf("refused publishes left %d payloads", held)
	}
	prod.Close()
	l := newLent(16, 7)
	if _, err := prod.PublishLent(u8Meta(16), l.data, l.free); !errors.Is(err, ErrClosed) {
		t.Fatalf("PublishLent on a closed service = %v, want ErrClosed", err)
	}
	if n := l.freed.Load(); n != 1 {
		t.Fatalf("freed %d times after a refused publish on a closed service, want 1", n)
	}
}
