package testbed

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// DefaultPrompts are the demo's built-in jobs: four images of different
// sizes and one short video.
func DefaultPrompts() []engine.Spec {
	specs := []engine.Spec{
		{Prompt: "a red fox in a snowy forest at dawn", Seed: 1, Width: 256, Height: 256},
		{Prompt: "a lighthouse on a rocky coast under a stormy sky", Seed: 2, Width: 320, Height: 192},
		{Prompt: "a bowl of ripe oranges on a wooden table", Seed: 3, Width: 192, Height: 256},
		{Prompt: "neon city street at night in the rain", NegativePrompt: "blurry, low contrast", Seed: 4, Width: 256, Height: 256},
		{Prompt: "ocean waves rolling onto a sandy beach", Seed: 5, Width: 160, Height: 128, Frames: 8},
	}
	for i := range specs {
		specs[i] = specs[i].WithDefaults()
	}
	return specs
}

// maxPromptLine bounds one line of a prompts file.
const maxPromptLine = 64 << 10

// LoadPrompts reads a prompts file: one JSON object per line with the fields
// prompt, negative_prompt, seed, width, height, frames, steps,
// guidance_scale. Blank lines and lines starting with # are skipped. Every
// spec is validated against limits; errors name the line.
func LoadPrompts(r io.Reader, limits engine.Limits) ([]engine.Spec, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxPromptLine)
	var specs []engine.Spec
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		var s engine.Spec
		if err := dec.Decode(&s); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		if dec.More() {
			return nil, fmt.Errorf("line %d: more than one JSON value", n)
		}
		s = s.WithDefaults()
		if err := s.Validate(limits); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		specs = append(specs, s)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading prompts: %w", err)
	}
	if len(specs) == 0 {
		return nil, errors.New("no prompts in file")
	}
	return specs, nil
}

// DemoConfig is one run of `latentmesh-dev demo`.
type DemoConfig struct {
	Out     string        // directory for the output files (created)
	Specs   []engine.Spec // nil: DefaultPrompts
	Cluster ClusterConfig
	// Log receives the human-readable timeline as jobs finish; nil = none.
	Log io.Writer
}

// StageTiming is one stage of one job in the report.
type StageTiming struct {
	Ms   float64 `json:"ms"`
	Node string  `json:"node"`
	// Cached: the stage did not run, its output came from the
	// conditioning cache (held on Node); CacheHits: the parts of an
	// encode that did.
	Cached    bool     `json:"cached,omitempty"`
	CacheHits []string `json:"cache_hits,omitempty"`
	// Attempt counts the claims the stage's task took (1: it ran once).
	Attempt int `json:"attempt,omitempty"`
}

// DemoJob is one job of the report.
type DemoJob struct {
	ID     string                 `json:"id"`
	Prompt string                 `json:"prompt"`
	Seed   int64                  `json:"seed"`
	Output string                 `json:"output"`
	Stages map[string]StageTiming `json:"stages"`
}

// DemoReport is what --json prints.
type DemoReport struct {
	Topology Topology         `json:"topology"`
	Seconds  float64          `json:"seconds"`
	Jobs     []DemoJob        `json:"jobs"`
	Pulls    map[string]int64 `json:"pulls_by_transport"` // how payloads moved between stages
}

// RunDemo starts an in-process cluster, runs every spec through it, writes
// one file per job into cfg.Out and reports the stage timeline.
func RunDemo(ctx context.Context, cfg DemoConfig) (DemoReport, error) {
	specs := cfg.Specs
	if specs == nil {
		specs = DefaultPrompts()
	}
	logf := func(format string, a ...any) {
		if cfg.Log != nil {
			fmt.Fprintf(cfg.Log, format, a...)
		}
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return DemoReport{}, fmt.Errorf("demo: output dir: %w", err)
	}
	start := time.Now()
	logf("starting embedded etcd and a %s cluster...\n", cfg.Cluster.Topology)
	cl, err := StartCluster(ctx, cfg.Cluster)
	if err != nil {
		return DemoReport{}, err
	}
	defer cl.Close()
	for _, a := range cl.Agents {
		logf("  agent %-10s http=%s admin=%s\n", a.ID(), a.HTTPAddr(), a.AdminAddr())
	}
	logf("submitted %d jobs\n", len(specs))
	outs, err := cl.Run(ctx, specs)
	if err != nil {
		return DemoReport{}, fmt.Errorf("demo: %w", err)
	}
	rep := DemoReport{Topology: cfg.Cluster.Topology}
	for i, o := range outs {
		job := o.Job
		path := filepath.Join(cfg.Out, fileName(i, job.Spec, o.ContentType))
		if err := os.WriteFile(path, o.Data, 0o644); err != nil {
			return rep, fmt.Errorf("demo: write: %w", err)
		}
		dj := DemoJob{ID: job.ID, Prompt: job.Spec.Prompt, Seed: job.Spec.Seed, Output: path, Stages: map[string]StageTiming{}}
		for _, st := range jobs.Stages() {
			if r := job.Stages[st]; r != nil {
				dj.Stages[string(st)] = StageTiming{Ms: r.Millis, Node: r.Node, Cached: r.Cached, CacheHits: r.CacheHits, Attempt: r.Attempt}
			}
		}
		rep.Jobs = append(rep.Jobs, dj)
		logf("%s\n", timeline(dj))
	}
	if rep.Pulls, err = cl.Pulls(ctx); err != nil {
		return rep, fmt.Errorf("demo: %w", err)
	}
	rep.Seconds = time.Since(start).Seconds()
	logf("done: %d files in %s (%.1fs); payloads pulled by transport: %v\n", len(rep.Jobs), cfg.Out, rep.Seconds, rep.Pulls)
	return rep, nil
}

// fileName is NN-slug-seed.ext, stable for the same inputs so runs compare.
func fileName(i int, s engine.Spec, ctype string) string {
	ext := ".png"
	if ctype == "image/gif" {
		ext = ".gif"
	}
	var b strings.Builder
	for _, r := range strings.ToLower(s.Prompt) {
		switch {
		case r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		case b.Len() > 0 && !strings.HasSuffix(b.String(), "-"):
			b.WriteByte('-')
		}
		if b.Len() >= 32 {
			break
		}
	}
	slug := strings.Trim(b.String(), "-")
	if slug == "" {
		slug = "job"
	}
	return fmt.Sprintf("%02d-%s-%d%s", i+1, slug, s.Seed, ext)
}

func timeline(j DemoJob) string {
	var b strings.Builder
	fmt.Fprintf(&b, "job %s %q seed=%d\n", j.ID, j.Prompt, j.Seed)
	for _, st := range jobs.Stages() {
		t, ok := j.Stages[string(st)]
		switch {
		case !ok:
		case t.Cached:
			fmt.Fprintf(&b, "    %-8s   cached     on %s\n", st, t.Node)
		case len(t.CacheHits) > 0:
			fmt.Fprintf(&b, "    %-8s %8.1f ms  on %s (%s from the cache)\n", st, t.Ms, t.Node, strings.Join(t.CacheHits, ", "))
		default:
			fmt.Fprintf(&b, "    %-8s %8.1f ms  on %s\n", st, t.Ms, t.Node)
		}
	}
	fmt.Fprintf(&b, "    -> %s", j.Output)
	return b.String()
}
