package engine

import (
	"bytes"
	"context"
	"errors"
	"image"
	"image/gif"
	"image/png"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/latentmesh/latentmesh/transfer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newEngine(t testing.TB) *Engine {
	t.Helper()
	e, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// small is a quick spec for tests.
func small(prompt string, seed int64) Spec {
	return Spec{Prompt: prompt, Seed: seed, Width: 64, Height: 64, Frames: 1, Steps: 8, GuidanceScale: 5}
}

// pipeline runs the three stages, passing tensors through fresh byte copies
// as separate processes would.
func pipeline(t testing.TB, e *Engine, s Spec) ([]byte, string) {
	t.Helper()
	ctx := context.Background()
	cond, err := e.Encode(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	lat, err := e.Denoise(ctx, s, wire(cond), nil)
	if err != nil {
		t.Fatal(err)
	}
	out, ct, err := e.Decode(ctx, s, wire(lat))
	if err != nil {
		t.Fatal(err)
	}
	return out, ct
}

// wire copies a tensor as if it had crossed a process boundary.
func wire(t Tensor) Tensor {
	return Tensor{
		Meta: transfer.TensorMeta{DType: t.Meta.DType, Shape: slices.Clone(t.Meta.Shape), ChunkDim: t.Meta.ChunkDim, NumChunks: t.Meta.NumChunks},
		Data: bytes.Clone(t.Data),
	}
}

func decodePNG(t testing.TB, b []byte) image.Image {
	t.Helper()
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// meanAbsDiff is the mean absolute difference of the RGB channels of two
// equally sized images, in 0..255 units.
func meanAbsDiff(a, b image.Image) float64 {
	var sum float64
	r := a.Bounds()
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			c1 := rgb(a, x, y)
			c2 := rgb(b, x, y)
			for i := range c1 {
				sum += math.Abs(c1[i] - c2[i])
			}
		}
	}
	return sum / float64(3*r.Dx()*r.Dy())
}

func rgb(img image.Image, x, y int) [3]float64 {
	r, g, b, _ := img.At(x, y).RGBA()
	return [3]float64{float64(r >> 8), float64(g >> 8), float64(b >> 8)}
}

func TestNewRejectsBadConfig(t *testing.T) {
	cases := []struct {
		name string
		edit func(*Config)
	}{
		{"embed dim", func(c *Config) { c.EmbedDim = 0 }},
		{"max tokens", func(c *Config) { c.MaxTokens = 1 }},
		{"vocab", func(c *Config) { c.VocabSize = 2 }},
		{"channels", func(c *Config) { c.LatentChannels = 2 }},
		{"negative cost", func(c *Config) { c.StepCost = -time.Second }},
		{"no limits", func(c *Config) { c.Limits = Limits{} }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			tc.edit(&cfg)
			if _, err := New(cfg); !errors.Is(err, ErrBadConfig) {
				t.Fatalf("New: %v, want ErrBadConfig", err)
			}
		})
	}
}

func TestID(t *testing.T) {
	if got := newEngine(t).ID(); got != "builtin/v4" {
		t.Fatalf("default ID %q", got)
	}
	cfg := DefaultConfig()
	cfg.StepCost = time.Second // costs do not change the output
	e1, _ := New(cfg)
	if e1.ID() != "builtin/v4" {
		t.Fatalf("cost changed ID to %q", e1.ID())
	}
	cfg.TableSeed++
	e2, _ := New(cfg)
	cfg.LatentChannels = 8
	e3, _ := New(cfg)
	if e2.ID() == "builtin/v4" || e3.ID() == e2.ID() {
		t.Fatalf("IDs %q %q do not tell models apart", e2.ID(), e3.ID())
	}
}

func TestTokenize(t *testing.T) {
	cases := []struct {
		a, b  string
		same  bool
		count int // tokens in a, start token included
	}{
		{"A Red Fox", "a red fox", true, 4},
		{"red, fox!", "red fox", true, 3},
		{"red fox", "fox red", false, 3},
		{"", "  ,,  ", true, 1},
		{"über 42", "ÜBER 42", true, 3},
	}
	for _, tc := range cases {
		a := tokenize(tc.a, nil, 8192, 77)
		b := tokenize(tc.b, nil, 8192, 77)
		if slices.Equal(a, b) != tc.same {
			t.Errorf("tokenize(%q)=%v tokenize(%q)=%v, same=%v", tc.a, a, tc.b, b, tc.same)
		}
		if len(a) != tc.count || a[0] != tokStart {
			t.Errorf("tokenize(%q)=%v, want %d tokens from the start token", tc.a, a, tc.count)
		}
		for _, id := range a[1:] {
			if id < firstTok || id >= 8192 {
				t.Errorf("token %d outside the vocabulary", id)
			}
		}
	}
	long := tokenize(string(bytes.Repeat([]byte("word "), 500)), nil, 8192, 77)
	if len(long) != 77 {
		t.Errorf("long prompt gave %d tokens, want 77", len(long))
	}
}

func TestEncode(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := small("a red fox", 1)
	c1, err := e.Encode(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c1.Meta.Shape, []int64{2, 77, 64}) || c1.Meta.DType != transfer.Float32 {
		t.Fatalf("meta %+v", c1.Meta)
	}
	if err := c1.Validate(); err != nil {
		t.Fatal(err)
	}
	c2, _ := e.Encode(ctx, s)
	if !bytes.Equal(c1.Data, c2.Data) {
		t.Fatal("Encode not deterministic")
	}
	v, _ := c1.Float32s()
	row := 77 * 64
	// Conditional: start token and three words, then zero padding.
	if nonZeroRows(v[:row], 64) != 4 {
		t.Errorf("prompt row has %d non-zero positions, want 4", nonZeroRows(v[:row], 64))
	}
	// Empty negative prompt: the bare start token.
	if nonZeroRows(v[row:], 64) != 1 {
		t.Errorf("empty negative prompt has %d non-zero positions, want 1", nonZeroRows(v[row:], 64))
	}
	if !slices.Equal(v[:64], v[row:row+64]) {
		t.Error("start token encodes differently in the two rows")
	}
	s.NegativePrompt = "a red fox"
	c3, _ := e.Encode(ctx, s)
	v3, _ := c3.Float32s()
	if !slices.Equal(v3[:row], v3[row:]) {
		t.Error("same prompt and negative prompt encode differently")
	}
	other, _ := e.Encode(ctx, small("a blue fox", 1))
	if bytes.Equal(other.Data[:4*row], c1.Data[:4*row]) {
		t.Error("different prompts encode the same")
	}
}

func nonZeroRows(v []float32, d int) int {
	n := 0
	for i := 0; i < len(v); i += d {
		if slices.ContainsFunc(v[i:i+d], func(f float32) bool { return f != 0 }) {
			n++
		}
	}
	return n
}

func TestDenoiseMeta(t *testing.T) {
	e := newEngine(t)
	cases := []struct {
		name   string
		frames int
		w, h   int
		chunks int
	}{
		{"image", 1, 64, 64, 1},
		{"wide image", 1, 128, 64, 1},
		{"video", 3, 64, 72, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := small("a cat", 1)
			s.Frames, s.Width, s.Height = tc.frames, tc.w, tc.h
			cond, err := e.Encode(context.Background(), s)
			if err != nil {
				t.Fatal(err)
			}
			var steps []int
			lat, err := e.Denoise(context.Background(), s, cond, func(step, total int) {
				if total != s.Steps {
					t.Errorf("progress total %d, want %d", total, s.Steps)
				}
				steps = append(steps, step)
			})
			if err != nil {
				t.Fatal(err)
			}
			want := []int64{int64(tc.frames), 4, int64(tc.h / 8), int64(tc.w / 8)}
			if !slices.Equal(lat.Meta.Shape, want) || lat.Meta.NumChunks != tc.chunks || lat.Meta.ChunkDim != 0 {
				t.Fatalf("meta %+v, want shape %v and %d chunks", lat.Meta, want, tc.chunks)
			}
			if err := lat.Validate(); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(steps, []int{1, 2, 3, 4, 5, 6, 7, 8}) {
				t.Errorf("progress steps %v", steps)
			}
		})
	}
}

func TestDeterministic(t *testing.T) {
	cases := []Spec{small("a lighthouse at dusk", 42), {Prompt: "waves", Seed: -3, Width: 64, Height: 64, Frames: 3, Steps: 5, GuidanceScale: 7}}
	for _, s := range cases {
		a, cta := pipeline(t, newEngine(t), s)
		b, ctb := pipeline(t, newEngine(t), s)
		if !bytes.Equal(a, b) || cta != ctb {
			t.Errorf("%+v: two runs differ", s)
		}
	}
}

// TestGolden pins the output bytes: a change here changes every cached and
// stored result, so it must come with a new version string. Run it with
// GOAMD64=v3 (and on arm64) to check that no fused multiply-add crept in.
func TestGolden(t *testing.T) {
	e := newEngine(t)
	img, _ := pipeline(t, e, small("golden gate bridge in fog", 7))
	vid, _ := pipeline(t, e, Spec{Prompt: "golden gate bridge in fog", Seed: 7, Width: 64, Height: 64, Frames: 2, Steps: 6, GuidanceScale: 9})
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"png", img, goldenPNG},
		{"gif", vid, goldenGIF},
	} {
		if got := fnv64(tc.b); got != tc.want {
			t.Errorf("%s hash %s, want %s", tc.name, got, tc.want)
		}
	}
}

func TestSeedsAndPromptsDiffer(t *testing.T) {
	e := newEngine(t)
	s := small("a red fox in the snow", 1)
	s.Width, s.Height = 128, 128
	base := decodePNG(t, first(pipeline(t, e, s)))
	cases := []struct {
		name string
		edit func(*Spec)
	}{
		{"seed", func(s *Spec) { s.Seed = 2 }},
		{"prompt", func(s *Spec) { s.Prompt = "sunset over the ocean" }},
		{"negative prompt", func(s *Spec) { s.NegativePrompt = "purple" }},
		{"guidance", func(s *Spec) { s.GuidanceScale = 12 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o := s
			tc.edit(&o)
			img := decodePNG(t, first(pipeline(t, e, o)))
			if d := meanAbsDiff(base, img); d < 8 {
				t.Errorf("mean pixel difference %.1f, want a visibly different picture", d)
			}
		})
	}
}

func first(b []byte, _ string) []byte { return b }

// TestLooksLikeAPicture checks outputs are smooth (neighbouring pixels close,
// unlike noise) yet not flat.
func TestLooksLikeAPicture(t *testing.T) {
	e := newEngine(t)
	for _, prompt := range []string{"a bowl of fruit", "city at night", "x"} {
		s := small(prompt, 5)
		s.Width, s.Height = 128, 128
		img := decodePNG(t, first(pipeline(t, e, s)))
		var diff, sum, sumSq float64
		n := 0
		for y := range 128 {
			for x := range 127 {
				a, b := rgb(img, x, y), rgb(img, x+1, y)
				for i := range a {
					diff += math.Abs(a[i] - b[i])
					sum += a[i]
					sumSq += a[i] * a[i]
					n++
				}
			}
		}
		diff /= float64(n)
		sd := math.Sqrt(sumSq/float64(n) - (sum/float64(n))*(sum/float64(n)))
		// Uniform noise would give a mean neighbour difference near 85.
		if diff > 6 {
			t.Errorf("%q: mean neighbour difference %.1f, looks like noise", prompt, diff)
		}
		if sd < 15 {
			t.Errorf("%q: pixel deviation %.1f, looks flat", prompt, sd)
		}
	}
}

func TestPNG(t *testing.T) {
	e := newEngine(t)
	s := small("a kite", 3)
	s.Width, s.Height = 96, 64
	out, ct := pipeline(t, e, s)
	if ct != ContentTypePNG {
		t.Fatalf("content type %q", ct)
	}
	if b := decodePNG(t, out).Bounds(); b.Dx() != 96 || b.Dy() != 64 {
		t.Fatalf("size %v", b)
	}
}

func TestGIF(t *testing.T) {
	e := newEngine(t)
	s := Spec{Prompt: "jellyfish", Seed: 5, Width: 64, Height: 80, Frames: 4, Steps: 5, GuidanceScale: 5}
	out, ct := pipeline(t, e, s)
	if ct != ContentTypeGIF {
		t.Fatalf("content type %q", ct)
	}
	g, err := gif.DecodeAll(bytes.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Image) != 4 || g.LoopCount != 0 {
		t.Fatalf("%d frames, loop %d", len(g.Image), g.LoopCount)
	}
	for i, f := range g.Image {
		if f.Bounds().Dx() != 64 || f.Bounds().Dy() != 80 || g.Delay[i] != gifDelay {
			t.Fatalf("frame %d: %v, delay %d", i, f.Bounds(), g.Delay[i])
		}
	}
	if d := meanAbsDiff(g.Image[0], g.Image[3]); d < 2 {
		t.Errorf("first and last frame differ by %.1f: not animated", d)
	}
}

func TestFrameDecoderMatchesDecode(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := Spec{Prompt: "a comet", Seed: 9, Width: 64, Height: 64, Frames: 5, Steps: 4, GuidanceScale: 5}
	cond, _ := e.Encode(ctx, s)
	lat, err := e.Denoise(ctx, s, cond, nil)
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := e.Generate(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	d, err := e.NewFrameDecoder(s)
	if err != nil {
		t.Fatal(err)
	}
	fb := d.FrameBytes()
	if fb*5 != len(lat.Data) {
		t.Fatalf("frame bytes %d, latent %d", fb, len(lat.Data))
	}
	// Chunks as a transfer would deliver them: {4}, {1,2}, {0}, {3}, in
	// parallel, frame 3 twice.
	parts := []struct{ first, n int }{{4, 1}, {1, 2}, {0, 1}, {3, 1}, {3, 1}}
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Go(func() {
			if err := d.DecodeFrames(ctx, p.first, lat.Data[p.first*fb:(p.first+p.n)*fb]); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	got, ct, err := d.Finish()
	if err != nil {
		t.Fatal(err)
	}
	if ct != ContentTypeGIF || !bytes.Equal(got, want) {
		t.Fatal("frame-by-frame decode differs from Decode")
	}
}

func TestFrameDecoderErrors(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := Spec{Prompt: "a comet", Seed: 9, Width: 64, Height: 64, Frames: 3, Steps: 2, GuidanceScale: 5}
	d, err := e.NewFrameDecoder(s)
	if err != nil {
		t.Fatal(err)
	}
	fb := d.FrameBytes()
	nan := Float32Bytes(slices.Repeat([]float32{float32(math.NaN())}, fb/4))
	cases := []struct {
		name  string
		first int
		data  []byte
	}{
		{"empty", 0, nil},
		{"partial frame", 0, make([]byte, fb-4)},
		{"negative frame", -1, make([]byte, fb)},
		{"past the end", 2, make([]byte, 2*fb)},
		{"nan", 0, nan},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := d.DecodeFrames(ctx, tc.first, tc.data); !errors.Is(err, ErrBadTensor) {
				t.Fatalf("DecodeFrames: %v, want ErrBadTensor", err)
			}
		})
	}
	if err := d.DecodeFrames(ctx, 0, make([]byte, fb)); err != nil {
		t.Fatal(err)
	}
	if err := d.DecodeFrames(ctx, 2, make([]byte, fb)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := d.Finish(); !errors.Is(err, ErrMissingFrames) {
		t.Fatalf("Finish with frame 1 missing: %v, want ErrMissingFrames", err)
	}
}

func TestBadTensors(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := small("a cat", 1)
	cond, _ := e.Encode(ctx, s)
	lat, _ := e.Denoise(ctx, s, cond, nil)
	edits := []struct {
		name string
		edit func(*Tensor)
	}{
		{"dtype", func(t *Tensor) { t.Meta.DType = transfer.Float16 }},
		{"unknown dtype", func(t *Tensor) { t.Meta.DType = "complex64" }},
		{"shape", func(t *Tensor) { t.Meta.Shape[1]++ }},
		{"rank", func(t *Tensor) { t.Meta.Shape = t.Meta.Shape[1:] }},
		{"no shape", func(t *Tensor) { t.Meta.Shape = nil }},
		{"negative dim", func(t *Tensor) { t.Meta.Shape[0] = -1 }},
		{"short data", func(t *Tensor) { t.Data = t.Data[:len(t.Data)-4] }},
		{"no data", func(t *Tensor) { t.Data = nil }},
		{"infinity", func(t *Tensor) { copy(t.Data[8:], Float32Bytes([]float32{float32(math.Inf(1))})) }},
	}
	for _, tc := range edits {
		t.Run(tc.name, func(t *testing.T) {
			c := wire(cond)
			tc.edit(&c)
			if _, err := e.Denoise(ctx, s, c, nil); !errors.Is(err, ErrBadTensor) {
				t.Errorf("Denoise: %v, want ErrBadTensor", err)
			}
			l := wire(lat)
			tc.edit(&l)
			if _, _, err := e.Decode(ctx, s, l); !errors.Is(err, ErrBadTensor) {
				t.Errorf("Decode: %v, want ErrBadTensor", err)
			}
		})
	}
	// A latent for another spec is refused.
	other := s
	other.Width = 72
	if _, _, err := e.Decode(ctx, other, lat); !errors.Is(err, ErrBadTensor) {
		t.Errorf("Decode with other spec: %v", err)
	}
}

func TestBadSpec(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := small("", 1)
	var fe *FieldError
	if _, err := e.Encode(ctx, s); !errors.Is(err, ErrBadSpec) || !errors.As(err, &fe) || fe.Field != "prompt" {
		t.Fatalf("Encode: %v", err)
	}
	s = small("x", 1)
	s.Width = 60
	if _, err := e.NewFrameDecoder(s); !errors.Is(err, ErrBadSpec) {
		t.Fatalf("NewFrameDecoder: %v", err)
	}
}

func TestGuidanceExtremes(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	for _, g := range []float64{0, 1, 30} {
		s := small("a storm over a neon city", 11)
		s.GuidanceScale = g
		s.NegativePrompt = "calm pastel"
		cond, _ := e.Encode(ctx, s)
		lat, err := e.Denoise(ctx, s, cond, nil)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := lat.Float32s()
		if err := checkFinite(v); err != nil {
			t.Fatalf("guidance %v: %v", g, err)
		}
		for _, f := range v {
			if math.Abs(float64(f)) > latentLimit {
				t.Fatalf("guidance %v: latent value %v beyond the limit", g, f)
			}
		}
		if _, _, err := e.Decode(ctx, s, lat); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDenoiseCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e := newEngine(t)
	s := small("a cat", 1)
	cond, _ := e.Encode(ctx, s)
	last := 0
	_, err := e.Denoise(ctx, s, cond, func(step, _ int) {
		last = step
		if step == 3 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) || last != 3 {
		t.Fatalf("Denoise: %v after step %d, want Canceled after 3", err, last)
	}
}

func TestSimulatedCost(t *testing.T) {
	cfg := DefaultConfig()
	cfg.StepCost = time.Hour
	cfg.EncodeCost = 20 * time.Millisecond
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := small("a cat", 1)
	start := time.Now()
	cond, err := e.Encode(context.Background(), s)
	if err != nil || time.Since(start) < cfg.EncodeCost {
		t.Fatalf("Encode took %v (err %v), want at least %v", time.Since(start), err, cfg.EncodeCost)
	}
	// An hour per step: cancellation must cut the sleep short.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := e.Denoise(ctx, s, cond, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Denoise: %v, want DeadlineExceeded", err)
	}
}

func TestFloat32Bytes(t *testing.T) {
	v := []float32{0, -1.5, float32(math.Pi), math.MaxFloat32, math.SmallestNonzeroFloat32}
	b := Float32Bytes(v)
	if len(b) != 20 || !bytes.Equal(b[4:8], []byte{0, 0, 0xc0, 0xbf}) { // -1.5, little-endian
		t.Fatalf("bytes %x", b)
	}
	back, err := BytesFloat32(b)
	if err != nil || !slices.Equal(back, v) {
		t.Fatalf("round trip %v %v", back, err)
	}
	if _, err := BytesFloat32(b[:5]); !errors.Is(err, ErrBadTensor) {
		t.Fatalf("odd length: %v", err)
	}
}

func TestDeterministicMath(t *testing.T) {
	for _, x := range []float64{-100, -3, -1, 0, 0.5, 1, 2, 3.14, 7, 1000} {
		if d := math.Abs(dsin(x) - math.Sin(x)); d > 1e-9 {
			t.Errorf("dsin(%v) off by %g", x, d)
		}
		if d := math.Abs(dcos(x) - math.Cos(x)); d > 1e-9 {
			t.Errorf("dcos(%v) off by %g", x, d)
		}
	}
	// gauss should be close to standard normal.
	var sum, sumSq float64
	const n = 100000
	for i := range n {
		g := gauss(mix64(uint64(i)))
		sum += g
		sumSq += g * g
	}
	if mean, v := sum/n, sumSq/n; math.Abs(mean) > 0.02 || math.Abs(v-1) > 0.02 {
		t.Errorf("gauss mean %v variance %v", mean, v)
	}
}

func FuzzDecodeFrames(f *testing.F) {
	e := newEngine(f)
	s := Spec{Prompt: "x", Width: 64, Height: 64, Frames: 2, Steps: 1}
	f.Add(0, make([]byte, 4*4*8*8))
	f.Add(1, Float32Bytes(slices.Repeat([]float32{1e30, -1e30}, 4*8*8)))
	f.Add(-1, []byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, first int, data []byte) {
		d, err := e.NewFrameDecoder(s)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.DecodeFrames(context.Background(), first, data); err != nil {
			return
		}
		_, _, _ = d.Finish()
	})
}

func fnv64(b []byte) string {
	var h uint64 = 14695981039346656037
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	const hex = "0123456789abcdef"
	out := make([]byte, 16)
	for i := range out {
		out[15-i] = hex[h&15]
		h >>= 4
	}
	return string(out)
}

const (
	goldenPNG = "07591c9ac1b32bc8"
	goldenGIF = "ee979842524a3005"
)

func TestFramePreview(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := Spec{Prompt: "waves", Seed: 3, Width: 512, Height: 128, Frames: 2, Steps: 2, GuidanceScale: 5}
	cond, err := e.Encode(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	lat, err := e.Denoise(ctx, s, cond, nil)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := e.NewFrameDecoder(s)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fd.FramePreview(0); !errors.Is(err, ErrMissingFrames) {
		t.Fatalf("preview before decode: %v", err)
	}
	if err := fd.DecodeFrames(ctx, 1, lat.Data[fd.FrameBytes():]); err != nil {
		t.Fatal(err)
	}
	b, err := fd.FramePreview(1)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if got := img.Bounds(); got.Dx() != 256 || got.Dy() != 64 {
		t.Fatalf("preview %v, want 256x64 (512x128 halved)", got)
	}
	if _, err := fd.FramePreview(2); err == nil {
		t.Fatal("preview of a frame past the end")
	}
}
