package serve

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
)

// Class is one kind of request of a mix: a model, its priority class, its
// share of arrivals and its latency objective (simulated time).
type Class struct {
	Model  string        `json:"model"`
	Class  routing.Class `json:"class"`
	Weight float64       `json:"weight"`
	SLO    time.Duration `json:"slo"`
}

// Name is "model/class", how reports name a class.
func (c Class) Name() string { return c.Model + "/" + c.Class.String() }

// DefaultSLO is the latency objective of a priority class when a mix does
// not give one: a person waits for an interactive image (about 2.3x FLUX's
// 6.5 s of GPU time); standard work gets about 4x Wan 1.3B's 7.8 s; batch
// work is judged on throughput, with a loose minute.
func DefaultSLO(c routing.Class) time.Duration {
	switch c {
	case routing.Interactive:
		return 15 * time.Second
	case routing.Standard:
		return 30 * time.Second
	}
	return 60 * time.Second
}

// ParseMix reads --mix: comma-separated model[:class[:weight[:slo]]], e.g.
// "flux.1-dev:interactive:1:15s,wan2.1-t2v-1.3b:batch:1".
func ParseMix(s string, models costmodel.File) ([]Class, error) {
	var out []Class
	for _, part := range strings.Split(s, ",") {
		f := strings.Split(strings.TrimSpace(part), ":")
		if len(f) == 0 || f[0] == "" || len(f) > 4 {
			return nil, fmt.Errorf("serve: mix entry %q: want model[:class[:weight[:slo]]]", part)
		}
		if _, err := models.Model(f[0]); err != nil {
			return nil, err
		}
		c := Class{Model: f[0], Class: routing.Standard, Weight: 1}
		var err error
		if len(f) > 1 {
			if c.Class, err = routing.ParseClass(f[1]); err != nil {
				return nil, fmt.Errorf("serve: mix entry %q: %w", part, err)
			}
		}
		if len(f) > 2 {
			if c.Weight, err = strconv.ParseFloat(f[2], 64); err != nil || !(c.Weight > 0) || math.IsInf(c.Weight, 0) {
				return nil, fmt.Errorf("serve: mix entry %q: weight must be positive", part)
			}
		}
		c.SLO = DefaultSLO(c.Class)
		if len(f) > 3 {
			if c.SLO, err = time.ParseDuration(f[3]); err != nil || c.SLO <= 0 {
				return nil, fmt.Errorf("serve: mix entry %q: slo: want a positive duration", part)
			}
		}
		for _, o := range out {
			if o.Name() == c.Name() {
				return nil, fmt.Errorf("serve: mix names %s twice", c.Name())
			}
		}
		out = append(out, c)
	}
	return out, nil
}

// Arrival is one request of a trace: At is simulated time since the start.
// A trace file is JSON lines of {"t": seconds, "model": m, "class": c},
// optionally with the request's seed, prompt and negative prompt.
type Arrival struct {
	At    time.Duration `json:"-"`
	T     float64       `json:"t"`
	Model string        `json:"model"`
	Class string        `json:"class"`
	Seed  int64         `json:"seed,omitempty"`
	// Prompt and Negative are the request's texts: equal texts of one
	// model are what a conditioning cache can serve without an encode.
	// An arrival without a prompt gets one of its own (PromptOf).
	Prompt   string `json:"prompt,omitempty"`
	Negative string `json:"negative_prompt,omitempty"`
}

// PromptOf is the prompt arrival i of a trace is submitted with: its own,
// else "req-NNNNNN", which no other arrival has.
func PromptOf(i int, a Arrival) string {
	if a.Prompt != "" {
		return a.Prompt
	}
	return fmt.Sprintf("req-%06d", i)
}

// Prompts is how the requests of a generated trace share their texts, which
// a conditioning cache turns into encodes skipped (prompt and negative
// prompt are each half of an encode).
type Prompts struct {
	// Repeat is the share of requests whose prompt is an earlier request's
	// of the same model (a person asking for more seeds), drawn uniformly
	// among the earlier ones; the rest have a prompt nobody asked before.
	Repeat float64 `json:"repeat"`
	// Hot is how many hot negative prompts there are and HotShare the
	// share of requests that use one, the k-th with weight 1/k (Zipf);
	// the rest write their own.
	Hot      int     `json:"hot_negatives"`
	HotShare float64 `json:"hot_negative_share"`
}

// DefaultPrompts is bench serve's text mix. DiffusionDB's 14 million
// Stable Diffusion images came from 1.8 million distinct prompts (87% of
// images reuse a prompt, mostly seed variants asked for together); a
// serving API also sees one-off requests and costlier videos that are
// repeated less, so half the requests repeat a prompt. Negative prompts
// are rarely written: a pipeline applies its model's default to every
// request that gives none (Wan 2.1 ships one), and front ends offer a few
// stock ones, so 90% use one of 3 hot negative prompts.
func DefaultPrompts() Prompts { return Prompts{Repeat: 0.5, Hot: 3, HotShare: 0.9} }

// Check validates a text mix.
func (p Prompts) Check() error {
	if !(p.Repeat >= 0 && p.Repeat <= 1) || !(p.HotShare >= 0 && p.HotShare <= 1) || p.Hot < 0 || p.Hot == 0 && p.HotShare > 0 {
		return fmt.Errorf("serve: prompts %+v: shares must be 0 to 1, and a hot share needs hot negative prompts", p)
	}
	return nil
}

// String says what the mix is, for a report's header.
func (p Prompts) String() string {
	return fmt.Sprintf("%.0f%% of requests repeat an earlier prompt of their model, %.0f%% use one of %d hot negative prompts (Zipf)", 100*p.Repeat, 100*p.HotShare, p.Hot)
}

// AssignPrompts gives every arrival without a prompt one, and a negative
// prompt, drawn from p with seed: the same seed gives the same texts.
// Arrivals that have a prompt keep theirs (a trace file's), and may be
// repeated by later ones.
func AssignPrompts(arr []Arrival, p Prompts, seed int64) {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x70726f6d707473))
	hotW := 0.0
	for k := 1; k <= p.Hot; k++ {
		hotW += 1 / float64(k)
	}
	earlier := map[string][]string{} // model -> prompts asked so far
	fresh := 0
	for i := range arr {
		a := &arr[i]
		if a.Prompt == "" {
			if prev := earlier[a.Model]; len(prev) > 0 && rng.Float64() < p.Repeat {
				a.Prompt = prev[rng.IntN(len(prev))]
			} else {
				a.Prompt = fmt.Sprintf("prompt-%06d", fresh)
				fresh++
			}
			a.Negative = fmt.Sprintf("negative-own-%06d", i)
			if rng.Float64() < p.HotShare {
				x := rng.Float64() * hotW
				k := 1
				for ; k < p.Hot && x >= 1/float64(k); k++ {
					x -= 1 / float64(k)
				}
				a.Negative = fmt.Sprintf("negative-hot-%d", k)
			}
		}
		earlier[a.Model] = append(earlier[a.Model], a.Prompt)
	}
}

// TextReuse is how often a trace's texts repeat: the share of requests
// whose prompt, and whose negative prompt, an earlier request of the same
// model had. It is the hit rate of an unbounded conditioning cache keyed
// by model and text, an upper bound for a real one.
type TextReuse struct {
	Prompt   float64 `json:"prompt"`
	Negative float64 `json:"negative_prompt"`
}

// Reuse measures arr's text reuse.
func Reuse(arr []Arrival) TextReuse {
	if len(arr) == 0 {
		return TextReuse{}
	}
	seen := map[[3]string]bool{}
	var p, n int
	for i, a := range arr {
		pk, nk := [3]string{a.Model, "p", PromptOf(i, a)}, [3]string{a.Model, "n", a.Negative}
		if seen[pk] {
			p++
		}
		if seen[nk] {
			n++
		}
		seen[pk], seen[nk] = true, true
	}
	return TextReuse{Prompt: float64(p) / float64(len(arr)), Negative: float64(n) / float64(len(arr))}
}

// Poisson draws open-loop arrivals at rate jobs/s (simulated) for d, each of
// a class drawn by weight, from seed: the same seed gives the same trace.
func Poisson(mix []Class, rate float64, d time.Duration, seed int64) []Arrival {
	rng := rand.New(rand.NewPCG(uint64(seed), 0x6c6d73657276))
	total := 0.0
	for _, c := range mix {
		total += c.Weight
	}
	var out []Arrival
	t := 0.0
	for {
		t += rng.ExpFloat64() / rate
		if t >= d.Seconds() {
			return out
		}
		x := rng.Float64() * total
		c := mix[len(mix)-1]
		for _, m := range mix {
			if x < m.Weight {
				c = m
				break
			}
			x -= m.Weight
		}
		out = append(out, Arrival{At: secs(t), T: t, Model: c.Model, Class: c.Class.String(), Seed: rng.Int64N(1 << 31)})
	}
}

// ReadTrace reads a JSON-lines trace, sorted by time.
func ReadTrace(r io.Reader) ([]Arrival, error) {
	var out []Arrival
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var a Arrival
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&a); err != nil {
			return nil, fmt.Errorf("serve: trace line %d: %w", n, err)
		}
		if !(a.T >= 0) || math.IsInf(a.T, 0) || a.Model == "" {
			return nil, fmt.Errorf("serve: trace line %d: want t >= 0 and a model", n)
		}
		if _, err := routing.ParseClass(a.Class); err != nil {
			return nil, fmt.Errorf("serve: trace line %d: %w", n, err)
		}
		if a.Seed == 0 {
			a.Seed = int64(n)
		}
		a.At = secs(a.T)
		out = append(out, a)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].At < out[j].At })
	return out, nil
}

// WriteTrace writes arrivals as a trace file ReadTrace reads back.
func WriteTrace(w io.Writer, arr []Arrival) error {
	enc := json.NewEncoder(w)
	for _, a := range arr {
		if err := enc.Encode(a); err != nil {
			return err
		}
	}
	return nil
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
