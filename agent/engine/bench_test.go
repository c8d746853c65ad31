package engine

import (
	"context"
	"testing"
	"time"
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

// BenchmarkJob is a default request's whole CPU work: encode, denoise and
// decode a 256x256, 20-step image.
func BenchmarkJob(b *testing.B) {
	e := newEngine(b)
	s := Spec{Prompt: "a lighthouse at dusk", Seed: 1}.WithDefaults()
	ctx := context.Background()
	for b.Loop() {
		cond, err := e.Encode(ctx, s)
		if err != nil {
			b.Fatal(err)
		}
		lat, err := e.Denoise(ctx, s, cond, nil)
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := e.Decode(ctx, s, lat); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDenoiseStepKVCache measures a step of a 50-step default-size
// image without and with the unconditional branch's keys and values cached
// (the cache already holding them), in the same iterations so the two share
// the machine's state, and the share of a step that projecting both
// branches' keys and values takes. Metrics: ns/step of each, their ratio,
// and kv-share.
func BenchmarkDenoiseStepKVCache(b *testing.B) {
	e := newEngine(b)
	ctx := context.Background()
	s := Spec{Prompt: "a lighthouse at dusk", Seed: 1, Steps: 50}.WithDefaults()
	cond, err := e.Encode(ctx, s)
	if err != nil {
		b.Fatal(err)
	}
	dst := make([]byte, e.LatentMeta(s).Bytes())
	kv := NewKVCache(1 << 20)
	if _, err := e.DenoiseWith(ctx, s, cond, dst, DenoiseOptions{KV: kv}); err != nil {
		b.Fatal(err)
	}
	cv, _ := cond.Float32s()
	half := len(cv) / 2
	proj := make([]float64, e.attn.kvLen())
	hid := make([]float64, attnHidden)
	var plain, cached, project time.Duration
	for b.Loop() {
		start := time.Now()
		if _, err := e.DenoiseWith(ctx, s, cond, dst, DenoiseOptions{}); err != nil {
			b.Fatal(err)
		}
		plain += time.Since(start)
		start = time.Now()
		if _, err := e.DenoiseWith(ctx, s, cond, dst, DenoiseOptions{KV: kv}); err != nil {
			b.Fatal(err)
		}
		cached += time.Since(start)
		start = time.Now()
		for range s.Steps { // what a step without the cache projects
			e.attn.project(proj, cv[:half], hid)
			e.attn.project(proj, cv[half:], hid)
		}
		project += time.Since(start)
	}
	steps := float64(b.N * s.Steps)
	b.ReportMetric(float64(plain.Nanoseconds())/steps, "nocache-ns/step")
	b.ReportMetric(float64(cached.Nanoseconds())/steps, "cache-ns/step")
	b.ReportMetric(float64(cached)/float64(plain), "cache/nocache")
	b.ReportMetric(float64(project)/float64(plain), "kv-share")
}
