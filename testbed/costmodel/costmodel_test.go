package costmodel

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

func TestShippedModels(t *testing.T) {
	f, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	wan, err := f.Model("wan2.1-t2v-1.3b")
	if err != nil {
		t.Fatal(err)
	}
	// Issue 10's figures, and the Wan latent it names: 16x21x60x104 bf16.
	if got := wan.StageTime("denoise"); got != 6875*time.Millisecond {
		t.Fatalf("wan 1.3b denoise %v, want 50 x 137.5 ms", got)
	}
	if got := wan.Latent.Bytes(); got != 16*21*60*104*2 {
		t.Fatalf("wan latent %d bytes", got)
	}
	w14, _ := f.Model("wan2.1-t2v-14b")
	if got := w14.StageTime("denoise"); got != 252800*time.Millisecond {
		t.Fatalf("wan 14b denoise %v, want 252.8 s", got)
	}
	if _, err := f.Model("nosuch"); err == nil || !strings.Contains(err.Error(), "flux.1-dev") {
		t.Fatalf("unknown model: %v", err)
	}
}

func TestParseRefusesUnsourcedOrBadFigures(t *testing.T) {
	base := `{"gpu":"x","sources":{"a":"u"},"models":{"m":{"kind":"image","encode_ms":1,"step_ms":1,"steps":1,"decode_ms":1,
		"latent":{"shape":[1],"dtype":"bf16"},"cond":{"shape":[1],"dtype":"bf16"},"frames":1,
		"weights_gb":{"encode":1,"denoise":1,"decode":1},"timing_source":"a","shape_source":"a"}}}`
	if _, err := Parse([]byte(base)); err != nil {
		t.Fatalf("valid file: %v", err)
	}
	for what, bad := range map[string]string{
		"unlisted source": strings.Replace(base, `"timing_source":"a"`, `"timing_source":"b"`, 1),
		"zero step":       strings.Replace(base, `"step_ms":1`, `"step_ms":0`, 1),
		"unknown dtype":   strings.Replace(base, `"shape":[1],"dtype":"bf16"},"cond"`, `"shape":[1],"dtype":"int3"},"cond"`, 1),
		"unknown field":   strings.Replace(base, `"frames":1`, `"frames":1,"fps":16`, 1),
		"no weights":      strings.Replace(base, `"decode":1}`, `"decode":0}`, 1),
	} {
		if _, err := Parse([]byte(bad)); err == nil {
			t.Errorf("%s: accepted", what)
		}
	}
}

// The plan follows stage time: Wan 1.3B's denoise is 6.9 s of its 7.8 s,
// so nearly every GPU denoises, and encode (535 ms) needs a second GPU
// before decode (362 ms) does. No other split of the GPUs does better
// than the plan's slowest pool.
func TestPlanPools(t *testing.T) {
	f, _ := Load()
	wan, _ := f.Model("wan2.1-t2v-1.3b")
	p, err := PlanPools(wan, 16, 1)
	if err != nil {
		t.Fatal(err)
	}
	if p.Pools.Encode+p.Pools.Denoise+p.Pools.Decode != 16 || p.Pools.Encode < 1 || p.Pools.Decode < 1 {
		t.Fatalf("pools %v", p.Pools)
	}
	if p.Pools != (Pools{2, 13, 1}) {
		t.Fatalf("wan 1.3b on 16 GPUs: %v, want 2:13:1", p.Pools)
	}
	for e := 1; e <= 14; e++ {
		for v := 1; e+v <= 15; v++ {
			alt := Pools{e, 16 - e - v, v}
			if c := rateOf(wan, alt, bottleneck(wan, alt)); c > p.Capacity+1e-9 {
				t.Fatalf("%v sustains %.4f jobs/s, more than the plan's %v at %.4f", alt, c, p.Pools, p.Capacity)
			}
		}
	}
	if p.Bottleneck != "denoise" || !strings.Contains(p.Text(), "2:13:1") {
		t.Fatalf("plan:\n%s", p.Text())
	}
	if _, err := PlanPools(wan, 2, 1); err == nil {
		t.Fatal("2 GPUs for 3 stages accepted")
	}
	// Asked for more than the GPUs can do, the plan says how many are needed.
	p, _ = PlanPools(wan, 8, 10)
	need := gpusFor(wan, 10)
	if !strings.Contains(p.Text(), fmt.Sprintf("%d GPUs are needed", need)) {
		t.Fatalf("overloaded plan:\n%s", p.Text())
	}
	if q, _ := PlanPools(wan, need, 10); q.Capacity < 10 {
		t.Fatalf("%d GPUs sustain %.3f jobs/s, not 10", need, q.Capacity)
	}
	if q, _ := PlanPools(wan, need-1, 10); q.Capacity >= 10 {
		t.Fatalf("%d GPUs already sustain 10 jobs/s; %d is not the fewest", need-1, need)
	}
}

// A conditioning cache takes the encode time its hits skip off the plan:
// prompt and negative prompt are each half of an encode.
func TestPlanPoolsCached(t *testing.T) {
	f, _ := Load()
	wan, _ := f.Model("wan2.1-t2v-1.3b")
	c := Cache{PromptHit: 0.5, NegativeHit: 0.9}
	if got := c.EncodeLeft(); math.Abs(got-0.3) > 1e-12 {
		t.Fatalf("50%% and 90%% hits leave %.3f of encode, want 0.3", got)
	}
	// 4 jobs/s of 535 ms encodes need 2.14 GPUs, so 3; with 30% of it, 0.642: 1.
	p, err := PlanPoolsCached(wan, 16, 4, c)
	if err != nil {
		t.Fatal(err)
	}
	if p.Cache == nil || p.Cache.EncodeGPUs != [2]int{3, 1} {
		t.Fatalf("encode GPUs %+v, want 3 without the cache and 1 with", p.Cache)
	}
	// 16 GPUs: 2:13:1 without; the cache frees the second encoder for denoise.
	if p.Pools != (Pools{2, 13, 1}) || p.Cache.Pools != (Pools{1, 14, 1}) || p.Cache.Capacity <= p.Capacity {
		t.Fatalf("pools %v then %v at %.3f against %.3f jobs/s", p.Pools, p.Cache.Pools, p.Cache.Capacity, p.Capacity)
	}
	// No rate asked: the encode pool is sized for the plan's capacity.
	p, _ = PlanPoolsCached(wan, 16, 0, Cache{})
	if p.Cache.Rate != p.Capacity || p.Cache.EncodeGPUs[0] != p.Cache.EncodeGPUs[1] || !strings.Contains(p.Text(), "conditioning cache") {
		t.Fatalf("no hits: %+v\n%s", p.Cache, p.Text())
	}
	if _, err := PlanPoolsCached(wan, 16, 1, Cache{PromptHit: 2}); err == nil {
		t.Fatal("a hit rate of 2 accepted")
	}
}
