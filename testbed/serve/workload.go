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
// A trace file is JSON lines of {"t": seconds, "model": m, "class": c}.
type Arrival struct {
	At    time.Duration `json:"-"`
	T     float64       `json:"t"`
	Model string        `json:"model"`
	Class string        `json:"class"`
	Seed  int64         `json:"seed,omitempty"`
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
