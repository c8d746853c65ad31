package shm

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

var benchSizes = []int64{4 << 20, 64 << 20, 256 << 20}

// benchPair is a producer with one payload of n bytes, a consumer dialled to
// it, and a prefaulted destination buffer in the consumer's own arena.
func benchPair(b *testing.B, n int64) (*producer, *Peer, Handle, []byte) {
	p := startProducer(b, n+(1<<20), nil)
	_, h := p.put(b, n, 5)
	peer := dial(b, p)
	dstArena := newArena(b, n+(1<<20))
	db, err := dstArena.Alloc(n)
	if err != nil {
		b.Fatal(err)
	}
	return p, peer, h, dstArena.Slice(db)
}

// BenchmarkMemcpy is the baseline: one copy() between two prefaulted arena
// buffers on one goroutine.
func BenchmarkMemcpy(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			a := newArena(b, 2*n+(1<<20))
			sb, _ := a.Alloc(n)
			db, _ := a.Alloc(n)
			src, dst := a.Slice(sb), a.Slice(db)
			for i := range src {
				src[i] = byte(i)
			}
			b.SetBytes(n)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				copy(dst, src)
			}
		})
	}
}

// BenchmarkShmCopyInto is copy mode: pin, parallel copy from the producer's
// arena (mapped read-only) into the consumer's arena, release.
func BenchmarkShmCopyInto(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			_, peer, h, dst := benchPair(b, n)
			ctx := context.Background()
			b.SetBytes(n)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := peer.CopyInto(ctx, h, dst); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkShmView is zero-copy handoff latency: pin round trip plus release.
// It reports the median and p99 of View alone.
func BenchmarkShmView(b *testing.B) {
	for _, n := range []int64{4 << 20, 256 << 20} {
		b.Run(sizeName(n), func(b *testing.B) {
			_, peer, h, _ := benchPair(b, n)
			ctx := context.Background()
			lat := make([]time.Duration, 0, 1<<20)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				start := time.Now()
				v, err := peer.View(ctx, h)
				if err != nil {
					b.Fatal(err)
				}
				if len(lat) < cap(lat) {
					lat = append(lat, time.Since(start))
				}
				_ = v[len(v)-1]
				if err := peer.Release(h); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			slices.Sort(lat)
			if len(lat) > 0 {
				b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
				b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
			}
		})
	}
}

func sizeName(n int64) string { return fmt.Sprintf("%dMiB", n>>20) }

// BenchmarkShmCopyRatio interleaves a baseline copy() and a CopyInto of the
// same size every iteration, so load from other processes hits both alike,
// and reports CopyInto throughput as a fraction of the baseline's.
func BenchmarkShmCopyRatio(b *testing.B) {
	for _, n := range benchSizes {
		b.Run(sizeName(n), func(b *testing.B) {
			_, peer, h, dst := benchPair(b, n)
			base := newArena(b, 2*n+(1<<20))
			sb, _ := base.Alloc(n)
			db, _ := base.Alloc(n)
			bsrc, bdst := base.Slice(sb), base.Slice(db)
			ctx := context.Background()
			var tBase, tShm time.Duration
			b.SetBytes(2 * n)
			b.ResetTimer()
			for b.Loop() {
				start := time.Now()
				copy(bdst, bsrc)
				mid := time.Now()
				if err := peer.CopyInto(ctx, h, dst); err != nil {
					b.Fatal(err)
				}
				tBase += mid.Sub(start)
				tShm += time.Since(mid)
			}
			b.ReportMetric(float64(tBase)/float64(tShm), "shm/memcpy")
		})
	}
}
