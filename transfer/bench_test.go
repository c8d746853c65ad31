package transfer

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
)

var benchSizes = []int64{4 << 20, 64 << 20, 256 << 20}

// BenchmarkPullTCP measures a full remote pull (ticket over libp2p, striped
// TCP, checksum) into a reused destination buffer.
func BenchmarkPullTCP(b *testing.B) {
	for _, size := range benchSizes {
		for _, conns := range []int{1, 4} {
			for _, sum := range []bool{true, false} {
				b.Run(fmt.Sprintf("size=%dMiB/conns=%d/checksum=%v", size>>20, conns, sum), func(b *testing.B) {
					cfg := testConfig(b)
					cfg.Conns = conns
					cfg.ChecksumTCP = sum
					prod := startService(b, cfg)
					cons := startService(b, cfg)
					ref, err := prod.Publish(u8Meta(size), randBytes(size, 1))
					if err != nil {
						b.Fatal(err)
					}
					dst := make([]byte, size)
					ctx := testCtx(b)
					if err := cons.PullInto(ctx, ref, dst); err != nil { // warm the pool
						b.Fatal(err)
					}
					b.SetBytes(size)
					b.ReportAllocs()
					b.ResetTimer()
					for b.Loop() {
						if err := cons.PullInto(ctx, ref, dst); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		}
	}
}

// BenchmarkRawTCP is the baseline: plain Go sockets, the same stripes over the
// same number of persistent connections, a 16-byte request per stripe and no
// tickets, deadlines or checksums.
func BenchmarkRawTCP(b *testing.B) {
	for _, size := range benchSizes {
		for _, conns := range []int{1, 4} {
			b.Run(fmt.Sprintf("size=%dMiB/conns=%d", size>>20, conns), func(b *testing.B) {
				src := randBytes(size, 1)
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					b.Fatal(err)
				}
				var wg sync.WaitGroup
				wg.Go(func() {
					for {
						c, err := ln.Accept()
						if err != nil {
							return
						}
						wg.Go(func() {
							defer c.Close()
							var q [16]byte
							for {
								if _, err := io.ReadFull(c, q[:]); err != nil {
									return
								}
								off, n := binary.BigEndian.Uint64(q[:8]), binary.BigEndian.Uint64(q[8:])
								if _, err := c.Write(src[off : off+n]); err != nil {
									return
								}
							}
						})
					}
				})
				cs := make([]net.Conn, conns)
				for i := range cs {
					if cs[i], err = net.Dial("tcp", ln.Addr().String()); err != nil {
						b.Fatal(err)
					}
				}
				defer func() {
					ln.Close()
					for _, c := range cs {
						c.Close()
					}
					wg.Wait()
				}()
				dst := make([]byte, size)
				per := size / int64(conns)
				stripe := func(i int) {
					off, n := int64(i)*per, per
					if i == conns-1 {
						n = size - off
					}
					var q [16]byte
					binary.BigEndian.PutUint64(q[:8], uint64(off))
					binary.BigEndian.PutUint64(q[8:], uint64(n))
					if _, err := cs[i].Write(q[:]); err != nil {
						panic(err)
					}
					if _, err := io.ReadFull(cs[i], dst[off:off+n]); err != nil {
						panic(err)
					}
				}
				b.SetBytes(size)
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					var sw sync.WaitGroup
					for i := range conns {
						sw.Go(func() { stripe(i) })
					}
					sw.Wait()
				}
			})
		}
	}
}

// benchArena is an arena for size-byte payloads: prefaulted, huge pages
// where the kernel allows, as agents run it.
func benchArenaConfig(b *testing.B, dir string, size int64) Config {
	cfg := arenaConfig(b, dir, size+(4<<20))
	cfg.Arena.HugePages = true
	cfg.Arena.Prefault = true
	return cfg
}

// BenchmarkShmPull measures a same-host pull in copy mode (ticket over
// libp2p, then a parallel copy from the producer's arena into the
// consumer's). BenchmarkMemcpy is its baseline.
func BenchmarkShmPull(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("size=%dMiB", size>>20), func(b *testing.B) {
			dir := shmDir(b)
			prod := startService(b, benchArenaConfig(b, dir, size))
			cons := startService(b, benchArenaConfig(b, dir, size))
			ref := publishArena(b, prod, u8Meta(size), randBytes(size, 1))
			dst, err := cons.Alloc(size)
			if err != nil {
				b.Fatal(err)
			}
			defer dst.Release()
			ctx := testCtx(b)
			if err := cons.PullInto(ctx, ref, dst.Bytes()); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(size)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := cons.PullInto(ctx, ref, dst.Bytes()); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkShmView measures a zero-copy handoff: ticket, pin, view, release.
// Its time does not depend on the size.
func BenchmarkShmView(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("size=%dMiB", size>>20), func(b *testing.B) {
			dir := shmDir(b)
			prod := startService(b, benchArenaConfig(b, dir, size))
			cons := startService(b, benchArenaConfig(b, dir, 1<<20))
			ref := publishArena(b, prod, u8Meta(size), randBytes(size, 1))
			ctx := testCtx(b)
			view, release, err := cons.PullView(ctx, ref) // dial and map once
			if err != nil || int64(len(view)) != size {
				b.Fatal(err)
			}
			release()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				view, release, err := cons.PullView(ctx, ref)
				if err != nil || int64(len(view)) != size {
					b.Fatal(err)
				}
				release()
			}
		})
	}
}

// BenchmarkMemcpy is the shm baseline: one copy between two prefaulted
// arenas' worth of memory, single-threaded as Go's copy is.
func BenchmarkMemcpy(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(fmt.Sprintf("size=%dMiB", size>>20), func(b *testing.B) {
			src, dst := randBytes(size, 1), make([]byte, size)
			copy(dst, src)
			b.SetBytes(size)
			for b.Loop() {
				copy(dst, src)
			}
		})
	}
}
