package costmodel

import (
	"errors"
	"fmt"
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
	p.Capacity = rateOf(m, p.Pools, p.Bottleneck)
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
