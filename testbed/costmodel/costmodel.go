// Package costmodel holds what one GPU spends on each stage of published
// diffusion models (models.json, with its sources), and sizes stage pools
// from it: `latentmesh-dev plan`, and the simulated GPU time of `bench serve`
// and `latentmesh-dev sim`.
package costmodel

import (
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
)

//go:embed models.json
var modelsJSON []byte

// Stages are the three stages in pipeline order.
var Stages = []string{"encode", "denoise", "decode"}

// Tensor is a tensor's shape and element type.
type Tensor struct {
	Shape      []int  `json:"shape"`
	DType      string `json:"dtype"`
	Derivation string `json:"derivation"`
}

// dtypeBytes is the size of one element of each type a model file may name.
var dtypeBytes = map[string]int64{"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

// Bytes is the tensor's size.
func (t Tensor) Bytes() int64 {
	n := dtypeBytes[t.DType]
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// Model is one model's cost on one GPU.
type Model struct {
	Name     string             `json:"-"`
	Kind     string             `json:"kind"` // "image" or "video"
	EncodeMs float64            `json:"encode_ms"`
	StepMs   float64            `json:"step_ms"`
	Steps    int                `json:"steps"`
	DecodeMs float64            `json:"decode_ms"`
	Latent   Tensor             `json:"latent"`
	Cond     Tensor             `json:"cond"`
	Frames   int                `json:"frames"`
	Weights  map[string]float64 `json:"weights_gb"` // per stage, GB
	Timing   string             `json:"timing_source"`
	Shape    string             `json:"shape_source"`
}

// StageTime is what one job of m costs stage st on one GPU, at the model's
// default step count.
func (m Model) StageTime(st string) time.Duration {
	ms := 0.0
	switch st {
	case "encode":
		ms = m.EncodeMs
	case "denoise":
		ms = m.StepMs * float64(m.Steps)
	case "decode":
		ms = m.DecodeMs
	}
	return time.Duration(ms * float64(time.Millisecond))
}

// Total is one job's GPU time over all three stages.
func (m Model) Total() time.Duration {
	var t time.Duration
	for _, st := range Stages {
		t += m.StageTime(st)
	}
	return t
}

// WeightBytes is the memory stage st's weights take.
func (m Model) WeightBytes(st string) int64 { return int64(m.Weights[st] * 1e9) }

// File is models.json.
type File struct {
	GPU     string            `json:"gpu"`
	Notes   string            `json:"notes"`
	Sources map[string]string `json:"sources"`
	Models  map[string]Model  `json:"models"`
}

// Load reads the models shipped with latentmesh.
func Load() (File, error) { return Parse(modelsJSON) }

// Parse reads and checks a models file: every figure positive, every
// tensor of a known type, every timing and shape attributed to a source
// the file lists.
func Parse(b []byte) (File, error) {
	var f File
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return File{}, fmt.Errorf("costmodel: %w", err)
	}
	if len(f.Models) == 0 {
		return File{}, errors.New("costmodel: no models")
	}
	for name, m := range f.Models {
		m.Name = name
		if err := m.check(f.Sources); err != nil {
			return File{}, fmt.Errorf("costmodel: model %s: %w", name, err)
		}
		f.Models[name] = m
	}
	return f, nil
}

func (m Model) check(sources map[string]string) error {
	if m.Kind != "image" && m.Kind != "video" {
		return fmt.Errorf("kind %q: want image or video", m.Kind)
	}
	for what, v := range map[string]float64{"encode_ms": m.EncodeMs, "step_ms": m.StepMs, "decode_ms": m.DecodeMs, "steps": float64(m.Steps), "frames": float64(m.Frames)} {
		if !(v > 0) || math.IsInf(v, 0) {
			return fmt.Errorf("%s = %v: must be positive", what, v)
		}
	}
	for what, t := range map[string]Tensor{"latent": m.Latent, "cond": m.Cond} {
		if _, ok := dtypeBytes[t.DType]; !ok || len(t.Shape) == 0 {
			return fmt.Errorf("%s: shape %v dtype %q", what, t.Shape, t.DType)
		}
		for _, d := range t.Shape {
			if d <= 0 {
				return fmt.Errorf("%s: shape %v", what, t.Shape)
			}
		}
	}
	for _, st := range Stages {
		if !(m.Weights[st] > 0) {
			return fmt.Errorf("weights_gb.%s missing", st)
		}
	}
	for what, src := range map[string]string{"timing_source": m.Timing, "shape_source": m.Shape} {
		key, _, _ := strings.Cut(src, " ")
		if _, ok := sources[key]; !ok {
			return fmt.Errorf("%s %q names no listed source", what, src)
		}
	}
	return nil
}

// Names lists the models, sorted.
func (f File) Names() []string {
	var out []string
	for n := range f.Models {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Model returns the named model.
func (f File) Model(name string) (Model, error) {
	m, ok := f.Models[name]
	if !ok {
		return Model{}, fmt.Errorf("costmodel: no model %q (have %s)", name, strings.Join(f.Names(), ", "))
	}
	return m, nil
}
