package engine

import (
	"context"
	"testing"
)

func benchSpecs() []struct {
	name string
	s    Spec
} {
	return []struct {
		name string
		s    Spec
	}{
		{"image256", Spec{Prompt: "a lighthouse at dusk", Seed: 1, Width: 256, Height: 256, Frames: 1, Steps: 20, GuidanceScale: 5}},
		{"video256x8", Spec{Prompt: "a lighthouse at dusk", Seed: 1, Width: 256, Height: 256, Frames: 8, Steps: 20, GuidanceScale: 5}},
	}
}

func BenchmarkEncode(b *testing.B) {
	e := newEngine(b)
	s := benchSpecs()[0].s
	for b.Loop() {
		if _, err := e.Encode(context.Background(), s); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDenoise(b *testing.B) {
	e := newEngine(b)
	for _, bc := range benchSpecs() {
		b.Run(bc.name, func(b *testing.B) {
			cond, _ := e.Encode(context.Background(), bc.s)
			for b.Loop() {
				if _, err := e.Denoise(context.Background(), bc.s, cond, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDenoiseInto reuses one output buffer, as an agent writing into
// its arena does; compare its B/op with BenchmarkDenoise's.
func BenchmarkDenoiseInto(b *testing.B) {
	e := newEngine(b)
	for _, bc := range benchSpecs() {
		b.Run(bc.name, func(b *testing.B) {
			cond, _ := e.Encode(context.Background(), bc.s)
			dst := make([]byte, e.LatentMeta(bc.s).Bytes())
			b.ReportAllocs()
			for b.Loop() {
				if _, err := e.DenoiseInto(context.Background(), bc.s, cond, dst, nil, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkDecode(b *testing.B) {
	e := newEngine(b)
	for _, bc := range benchSpecs() {
		b.Run(bc.name, func(b *testing.B) {
			cond, _ := e.Encode(context.Background(), bc.s)
			lat, _ := e.Denoise(context.Background(), bc.s, cond, nil)
			for b.Loop() {
				if _, _, err := e.Decode(context.Background(), bc.s, lat); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
