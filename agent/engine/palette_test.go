package engine

import (
	"bytes"
	"context"
	"image"
	"testing"
)

// tally counts what an image is made of.
type tally struct {
	n                 float64
	mean              [3]float64 // mean R, G, B
	white, red, vivid float64    // shares of near-white, red and bright saturated pixels
}

func count(img image.Image, r image.Rectangle) tally {
	var t tally
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			c := rgb(img, x, y)
			for i := range c {
				t.mean[i] += c[i]
			}
			lo, hi := min(c[0], c[1], c[2]), max(c[0], c[1], c[2])
			if lo > 200 {
				t.white++
			}
			if c[0] > 150 && c[1] < 100 && c[2] < 100 {
				t.red++
			}
			if hi > 180 && hi-lo > 120 {
				t.vivid++
			}
			t.n++
		}
	}
	for i := range t.mean {
		t.mean[i] /= t.n
	}
	t.white, t.red, t.vivid = t.white/t.n, t.red/t.n, t.vivid/t.n
	return t
}

// TestPalette checks that known words reach the picture: the colours and
// places a newcomer would expect from the prompt, for two seeds each.
func TestPalette(t *testing.T) {
	e := newEngine(t)
	full := image.Rect(0, 0, 96, 96)
	cases := []struct {
		prompt string
		check  func(img image.Image) (tally, bool)
	}{
		{"a red fox in the snow", func(img image.Image) (tally, bool) {
			c := count(img, full)
			return c, c.red > 0.05 && c.white > 0.4
		}},
		{"ocean waves", func(img image.Image) (tally, bool) {
			c := count(img, full)
			return c, c.mean[2] > c.mean[0]+60 && c.mean[2] > c.mean[1]+20
		}},
		{"city at night, neon", func(img image.Image) (tally, bool) {
			c := count(img, full)
			luma := (c.mean[0] + c.mean[1] + c.mean[2]) / 3
			return c, luma < 90 && c.vivid > 0.05
		}},
		{"sunset over the ocean", func(img image.Image) (tally, bool) {
			sky := count(img, image.Rect(0, 0, 96, 16)) // above any horizon
			return sky, sky.mean[0] > sky.mean[2]+60
		}},
		{"a green forest", func(img image.Image) (tally, bool) {
			c := count(img, full)
			return c, c.mean[1] > c.mean[0]+30 && c.mean[1] > c.mean[2]+30
		}},
	}
	for _, tc := range cases {
		for _, seed := range []int64{1, 2} {
			s := small(tc.prompt, seed)
			s.Width, s.Height = 96, 96
			out, _ := pipeline(t, e, s)
			if c, ok := tc.check(decodePNG(t, out)); !ok {
				t.Errorf("%q seed %d: %+v", tc.prompt, seed, c)
			}
		}
	}
}

// TestGuidanceAndNegativePrompt checks classifier-free guidance on a known
// palette: a negative prompt of quality words ("blurry, low contrast") keeps
// the fox red on white, and guidance 1 washes the red out that guidance 5
// shows.
func TestGuidanceAndNegativePrompt(t *testing.T) {
	e := newEngine(t)
	full := image.Rect(0, 0, 96, 96)
	s := small("a red fox in the snow", 1)
	s.Width, s.Height = 96, 96
	base := count(decodePNG(t, first(pipeline(t, e, s))), full)
	neg := s
	neg.NegativePrompt = "blurry, low contrast"
	if c := count(decodePNG(t, first(pipeline(t, e, neg))), full); !(c.red > 0.05 && c.white > 0.4) {
		t.Errorf("with a negative prompt: %+v", c)
	}
	weak := s
	weak.GuidanceScale = 1
	if c := count(decodePNG(t, first(pipeline(t, e, weak))), full); !(c.red < base.red/4) {
		t.Errorf("red share %.3f at guidance 1, %.3f at 5", c.red, base.red)
	}
}

// TestMeaningTravelsInTheTensor checks that the denoiser takes the prompt's
// meaning from the conditioning alone: the spec's prompt text is not read.
func TestMeaningTravelsInTheTensor(t *testing.T) {
	e := newEngine(t)
	ctx := context.Background()
	s := small("a red fox in the snow", 1)
	cond, err := e.Encode(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	a, err := e.Denoise(ctx, s, wire(cond), nil)
	if err != nil {
		t.Fatal(err)
	}
	other := s
	other.Prompt = "ocean waves"
	b, err := e.Denoise(ctx, other, wire(cond), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Data, b.Data) {
		t.Fatal("the latent depends on the spec's prompt text, not only on the conditioning")
	}
}

// TestLexicon checks that every known word is one token with an id of its
// own (a word listed twice would lose its second meaning), that words not
// listed never get a known word's id, and that the colours are what they
// say: each decodes back to its sRGB bytes.
func TestLexicon(t *testing.T) {
	cfg := DefaultConfig()
	known, codes := newLexicon()
	n := 0
	for _, en := range lexicon() {
		for _, w := range en.words {
			n++
			if ids := tokenize(w, known, cfg.VocabSize, 3); len(ids) != 2 || ids[1] != known[w] {
				t.Errorf("%q tokenizes to %v, want [start %d]", w, ids, known[w])
			}
		}
	}
	if n != len(known) || len(codes) != n || n > lexiconWords {
		t.Errorf("%d words listed, %d known, %d codes, at most %d", n, len(known), len(codes), lexiconWords)
	}
	// Hashed ids once sent "onto" to "neon" and made the demo's ocean neon.
	for _, w := range []string{"rolling", "ripe", "drifting", "quasar"} {
		if id := tokenize(w, known, cfg.VocabSize, 2)[1]; int(id) < firstTok+len(codes) {
			t.Errorf("unknown word %q got known id %d", w, id)
		}
	}
	for _, want := range [][3]uint8{{205, 30, 30}, {30, 70, 205}, {130, 80, 40}, {60, 150, 50}} {
		c := rgbColour(want)
		lin := [3]float64{
			c[0] + 1.2*c[1] + 0.3*c[2],
			c[0] - 0.6*c[1] + 0.45*c[2],
			c[0] - 0.15*c[1] - 1.2*c[2],
		}
		for i, v := range lin {
			got := toByte(latentLimit * squash(v/latentLimit))
			if d := int(got) - int(want[i]); d < -1 || d > 1 {
				t.Errorf("%v decodes to channel %d = %d", want, i, got)
			}
		}
	}
}

// TestUnknownWordsKeepTheSeededLook checks that a prompt of unknown words
// reads as no meaning at all.
func TestUnknownWordsKeepTheSeededLook(t *testing.T) {
	e := newEngine(t)
	cond, err := e.Encode(context.Background(), small("quasar zeitgeist", 1))
	if err != nil {
		t.Fatal(err)
	}
	v, _ := cond.Float32s()
	m := readSense(pool(v[:77*64], 77, 64)[64-semWidth:])
	if m.objS != 0 || m.skyS != 0 || m.groundS != 0 || m.shape.w != 0 || m.bands != 0 || m.flat != 0 {
		t.Fatalf("unknown words read as %+v", m)
	}
}
