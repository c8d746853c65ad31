//go:build rdma

package rdma

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

func TestAvailableNoDevice(t *testing.T) {
	ok, reason := Available()
	if ok {
		t.Skipf("an RDMA device is present (%s)", reason)
	}
	if !strings.HasPrefix(reason, "no RDMA device found") {
		t.Fatalf("reason %q", reason)
	}
	cfg := DefaultConfig()
	cfg.Device = "mlx5_99"
	if _, err := Open(cfg, nil); !errors.Is(err, ErrNoDevice) {
		t.Fatalf("Open(%q) = %v, want ErrNoDevice", cfg.Device, err)
	}
}

// mmapBuf maps anonymous memory outside the Go heap, as the arena does.
func mmapBuf(t *testing.T, n int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Munmap(b) })
	return b
}

// TestDeviceLoopback connects two queue pairs of one real device (soft-RoCE
// is enough) and reads between two mmap'd regions. It runs only where a
// device with an active port exists.
func TestDeviceLoopback(t *testing.T) {
	if ok, reason := Available(); !ok {
		t.Skip(reason)
	}
	for _, poll := range []PollStrategy{PollEvent, PollHybrid} {
		t.Run(poll.String(), func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.MaxWR = 64 << 10
			cfg.QueueDepth = 8
			cfg.Poll = poll
			if poll == PollHybrid {
				cfg.SpinTime = 50 * time.Microsecond
			}
			d, err := Open(cfg, zaptest.NewLogger(t))
			if errors.Is(err, ErrNoDevice) {
				t.Skip(err)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			const size = 4 << 20
			src, dst := mmapBuf(t, size), mmapBuf(t, size)
			for i := range src {
				src[i] = byte(i * 13)
			}
			srcMR, err := d.RegisterMemory(src)
			if err != nil {
				t.Fatal(err)
			}
			dstMR, err := d.RegisterMemory(dst)
			if err != nil {
				t.Fatal(err)
			}
			qa, err := d.NewQP()
			if err != nil {
				t.Fatal(err)
			}
			qb, err := d.NewQP()
			if err != nil {
				t.Fatal(err)
			}
			if err := qa.Connect(qb.Info()); err != nil {
				t.Fatal(err)
			}
			if err := qb.Connect(qa.Info()); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			chunks := 0
			if err := qa.ReadChunks(ctx, dstMR, 0, srcMR.MemInfo(), 0, size, 1<<20, func(int) { chunks++ }); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(src, dst) || chunks != 4 {
				t.Fatalf("data mismatch or %d chunks", chunks)
			}
			bad := srcMR.MemInfo()
			bad.RKey ^= 0xffff
			if err := qa.Read(ctx, dstMR, 0, bad, 0, 4096); !errors.Is(err, ErrCompletion) {
				t.Fatalf("read with a bad rkey: %v, want ErrCompletion", err)
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
