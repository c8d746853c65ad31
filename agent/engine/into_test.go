package engine

import (
	"bytes"
	"context"
	"errors"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// dirty is a buffer of n bytes of junk, as a reused arena slot would hold.
func dirty(n int) []byte { return bytes.Repeat([]byte{0xa5}, n) }

func TestIntoMatchesAllocating(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	cases := []struct {
		name string
		s    Spec
	}{
		{"image", small("a lighthouse at dusk", 42)},
		{"wide image", Spec{Prompt: "a kite", NegativePrompt: "rain", Seed: 3, Width: 96, Height: 64, Frames: 1, Steps: 3, GuidanceScale: 7}},
		{"video", Spec{Prompt: "waves", Seed: -3, Width: 64, Height: 72, Frames: 3, Steps: 4, GuidanceScale: 7}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cond, err := e.Encode(ctx, tc.s)
			if err != nil {
				t.Fatal(err)
			}
			cdst := dirty(len(cond.Data))
			cmeta, err := e.EncodeInto(ctx, tc.s, cdst)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(cdst, cond.Data) || !metaEqual(cmeta, cond.Meta) {
				t.Fatal("EncodeInto differs from Encode")
			}
			lat, err := e.Denoise(ctx, tc.s, cond, nil)
			if err != nil {
				t.Fatal(err)
			}
			ldst := dirty(len(lat.Data))
			lmeta, err := e.DenoiseInto(ctx, tc.s, Tensor{Meta: cmeta, Data: cdst}, ldst, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(ldst, lat.Data) || !metaEqual(lmeta, lat.Meta) {
				t.Fatal("DenoiseInto differs from Denoise")
			}
		})
	}
}

func metaEqual(a, b transfer.TensorMeta) bool {
	return a.DType == b.DType && slices.Equal(a.Shape, b.Shape) && a.ChunkDim == b.ChunkDim && a.NumChunks == b.NumChunks
}

// TestDenoiseIntoChunkDone checks that chunks are reported once each, in
// order, during the last step, each holding its final bytes when reported
// while the frames after it are still unwritten.
func TestDenoiseIntoChunkDone(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	for _, frames := range []int{1, 4} {
		s := Spec{Prompt: "a comet", Seed: 9, Width: 64, Height: 64, Frames: frames, Steps: 4, GuidanceScale: 5}
		cond, _ := e.Encode(ctx, s)
		ref, err := e.Denoise(ctx, s, cond, nil)
		if err != nil {
			t.Fatal(err)
		}
		meta := e.LatentMeta(s)
		junk := dirty(len(ref.Data))
		dst := slices.Clone(junk)
		var done []int
		steps := 0
		_, err = e.DenoiseInto(ctx, s, cond, dst, func(step, total int) {
			steps = step
			if step == total && len(done) != frames {
				t.Errorf("%d frames: final progress after %d chunks", frames, len(done))
			}
		}, func(k int) {
			if steps != s.Steps-1 {
				t.Errorf("%d frames: chunk %d reported after step %d, want during the last", frames, k, steps)
			}
			if k != len(done) {
				t.Errorf("%d frames: chunk %d reported after %v", frames, k, done)
			}
			done = append(done, k)
			for j := range meta.Chunks() {
				off, n := meta.ChunkRange(j)
				final := bytes.Equal(dst[off:off+n], ref.Data[off:off+n])
				untouched := bytes.Equal(dst[off:off+n], junk[off:off+n])
				switch {
				case j <= k && !final:
					t.Errorf("%d frames: at chunkDone(%d) chunk %d is not final", frames, k, j)
				case j > k && !untouched:
					t.Errorf("%d frames: at chunkDone(%d) chunk %d is already written", frames, k, j)
				}
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		want := make([]int, frames)
		for k := range want {
			want[k] = k
		}
		if !slices.Equal(done, want) {
			t.Errorf("%d frames: chunks reported %v, want %v", frames, done, want)
		}
		if !bytes.Equal(dst, ref.Data) {
			t.Errorf("%d frames: result differs from Denoise", frames)
		}
	}
}

// TestDenoiseIntoStreamsDecode decodes each chunk on another goroutine as
// soon as it is reported, as an agent overlapping decode with the tail of
// denoising would, and gets Decode's file.
func TestDenoiseIntoStreamsDecode(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := Spec{Prompt: "jellyfish", Seed: 5, Width: 64, Height: 80, Frames: 4, Steps: 3, GuidanceScale: 5}
	cond, _ := e.Encode(ctx, s)
	ref, _ := e.Denoise(ctx, s, cond, nil)
	want, _, err := e.Decode(ctx, s, ref)
	if err != nil {
		t.Fatal(err)
	}
	d, err := e.NewFrameDecoder(s)
	if err != nil {
		t.Fatal(err)
	}
	meta := e.LatentMeta(s)
	dst := dirty(len(ref.Data))
	ready := make(chan int, meta.Chunks()) // never blocks the sampler
	decoded := make(chan error, 1)
	go func() {
		for k := range ready {
			off, n := meta.ChunkRange(k)
			if err := d.DecodeFrames(ctx, k, dst[off:off+n]); err != nil {
				decoded <- err
				for range ready {
				}
				return
			}
		}
		decoded <- nil
	}()
	_, err = e.DenoiseInto(ctx, s, cond, dst, nil, func(k int) { ready <- k })
	close(ready)
	if derr := <-decoded; derr != nil {
		t.Fatal(derr)
	}
	if err != nil {
		t.Fatal(err)
	}
	got, _, err := d.Finish()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("streamed decode differs from Decode")
	}
}

func TestIntoBadDst(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := Spec{Prompt: "a comet", Seed: 9, Width: 64, Height: 64, Frames: 2, Steps: 2, GuidanceScale: 5}
	cond, _ := e.Encode(ctx, s)
	cn, ln := int(e.CondMeta().Bytes()), int(e.LatentMeta(s).Bytes())
	for _, tc := range []struct {
		name string
		size func(want int) []byte
	}{
		{"nil", func(int) []byte { return nil }},
		{"empty", func(int) []byte { return []byte{} }},
		{"short", func(n int) []byte { return make([]byte, n-4) }},
		{"long", func(n int) []byte { return make([]byte, n+4) }},
		{"half", func(n int) []byte { return make([]byte, n/2) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := e.EncodeInto(ctx, s, tc.size(cn)); !errors.Is(err, ErrBadTensor) {
				t.Errorf("EncodeInto: %v, want ErrBadTensor", err)
			}
			called := false
			_, err := e.DenoiseInto(ctx, s, cond, tc.size(ln), func(int, int) { called = true }, func(int) { called = true })
			if !errors.Is(err, ErrBadTensor) || called {
				t.Errorf("DenoiseInto: %v (callbacks called: %v), want ErrBadTensor before any work", err, called)
			}
		})
	}
	// A bad spec is reported as such, whatever dst is.
	bad := s
	bad.Width = 60
	if _, err := e.DenoiseInto(ctx, bad, cond, nil, nil, nil); !errors.Is(err, ErrBadSpec) {
		t.Errorf("DenoiseInto with bad spec: %v, want ErrBadSpec", err)
	}
	if _, err := e.EncodeInto(ctx, bad, nil); !errors.Is(err, ErrBadSpec) {
		t.Errorf("EncodeInto with bad spec: %v, want ErrBadSpec", err)
	}
}

// TestDenoiseIntoCancelMidChunks cancels between two frames of the last
// step: no further chunk is reported and the call fails.
func TestDenoiseIntoCancelMidChunks(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e := newEngine(t)
	s := Spec{Prompt: "a comet", Seed: 9, Width: 64, Height: 64, Frames: 3, Steps: 2, GuidanceScale: 5}
	cond, _ := e.Encode(ctx, s)
	var done []int
	_, err := e.DenoiseInto(ctx, s, cond, make([]byte, e.LatentMeta(s).Bytes()), nil, func(k int) {
		done = append(done, k)
		cancel()
	})
	if !errors.Is(err, context.Canceled) || !slices.Equal(done, []int{0}) {
		t.Fatalf("DenoiseInto: %v after chunks %v, want Canceled after [0]", err, done)
	}
}

func TestFrameShare(t *testing.T) {
	for _, tc := range []struct {
		d  time.Duration
		nf int
	}{{0, 1}, {time.Second, 1}, {10, 3}, {2, 5}, {time.Duration(math.MaxInt64), 64}} {
		var sum time.Duration
		for f := range tc.nf {
			sum += frameShare(tc.d, f, tc.nf)
		}
		if sum != tc.d {
			t.Errorf("shares of %v over %d frames sum to %v", tc.d, tc.nf, sum)
		}
	}
}
