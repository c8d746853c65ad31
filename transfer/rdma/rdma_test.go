package rdma

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testConfig is DefaultConfig with small requests and a shallow queue, so
// small test buffers still make many work requests.
func testConfig() Config {
	cfg := DefaultConfig()
	cfg.MaxWR = 7
	cfg.QueueDepth = 3
	cfg.DrainTimeout = time.Second
	return cfg
}

// loopback opens a fake device with a source region holding a pattern, a
// zeroed destination region and two connected queue pairs.
type loopback struct {
	f        *memVerbs
	d        *Device
	src, dst *MR
	qa, qb   *QP
}

func newLoopback(t *testing.T, cfg Config, size int, tweak func(*memVerbs)) *loopback {
	t.Helper()
	f := newMemVerbs()
	if tweak != nil {
		tweak(f)
	}
	d := newDevice(cfg, zaptest.NewLogger(t), f, deviceLimits{})
	t.Cleanup(func() { _ = d.Close() })
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i*7 + 1)
	}
	l := &loopback{f: f, d: d}
	var err error
	if l.src, err = d.RegisterMemory(src); err != nil {
		t.Fatal(err)
	}
	if l.dst, err = d.RegisterMemory(make([]byte, size)); err != nil {
		t.Fatal(err)
	}
	if l.qa, err = d.NewQP(); err != nil {
		t.Fatal(err)
	}
	if l.qb, err = d.NewQP(); err != nil {
		t.Fatal(err)
	}
	if err := l.qa.Connect(l.qb.Info()); err != nil {
		t.Fatal(err)
	}
	if err := l.qb.Connect(l.qa.Info()); err != nil {
		t.Fatal(err)
	}
	return l
}

func (l *loopback) memQP(q *QP) *memQP { return q.q.(*memQP) }

func TestReadLoopback(t *testing.T) {
	cases := []struct {
		name                string
		size                int
		localOff, remoteOff int64
		n, chunkLen         int64
		reverse             bool
		wantChunks          int
	}{
		{name: "whole", size: 100, n: 100, wantChunks: 1},
		{name: "one byte", size: 100, remoteOff: 99, localOff: 0, n: 1, wantChunks: 1},
		{name: "offsets", size: 100, remoteOff: 10, localOff: 50, n: 45, wantChunks: 1},
		{name: "chunks", size: 100, n: 100, chunkLen: 25, wantChunks: 4},
		{name: "ragged chunks", size: 100, n: 100, chunkLen: 30, wantChunks: 4},
		{name: "out of order", size: 100, n: 100, chunkLen: 10, reverse: true, wantChunks: 10},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := newLoopback(t, testConfig(), tc.size, func(f *memVerbs) { f.reverse = tc.reverse })
			var got []int
			err := l.qa.ReadChunks(context.Background(), l.dst, tc.localOff, l.src.MemInfo(), tc.remoteOff, tc.n, tc.chunkLen,
				func(k int) { got = append(got, k) })
			if err != nil {
				t.Fatal(err)
			}
			want := l.src.Bytes()[tc.remoteOff : tc.remoteOff+tc.n]
			if !bytes.Equal(l.dst.Bytes()[tc.localOff:tc.localOff+tc.n], want) {
				t.Fatal("destination does not hold the source bytes")
			}
			slices.Sort(got)
			if len(got) != tc.wantChunks || got[0] != 0 || got[len(got)-1] != tc.wantChunks-1 {
				t.Fatalf("chunks reported %v, want 0..%d once each", got, tc.wantChunks-1)
			}
			if _, maxOut, out := l.memQP(l.qa).snapshot(); maxOut > 3 || out != 0 {
				t.Fatalf("max outstanding %d (depth 3), left outstanding %d", maxOut, out)
			}
		})
	}
}

func TestReadRepeatable(t *testing.T) {
	l := newLoopback(t, testConfig(), 64, nil)
	for i := range 3 {
		clear(l.dst.Bytes())
		if err := l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 64); err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		if !bytes.Equal(l.dst.Bytes(), l.src.Bytes()) {
			t.Fatalf("read %d: data mismatch", i)
		}
	}
}

func TestReadCompletionError(t *testing.T) {
	l := newLoopback(t, testConfig(), 100, func(f *memVerbs) { f.failWR = 4 })
	err := l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 100)
	if !errors.Is(err, ErrCompletion) || !errors.Is(err, ErrQPFailed) {
		t.Fatalf("err = %v, want ErrCompletion and ErrQPFailed", err)
	}
	if !strings.Contains(err.Error(), "remote operation error") {
		t.Fatalf("err %q lacks the completion status text", err)
	}
	mods, _, out := l.memQP(l.qa).snapshot()
	if last := mods[len(mods)-1]; last.To != StateError || out != 0 {
		t.Fatalf("last modify to %v, outstanding %d: want ERR and a drained queue", last.To, out)
	}
	err = l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 10)
	if !errors.Is(err, ErrQPFailed) {
		t.Fatalf("read on failed qp: %v, want ErrQPFailed", err)
	}
}

func TestReadBadRKey(t *testing.T) {
	l := newLoopback(t, testConfig(), 32, nil)
	mi := l.src.MemInfo()
	mi.RKey++
	if err := l.qa.Read(context.Background(), l.dst, 0, mi, 0, 32); !errors.Is(err, ErrCompletion) {
		t.Fatalf("err = %v, want ErrCompletion", err)
	}
}

func TestReadPostFailure(t *testing.T) {
	l := newLoopback(t, testConfig(), 100, func(f *memVerbs) { f.postCap = 5 })
	err := l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 100)
	if !errors.Is(err, ErrQPFailed) || !strings.Contains(err.Error(), "send queue full") {
		t.Fatalf("err = %v, want the post error", err)
	}
	if _, _, out := l.memQP(l.qa).snapshot(); out != 0 {
		t.Fatalf("%d work requests left outstanding", out)
	}
}

func TestReadCancelDrains(t *testing.T) {
	l := newLoopback(t, testConfig(), 100, func(f *memVerbs) { f.stall = true })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := l.qa.Read(ctx, l.dst, 0, l.src.MemInfo(), 0, 100)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrQPFailed) {
		t.Fatalf("err = %v, want DeadlineExceeded and ErrQPFailed", err)
	}
	if _, maxOut, out := l.memQP(l.qa).snapshot(); maxOut != 3 || out != 0 {
		t.Fatalf("max outstanding %d, left %d: want 3 posted and all flushed", maxOut, out)
	}
}

func TestCloseAbortsRead(t *testing.T) {
	l := newLoopback(t, testConfig(), 100, func(f *memVerbs) { f.stall = true })
	errc := make(chan error, 1)
	go func() { errc <- l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 100) }()
	waitFor(t, func() bool { _, m, _ := l.memQP(l.qa).snapshot(); return m > 0 })
	if err := l.qa.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("read err = %v, want ErrClosed", err)
	}
	if err := l.qa.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if err := l.qa.Read(context.Background(), l.dst, 0, l.src.MemInfo(), 0, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("read after close: %v", err)
	}
}

func TestReadRejects(t *testing.T) {
	l := newLoopback(t, testConfig(), 100, nil)
	fresh, err := l.d.NewQP()
	if err != nil {
		t.Fatal(err)
	}
	other := newDevice(testConfig(), nil, newMemVerbs(), deviceLimits{})
	defer other.Close()
	foreign, err := other.RegisterMemory(make([]byte, 100))
	if err != nil {
		t.Fatal(err)
	}
	mi := l.src.MemInfo()
	cases := []struct {
		name string
		qp   *QP
		mr   *MR
		lo   int64
		ro   int64
		n    int64
		want error
	}{
		{"not connected", fresh, l.dst, 0, 0, 10, ErrNotConnected},
		{"zero length", l.qa, l.dst, 0, 0, 0, ErrOutOfRange},
		{"local overrun", l.qa, l.dst, 95, 0, 10, ErrOutOfRange},
		{"negative local", l.qa, l.dst, -1, 0, 10, ErrOutOfRange},
		{"remote overrun", l.qa, l.dst, 0, 91, 10, ErrOutOfRange},
		{"negative remote", l.qa, l.dst, 0, -1, 10, ErrOutOfRange},
		{"foreign region", l.qa, foreign, 0, 0, 10, nil},
		{"nil region", l.qa, nil, 0, 0, 10, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.qp.Read(context.Background(), tc.mr, tc.lo, mi, tc.ro, tc.n)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
	if err := l.qa.Connect(l.qb.Info()); err == nil {
		t.Fatal("second Connect succeeded")
	}
}

func TestConnectTransitions(t *testing.T) {
	l := newLoopback(t, testConfig(), 8, nil)
	mods, _, _ := l.memQP(l.qa).snapshot()
	var path []QPState
	for _, m := range mods {
		path = append(path, m.To)
	}
	if !slices.Equal(path, []QPState{StateInit, StateRTR, StateRTS}) {
		t.Fatalf("modify path %v", path)
	}
	if got, want := mods[1].Attrs.DestQPN, l.qb.Info().QPN; got != want {
		t.Fatalf("RTR dest qpn %d, want the peer's %d", got, want)
	}
	if got, want := mods[2].Attrs.SQPSN, l.qa.Info().PSN; got != want {
		t.Fatalf("RTS sq psn %d, want own psn %d", got, want)
	}
}

func TestDeviceCloseOrder(t *testing.T) {
	f := newMemVerbs()
	d := newDevice(testConfig(), zaptest.NewLogger(t), f, deviceLimits{})
	mr, err := d.RegisterMemory(make([]byte, 8))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.NewQP(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if err := mr.Close(); err != nil {
		t.Fatalf("mr close after device close: %v", err)
	}
	want := []string{"close qp 17", "dereg 101", "close device"}
	if !slices.Equal(f.events, want) {
		t.Fatalf("release order %v, want %v", f.events, want)
	}
	if _, err := d.RegisterMemory(make([]byte, 8)); !errors.Is(err, ErrClosed) {
		t.Fatalf("register after close: %v", err)
	}
	if _, err := d.NewQP(); !errors.Is(err, ErrClosed) {
		t.Fatalf("new qp after close: %v", err)
	}
}

func TestDeviceClampsConfig(t *testing.T) {
	cfg := DefaultConfig()
	d := newDevice(cfg, nil, newMemVerbs(), deviceLimits{MaxQPWR: 16, MaxMsg: 1 << 16, MaxRdAtom: 4, ActiveMTU: 3})
	defer d.Close()
	got := d.Config()
	if got.QueueDepth != 16 || got.MaxWR != 1<<16 || got.ReadAtomic != 4 || got.MTU != 1024 {
		t.Fatalf("clamped config %+v", got)
	}
	if d.Name() != "fake0" {
		t.Fatalf("name %q", d.Name())
	}
}

func TestOpenRejectsBadConfig(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Port = 0
	if _, err := Open(cfg, nil); !errors.Is(err, ErrBadConfig) {
		t.Fatalf("err = %v, want ErrBadConfig", err)
	}
}

// TestNoDeviceFallback is the path every host without RDMA takes, with or
// without the rdma tag: Available says why, Open fails with ErrNoDevice.
func TestNoDeviceFallback(t *testing.T) {
	ok, reason := Available()
	if ok {
		t.Skipf("an RDMA device is present (%s)", reason)
	}
	if reason == "" {
		t.Fatal("Available gave no reason")
	}
	d, err := Open(DefaultConfig(), zaptest.NewLogger(t))
	if !errors.Is(err, ErrNoDevice) || d != nil {
		t.Fatalf("Open = %v, %v; want nil, ErrNoDevice", d, err)
	}
	if !strings.Contains(err.Error(), reason) {
		t.Fatalf("Open error %q does not carry the reason %q", err, reason)
	}
}

// waitFor polls cond with a bounded backoff for up to five seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	delay := time.Millisecond
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); delay = min(2*delay, 50*time.Millisecond) {
		if cond() {
			return
		}
		time.Sleep(delay)
	}
	t.Fatal("condition not met within 5s")
}

// A region registered with RegisterLocal is a valid destination but no peer
// can read it through its rkey: the READ completes with a remote access
// error, as on hardware without IBV_ACCESS_REMOTE_READ.
func TestRegisterLocalNotRemotelyReadable(t *testing.T) {
	l := newLoopback(t, testConfig(), 64, nil)
	local, err := l.d.RegisterLocal(make([]byte, 64))
	if err != nil {
		t.Fatal(err)
	}
	if err := l.qa.Read(context.Background(), local, 0, l.src.MemInfo(), 0, 64); err != nil {
		t.Fatalf("read into a local-only region: %v", err)
	}
	if local.Bytes()[5] != l.src.Bytes()[5] {
		t.Fatal("read into a local-only region delivered nothing")
	}
	err = l.qb.Read(context.Background(), l.dst, 0, local.MemInfo(), 0, 64)
	if !errors.Is(err, ErrCompletion) {
		t.Fatalf("remote read of a local-only region: %v, want a completion error", err)
	}
}
