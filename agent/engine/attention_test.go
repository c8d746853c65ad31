package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
)

// TestEncodeTextIntoHalves checks that the conditioning is its two halves
// encoded independently, byte for byte.
func TestEncodeTextIntoHalves(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	bm := e.BranchMeta()
	if !slices.Equal(bm.Shape, []int64{1, 77, 64}) || bm.NumChunks != 1 || 2*bm.Bytes() != e.CondMeta().Bytes() {
		t.Fatalf("branch meta %+v, cond meta %+v", bm, e.CondMeta())
	}
	for _, s := range []Spec{
		small("a red fox in the snow", 1),
		{Prompt: "neon city street at night in the rain", NegativePrompt: "blurry, low contrast", Seed: 4, Width: 64, Height: 64, Frames: 1, Steps: 2, GuidanceScale: 5},
		{Prompt: string(bytes.Repeat([]byte("word "), 300)), NegativePrompt: "a red fox", Seed: 1, Width: 64, Height: 64, Frames: 1, Steps: 1, GuidanceScale: 5},
	} {
		cond := dirty(int(e.CondMeta().Bytes()))
		if _, err := e.EncodeInto(ctx, s, cond); err != nil {
			t.Fatal(err)
		}
		var halves []byte
		for _, text := range []string{s.Prompt, s.NegativePrompt} {
			dst := dirty(int(bm.Bytes()))
			if err := e.EncodeTextInto(ctx, text, dst); err != nil {
				t.Fatal(err)
			}
			halves = append(halves, dst...)
		}
		if !bytes.Equal(cond, halves) {
			t.Errorf("%.30q / %q: EncodeInto differs from the two EncodeTextInto halves", s.Prompt, s.NegativePrompt)
		}
	}
	if err := e.EncodeTextInto(ctx, "x", make([]byte, bm.Bytes()+4)); !errors.Is(err, ErrBadTensor) {
		t.Errorf("wrong dst size: %v, want ErrBadTensor", err)
	}
	if err := e.EncodeTextInto(ctx, "\xff", make([]byte, bm.Bytes())); !errors.Is(err, ErrBadSpec) {
		t.Errorf("invalid UTF-8: %v, want ErrBadSpec", err)
	}
}

// TestKVCacheSameBytes checks that caching the unconditional branch's keys
// and values changes no output byte, on a miss and on a hit, and that a
// request with another prompt but the same negative prompt hits.
func TestKVCacheSameBytes(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	kv := NewKVCache(1 << 20)
	specs := []Spec{
		{Prompt: "a red fox in the snow", NegativePrompt: "blurry", Seed: 1, Width: 64, Height: 64, Frames: 1, Steps: 6, GuidanceScale: 5},
		{Prompt: "ocean waves", NegativePrompt: "blurry", Seed: 2, Width: 96, Height: 64, Frames: 1, Steps: 5, GuidanceScale: 9},
		{Prompt: "jellyfish", Seed: 5, Width: 64, Height: 80, Frames: 3, Steps: 4, GuidanceScale: 5},
	}
	wantMisses := []int64{1, 1, 2} // the second shares the first's negative prompt
	for i, s := range specs {
		cond, err := e.Encode(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		ref := dirty(int(e.LatentMeta(s).Bytes()))
		if _, err := e.DenoiseWith(ctx, s, cond, ref, DenoiseOptions{}); err != nil {
			t.Fatal(err)
		}
		for _, pass := range []string{"first", "second"} {
			got := dirty(len(ref))
			if _, err := e.DenoiseWith(ctx, s, wire(cond), got, DenoiseOptions{KV: kv}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, ref) {
				t.Errorf("spec %d, %s run with the cache: latent differs from the run without", i, pass)
			}
		}
		if st := kv.Stats(); st.Misses != wantMisses[i] || st.Hits != 2*int64(i+1)-st.Misses {
			t.Errorf("after spec %d: stats %+v, want %d misses", i, st, wantMisses[i])
		}
	}
}

// damaged is a KVCache whose every value is damaged: the sampler must
// recompute rather than use it.
type damaged struct{ puts int }

func (d *damaged) Get(string) ([]byte, bool) { return make([]byte, 8*4), true }
func (d *damaged) Put(string, []byte)        { d.puts++ }

func TestKVCacheDamagedValue(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := small("a kite", 3)
	cond, _ := e.Encode(ctx, s)
	ref, _ := e.Denoise(ctx, s, cond, nil)
	// A value of the right length whose checksum does not match.
	good := NewKVCache(1 << 20)
	got := make([]byte, len(ref.Data))
	if _, err := e.DenoiseWith(ctx, s, cond, got, DenoiseOptions{KV: good}); err != nil {
		t.Fatal(err)
	}
	key := e.kvKey(cond.Data[len(cond.Data)/2:])
	v, ok := good.Get(key)
	if !ok {
		t.Fatalf("no value under %q", key)
	}
	flipped := bytes.Clone(v)
	flipped[17] ^= 1
	good.Put(key, flipped)
	for _, kv := range []KVCache{&damaged{}, good} {
		clear(got)
		if _, err := e.DenoiseWith(ctx, s, cond, got, DenoiseOptions{KV: kv}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, ref.Data) {
			t.Errorf("%T: a damaged cache value changed the output", kv)
		}
	}
}

func TestMemKVCache(t *testing.T) {
	c := NewKVCache(300)
	val := func(n int) []byte { return make([]byte, n) }
	c.Put("a", val(99)) // 100 bytes with its key
	c.Put("b", val(99))
	c.Put("c", val(99))
	if _, ok := c.Get("a"); !ok { // a is now the most recently used
		t.Fatal("a missing")
	}
	c.Put("d", val(99)) // evicts b, the least recently used
	if _, ok := c.Get("b"); ok {
		t.Error("b survived, though least recently used")
	}
	for _, k := range []string{"a", "c", "d"} {
		if _, ok := c.Get(k); !ok {
			t.Errorf("%s evicted", k)
		}
	}
	c.Put("big", val(400)) // over the budget: never held, evicts nothing
	c.Put("c", val(49))    // a replacement frees the old value's bytes
	want := KVCacheStats{Hits: 4, Misses: 1, Evictions: 1, Entries: 3, Bytes: 250}
	if st := c.Stats(); st != want {
		t.Errorf("stats %+v, want %+v", st, want)
	}
	if v, ok := c.Get("c"); !ok || len(v) != 49 {
		t.Errorf("c after replacement: %d bytes, %v", len(v), ok)
	}
	// Concurrent use (run with -race).
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 200 {
				k := fmt.Sprint(i % 7)
				if _, ok := c.Get(k); !ok {
					c.Put(k, val(g+i%50))
				}
			}
		})
	}
	wg.Wait()
	if st := c.Stats(); st.Bytes > 300 || st.Entries < 1 {
		t.Errorf("after concurrent use: %+v", st)
	}
}

// TestAttention checks the cross-attention's output: finite, of about its
// gain's size, and different for different conditioning.
func TestAttention(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	a := e.attn
	outs := map[string][]float64{}
	for _, prompt := range []string{"a red fox in the snow", "ocean waves at night"} {
		cond, _ := e.Encode(ctx, small(prompt, 1))
		cv, _ := cond.Float32s()
		rows := cv[:len(cv)/2]
		kv := make([]float64, a.kvLen())
		a.project(kv, rows, make([]float64, attnHidden))
		tok := tokensOf(rows, 77, 64)
		if len(tok) != len(tokenize(prompt, e.table.known, 8192, 77)) {
			t.Fatalf("%q: mask %v", prompt, tok)
		}
		g := a.newGrid(32, 32, len(tok))
		blur := make([]float64, 4*32*32)
		for i := range blur {
			blur[i] = dsin(float64(i) / 50)
		}
		a.attend(g, blur, kv, kv, tok, tok)
		if !slices.Equal(g.outC, g.outU) {
			t.Fatal("the same keys and values attended differently")
		}
		var ss float64
		for _, v := range g.outC {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				t.Fatalf("%q: attention output %v", prompt, v)
			}
			ss += v * v
		}
		if rms := math.Sqrt(ss / float64(len(g.outC))); rms < attnGain/4 || rms > 3*attnGain {
			t.Errorf("%q: attention output RMS %.3f, want about %.2f", prompt, rms, attnGain)
		}
		outs[prompt] = slices.Clone(g.outC)
	}
	if slices.Equal(outs["a red fox in the snow"], outs["ocean waves at night"]) {
		t.Error("different prompts attend to the same output")
	}
}

func TestDexp(t *testing.T) {
	for _, x := range []float64{0, -1e-9, -0.3, -0.35, -1, -2.5, -10, -39.9} {
		if got, want := dexp(x), math.Exp(x); math.Abs(got-want) > 1e-11*want {
			t.Errorf("dexp(%v) = %v, want %v", x, got, want)
		}
	}
	for _, x := range []float64{-40.1, math.Inf(-1), math.NaN()} {
		if got := dexp(x); got != 0 {
			t.Errorf("dexp(%v) = %v, want 0", x, got)
		}
	}
}
