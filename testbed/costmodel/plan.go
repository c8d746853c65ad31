package costmodel

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// Pools is how many GPUs serve each stage.
type Pools struct{ Encode, Denoise, Decode int }

func (p Pools) get(st string) int {
	switch st {
	case "encode":
		return p.Encode
	case "denoise":
		return p.Denoise
	}
	return p.Decode
}

func (p *Pools) add(st string, n int) {
	switch st {
	case "encode":
		p.Encode += n
	case "denoise":
		p.Denoise += n
	default:
		p.Decode += n
	}
}

// String is the E:D:V form the flags take.
func (p Pools) String() string { return fmt.Sprintf("%d:%d:%d", p.Encode, p.Denoise, p.Decode) }

// MarshalText writes pools in JSON as "E:D:V" too.
func (p Pools) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// Plan is a pool sizing and why.
type Plan struct {
	Model string  `json:"model"`
	GPUs  int     `json:"gpus"`
	Rate  float64 `json:"rate"` // jobs/s asked for
	Pools Pools   `json:"pools"`
	// Capacity is the jobs/s the pools sustain: the slowest pool's.
	Capacity float64 `json:"capacity"`
	// Colocated is what the same GPUs sustain with every stage on every
	// GPU (each job holds one GPU for all three stages).
	Colocated float64 `json:"colocated_capacity"`
	// Bottleneck is the stage that sets Capacity.
	Bottleneck string `json:"bottleneck"`
	// Why explains the sizing, one line per point.
	Why []string `json:"why"`
	// Cache is what a conditioning cache changes (PlanPoolsCached).
	Cache *CachePlan `json:"cache,omitempty"`
}

// Cache is a conditioning cache's hit rates. The prompt and the negative
// prompt are encoded as separate halves, each half of an encode's GPU
// time, and a hit skips its half: the encode time a job needs scales with
// the misses.
type Cache struct {
	PromptHit   float64 `json:"prompt_hit_rate"`
	NegativeHit float64 `json:"negative_hit_rate"`
}

// EncodeLeft is the share of an encode's GPU time a job still spends.
func (c Cache) EncodeLeft() float64 { return 0.5*(1-c.PromptHit) + 0.5*(1-c.NegativeHit) }

// Apply is m with the encode time the cache leaves.
func (c Cache) Apply(m Model) Model {
	m.EncodeMs *= c.EncodeLeft()
	return m
}

func (c Cache) check() error {
	if !(c.PromptHit >= 0 && c.PromptHit <= 1) || !(c.NegativeHit >= 0 && c.NegativeHit <= 1) {
		return fmt.Errorf("costmodel: hit rates %v and %v: want 0 to 1", c.PromptHit, c.NegativeHit)
	}
	return nil
}

// CachePlan is the encode pool a rate needs without and with a cache, and
// the same GPUs split again on the encode time the cache leaves.
type CachePlan struct {
	Cache
	EncodeLeft float64 `json:"encode_left"`
	// Rate is what the encode pools are sized for: the plan's rate, else
	// its capacity without the cache.
	Rate float64 `json:"rate"`
	// EncodeGPUs is the encode pool Rate needs: without the cache, with it.
	EncodeGPUs [2]int  `json:"encode_gpus"`
	Pools      Pools   `json:"pools"`
	Capacity   float64 `json:"capacity"`
	Bottleneck string  `json:"bottleneck"`
}

// EncodeGPUs is the fewest GPUs whose encodes keep up with rate jobs/s of
// m (at least one).
func EncodeGPUs(m Model, rate float64) int {
	return max(1, int(math.Ceil(rate*m.StageTime("encode").Seconds()-1e-9)))
}

// PlanPoolsCached is PlanPools and what cache c changes: the encode pool
// the rate needs with and without it, and the pools of the same GPUs on
// the encode time it leaves.
func PlanPoolsCached(m Model, gpus int, rate float64, c Cache) (Plan, error) {
	if err := c.check(); err != nil {
		return Plan{}, err
	}
	p, err := PlanPools(m, gpus, rate)
	if err != nil {
		return p, err
	}
	cm := c.Apply(m)
	q, err := PlanPools(cm, gpus, rate)
	if err != nil {
		return p, err
	}
	cp := &CachePlan{Cache: c, EncodeLeft: c.EncodeLeft(), Rate: rate, Pools: q.Pools, Capacity: q.Capacity, Bottleneck: q.Bottleneck}
	why := fmt.Sprintf("%.3f jobs/s asked", rate)
	if rate == 0 {
		cp.Rate, why = p.Capacity, fmt.Sprintf("%.3f jobs/s, the pools' capacity", p.Capacity)
	}
	cp.EncodeGPUs = [2]int{EncodeGPUs(m, cp.Rate), EncodeGPUs(cm, cp.Rate)}
	p.Cache = cp
	p.Why = append(p.Why,
		fmt.Sprintf("conditioning cache: %.0f%% prompt hits and %.0f%% negative-prompt hits (each half of an encode) leave %.0f%% of encode: %s per job",
			100*c.PromptHit, 100*c.NegativeHit, 100*cp.EncodeLeft, round(cm.StageTime("encode"))),
		fmt.Sprintf("encode pool for %s: %d GPU(s) without the cache, %d with", why, cp.EncodeGPUs[0], cp.EncodeGPUs[1]),
		fmt.Sprintf("with the cache the %d GPUs plan to %s: %.3f jobs/s (%.2fx), %s sets the pace", gpus, q.Pools, q.Capacity, q.Capacity/p.Capacity, q.Bottleneck))
	return p, nil
}

// PlanPools sizes E:D:V pools of gpus GPUs for model m. It generalises
// LightX2V's rule (transformer GPUs : encoder GPUs = t_denoise : t_encode)
// to three stages: each stage gets GPUs in proportion to its time per job,
// at least one each, rounded so that the slowest pool is as fast as it can
// be.
func PlanPools(m Model, gpus int, rate float64) (Plan, error) {
	if gpus < len(Stages) {
		return Plan{}, fmt.Errorf("costmodel: %d GPUs cannot give each of %d stages its own", gpus, len(Stages))
	}
	if rate < 0 {
		return Plan{}, errors.New("costmodel: rate must not be negative")
	}
	total := m.Total().Seconds()
	p := Plan{Model: m.Name, GPUs: gpus, Rate: rate, Pools: fill(m, gpus)}
	p.Bottleneck = bottleneck(m, p.Pools)
	p.Capacity = Capacity(m, p.Pools)
	p.Colocated = float64(gpus) / total
	for _, st := range Stages {
		t := m.StageTime(st)
		p.Why = append(p.Why, fmt.Sprintf("%-7s %s per job, %d GPU(s): %.3f jobs/s", st, round(t), p.Pools.get(st), rateOf(m, p.Pools, st)))
	}
	p.Why = append(p.Why,
		fmt.Sprintf("pools sized in proportion to stage time (LightX2V's T/E = t_denoise/t_encode, for three stages); %s sets the pace", p.Bottleneck),
		fmt.Sprintf("disaggregated capacity %.3f jobs/s; colocated on the same %d GPUs %.3f jobs/s (%.2fx), before any gain from stages not interfering", p.Capacity, gpus, p.Colocated, p.Capacity/p.Colocated))
	switch {
	case rate == 0:
	case rate <= p.Capacity:
		p.Why = append(p.Why, fmt.Sprintf("%.3f jobs/s asked: the pools run at %.0f%% of capacity", rate, 100*rate/p.Capacity))
	default:
		need := gpusFor(m, rate)
		p.Why = append(p.Why, fmt.Sprintf("%.3f jobs/s asked is more than %.3f: %d GPUs are needed (pools %s)", rate, p.Capacity, need, fill(m, need)))
	}
	return p, nil
}

// fill splits gpus by water-filling: one GPU per stage, then every next
// GPU to the pool that is the slowest then. Each stage's rate grows
// linearly with its GPUs, so this is the integer form of sizing pools in
// proportion to stage time, and no other split of the same GPUs has a
// faster slowest pool.
func fill(m Model, gpus int) Pools {
	p := Pools{1, 1, 1}
	for used := len(Stages); used < gpus; used++ {
		p.add(bottleneck(m, p), 1)
	}
	return p
}

// gpusFor is the fewest GPUs whose pools sustain rate jobs/s. Capacity
// never falls as GPUs are added, so a binary search finds it; the upper
// bound is enough GPUs for every stage to have rate x its time of them,
// plus one each.
func gpusFor(m Model, rate float64) int {
	lo, hi := len(Stages), len(Stages)
	for _, st := range Stages {
		hi += int(rate*m.StageTime(st).Seconds()) + 1
	}
	for lo < hi {
		mid := (lo + hi) / 2
		p := fill(m, mid)
		if rateOf(m, p, bottleneck(m, p)) >= rate {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo
}

// rateOf is the jobs/s stage st's pool sustains.
func rateOf(m Model, p Pools, st string) float64 {
	return float64(p.get(st)) / m.StageTime(st).Seconds()
}

// Capacity is the jobs/s pools p sustain of m: their slowest stage's.
func Capacity(m Model, p Pools) float64 { return rateOf(m, p, bottleneck(m, p)) }

// bottleneck is the stage with the lowest rate.
func bottleneck(m Model, p Pools) string {
	best, bestRate := "", 0.0
	for _, st := range Stages {
		if r := rateOf(m, p, st); best == "" || r < bestRate {
			best, bestRate = st, r
		}
	}
	return best
}

func round(d time.Duration) string {
	if d >= time.Second {
		return d.Round(10 * time.Millisecond).String()
	}
	return d.Round(100 * time.Microsecond).String()
}

// Text is the plan as `latentmesh-dev plan` prints it.
func (p Plan) Text() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s on %d GPUs: pools E:D:V = %s\n", p.Model, p.GPUs, p.Pools)
	for _, w := range p.Why {
		fmt.Fprintf(&b, "  %s\n", w)
	}
	return b.String()
}

// ParsePools reads the E:D:V form.
func ParsePools(s string) (Pools, error) {
	var p Pools
	if _, err := fmt.Sscanf(s, "%d:%d:%d", &p.Encode, &p.Denoise, &p.Decode); err != nil || p.String() != s || p.Encode < 1 || p.Denoise < 1 || p.Decode < 1 {
		return Pools{}, fmt.Errorf("costmodel: pools %q: want E:D:V, each at least 1", s)
	}
	return p, nil
}
