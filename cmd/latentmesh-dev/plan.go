package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
)

func runPlan(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	models, err := costmodel.Load()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev plan: %v\n", err)
		return 1
	}
	fs := newFlagSet("plan", "--model M --gpus N [--rate R] [--prompt-hit-rate H --negative-hit-rate H] [--json]", stderr)
	model := fs.String("model", "", "model to size pools for: "+strings.Join(models.Names(), ", "))
	gpus := fs.Int("gpus", 0, "GPUs to split into encode, denoise and decode pools (at least 3)")
	rate := fs.Float64("rate", 0, "jobs a second the pools should sustain (0: just size them)")
	var cache costmodel.Cache
	fs.Float64Var(&cache.PromptHit, "prompt-hit-rate", 0, "conditioning cache hits of the prompt half of encode (0 to 1): with this or --negative-hit-rate, the plan sizes the encode pool with and without the cache")
	fs.Float64Var(&cache.NegativeHit, "negative-hit-rate", 0, "conditioning cache hits of the negative-prompt half of encode (0 to 1)")
	asJSON := fs.Bool("json", false, "print the plan as JSON")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	m, err := models.Model(*model)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev plan: --model: %v\n", err)
		return 2
	}
	p, err := costmodel.PlanPools(m, *gpus, *rate)
	if cache != (costmodel.Cache{}) {
		p, err = costmodel.PlanPoolsCached(m, *gpus, *rate, cache)
	}
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev plan: %v\n", err)
		return 2
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(p); err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev plan: %v\n", err)
			return 1
		}
		return 0
	}
	fmt.Fprint(stdout, p.Text())
	fmt.Fprintf(stdout, "  (stage costs on one %s: testbed/costmodel/models.json, with sources)\n", models.GPU)
	return 0
}
