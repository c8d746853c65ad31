package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/testbed"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("demo", "--out DIR [flags]", stderr)
	var (
		out      = fs.String("out", "", "directory for the output files (required)")
		prompts  = fs.String("prompts", "", "JSON-lines `FILE` of jobs (prompt, negative_prompt, seed, width, height, frames, steps, guidance_scale); default: 4 images and 1 video")
		topology = fs.String("topology", "disaggregated", "disaggregated (one agent per stage) or colocated (one agent, all roles)")
		asJSON   = fs.Bool("json", false, "print the report as JSON on stdout")
		verbose  = fs.Bool("v", false, "log agent events (console format, stderr)")
		cost     cli.SimCost
	)
	fs.Var(&cost, "sim-cost", "simulated GPU time, e.g. `encode=5ms,step=20ms,decode=50ms`")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if *out == "" {
		fmt.Fprintln(stderr, "latentmesh-dev demo: --out DIR is required")
		fs.Usage()
		return 2
	}
	top, err := testbed.ParseTopology(*topology)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev demo: %v\n", err)
		return 2
	}
	cfg := testbed.DemoConfig{Out: *out, Cluster: testbed.DefaultClusterConfig()}
	cfg.Cluster.Topology = top
	cost.Apply(&cfg.Cluster.Agent.Engine)
	if *prompts != "" {
		f, err := os.Open(*prompts)
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev demo: %v\n", err)
			return 1
		}
		cfg.Specs, err = testbed.LoadPrompts(f, engine.DefaultLimits())
		f.Close()
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev demo: %s: %v\n", *prompts, err)
			return 1
		}
	}
	level := zapcore.WarnLevel
	if *verbose {
		level = zapcore.InfoLevel
	}
	log, err := cli.NewLogger("console", false, stderr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	cfg.Cluster.Logger = log.WithOptions(zap.IncreaseLevel(level))
	if *asJSON {
		cfg.Log = stderr // keep stdout for the JSON document
	} else {
		cfg.Log = stdout
	}
	rep, err := testbed.RunDemo(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev demo: %v\n", err)
		return 1
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return 1
		}
	}
	return 0
}
