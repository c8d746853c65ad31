package shm

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// Piece sizes for parallelCopy: pieces of at least 1 MiB keep per-piece
// overhead negligible; at most 8 MiB, and about four per worker, so a worker
// slowed by a busy core does not leave the others idle at the end.
// maxWorkers caps the goroutines: a handful of cores saturate a socket's
// memory bandwidth, more only contend with the engines.
const (
	minPiece   = 1 << 20
	maxPiece   = 8 << 20
	maxWorkers = 8
)

// parallelCopy copies src into dst (equal lengths) in pieces spread across
// up to min(GOMAXPROCS, maxWorkers) goroutines, the caller's included. It allocates the same
// small amount whatever the size and checks ctx between pieces.
func parallelCopy(ctx context.Context, dst, src []byte) error {
	n := len(src)
	workers := min(runtime.GOMAXPROCS(0), maxWorkers)
	if n < 2*minPiece || workers == 1 {
		copy(dst, src)
		return ctx.Err()
	}
	piece := min(max(n/(workers*4), minPiece), maxPiece)
	piece = (piece + 4095) &^ 4095
	pieces := (n + piece - 1) / piece
	workers = min(workers, pieces)

	var next atomic.Int64
	done := ctx.Done()
	work := func() {
		for {
			i := int(next.Add(1) - 1)
			if i >= pieces {
				return
			}
			if done != nil {
				select {
				case <-done:
					return
				default:
				}
			}
			lo := i * piece
			hi := min(lo+piece, n)
			copy(dst[lo:hi], src[lo:hi])
		}
	}
	var wg sync.WaitGroup
	for range workers - 1 {
		wg.Go(work)
	}
	work()
	wg.Wait()
	return ctx.Err()
}

// Copy copies src into dst (equal lengths) the way CopyInto does, in pieces
// spread over up to min(GOMAXPROCS, 8) goroutines, for callers that hold a
// View and copy parts of it as they become ready.
func Copy(ctx context.Context, dst, src []byte) error {
	if len(dst) != len(src) {
		return fmt.Errorf("%w: dst is %d bytes, src %d", ErrBadHandle, len(dst), len(src))
	}
	return parallelCopy(ctx, dst, src)
}
