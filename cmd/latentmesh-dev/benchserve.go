package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
	"github.com/latentmesh/latentmesh/testbed/serve"
)

func runBenchServe(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	models, err := costmodel.Load()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev bench serve: %v\n", err)
		return 1
	}
	cfg := serve.DefaultConfig()
	fs := newFlagSet("bench serve", "[flags]", stderr)
	topology := fs.String("topology", string(cfg.Topology), "colocated (every GPU runs every stage) or disaggregated (a pool per stage)")
	fs.IntVar(&cfg.GPUs, "gpus", cfg.GPUs, "simulated GPUs, one agent each")
	pools := fs.String("pools", "", "disaggregated pools `E:D:V` (default: planned from the mix's stage times, as 'latentmesh-dev plan')")
	mix := fs.String("mix", "wan2.1-t2v-1.3b:standard", "load mix: comma-separated `model[:class[:weight[:slo]]]`; models: "+strings.Join(models.Names(), ", "))
	rate := fs.Float64("rate", 0, "arrivals a second, simulated time (0: --load of what the GPUs can do)")
	load := fs.Float64("load", 0.9, "with --rate 0: offered load as a share of the GPUs' capacity (GPUs / mean GPU time per job)")
	duration := fs.Duration("duration", 5*time.Minute, "arrival window, simulated time")
	trace := fs.String("trace", "", "JSON-lines `file` of arrivals ({\"t\":s,\"model\":m,\"class\":c}) instead of --rate")
	writeTrace := fs.String("write-trace", "", "write the arrivals offered to `file`, for a rerun with --trace")
	seed := fs.Int64("seed", 1, "seed of the Poisson arrivals")
	fs.Float64Var(&cfg.Compression, "compression", cfg.Compression, "time compression: simulated GPU times are divided by it, reported times multiplied back")
	fs.Float64Var(&cfg.ByteScale, "byte-scale", cfg.ByteScale, "divide payload sizes by this (1: the models' real sizes)")
	fs.Float64Var(&cfg.Tiling, "tiling", cfg.Tiling, "colocated VAE tiling slowdown of video decode (1.0 or 1.3 in issue 10)")
	fs.Float64Var(&cfg.GPUMemGB, "gpu-mem", cfg.GPUMemGB, "GB of one GPU's memory")
	fs.DurationVar(&cfg.Drain, "drain", cfg.Drain, "simulated time to wait for jobs after the last arrival")
	scheduler := fs.String("scheduler", cfg.Queue.Scheduler.String(), "queue order: priority (class with aging, then deadline, then age) or fifo (enqueue time only: a baseline)")
	fs.DurationVar(&cfg.Queue.PreemptAfter, "preempt-after", cfg.Queue.PreemptAfter, "simulated time an interactive task waits while denoise slots run batch work before one batch task in the stage is requeued (0: never)")
	fs.DurationVar(&cfg.Queue.AgingStep, "aging-step", cfg.Queue.AgingStep, "simulated wait that lifts a task one class")
	fs.IntVar(&cfg.Admission.Slack, "backpressure-slack", cfg.Admission.Slack, "outputs that may wait for the next stage beyond its credits, for the whole upstream pool (negative: two per GPU)")
	fs.IntVar(&cfg.Admission.PerProducer, "backpressure-per-producer", cfg.Admission.PerProducer, "outputs that may wait for the next stage beyond its credits, for each agent of the stage before it (the agents' --backpressure-per-producer)")
	fs.IntVar(&cfg.CheckpointEvery, "checkpoint-every", cfg.CheckpointEvery, "denoise steps between step checkpoints in the Store (0: only where a preemption stops a denoise)")
	fs.BoolVar(&cfg.NoCheckpoints, "no-checkpoints", cfg.NoCheckpoints, "simulate GPUs that cannot checkpoint: a preempted denoise is cancelled and starts over")
	fs.BoolVar(&cfg.NoCondCache, "no-cond-cache", cfg.NoCondCache, "run the agents without the conditioning cache: every job encodes both its texts")
	compare := fs.Bool("compare-checkpoints", false, "run the trace twice, without checkpoints (as --no-checkpoints) and with them (--checkpoint-every), and print the two side by side")
	texts := serve.DefaultPrompts()
	fs.Float64Var(&texts.Repeat, "repeat-prompts", texts.Repeat, "share of generated requests that repeat an earlier prompt of their model; DiffusionDB's 14M images came from 1.8M distinct prompts (87% reuse one, mostly seed variants asked together), a serving API sees one-off requests and fewer repeated videos too")
	fs.IntVar(&texts.Hot, "hot-negatives", texts.Hot, "hot negative prompts (a model's default, which a pipeline such as Wan 2.1's applies when a request gives none, and a front end's stock ones)")
	fs.Float64Var(&texts.HotShare, "hot-negative-share", texts.HotShare, "share of generated requests using a hot negative prompt (Zipf over them); the rest write their own")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	plot := fs.String("plot", "", "write a PNG `file`: latency CDF per class and a Gantt chart of sample jobs")
	sample := fs.Int("jobs", 8, "sample jobs whose breakdown is printed")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	fail := func(code int, err error) int {
		fmt.Fprintf(stderr, "latentmesh-dev bench serve: %v\n", err)
		return code
	}
	if cfg.Topology, err = testbed.ParseTopology(*topology); err != nil {
		return fail(2, err)
	}
	if cfg.Queue.Scheduler, err = routing.ParseScheduler(*scheduler); err != nil {
		return fail(2, err)
	}
	if cfg.Queue.PreemptAfter < 0 || cfg.Queue.AgingStep <= 0 {
		return fail(2, fmt.Errorf("--preempt-after must not be negative and --aging-step must be positive"))
	}
	if cfg.CheckpointEvery < 0 {
		return fail(2, fmt.Errorf("--checkpoint-every must not be negative"))
	}
	if err := texts.Check(); err != nil {
		return fail(2, err)
	}
	if *compare && (*plot != "" || cfg.NoCheckpoints) {
		return fail(2, fmt.Errorf("--compare-checkpoints runs both ways and draws no plot: drop --no-checkpoints and --plot"))
	}
	if *pools != "" {
		if cfg.Pools, err = costmodel.ParsePools(*pools); err != nil {
			return fail(2, err)
		}
	}
	if cfg.Mix, err = serve.ParseMix(*mix, models); err != nil {
		return fail(2, err)
	}
	if *trace != "" {
		f, err := os.Open(*trace)
		if err != nil {
			return fail(2, err)
		}
		cfg.Arrivals, err = serve.ReadTrace(f)
		f.Close()
		if err != nil {
			return fail(2, err)
		}
	} else {
		r := *rate
		if r <= 0 {
			r = *load * float64(cfg.GPUs) / serve.MixModel(models, cfg.Mix).Total().Seconds()
		}
		cfg.Arrivals = serve.Poisson(cfg.Mix, r, *duration, *seed)
		fmt.Fprintf(stderr, "offering %.3f jobs/s for %s (simulated): %d arrivals\n", r, *duration, len(cfg.Arrivals))
	}
	for _, a := range cfg.Arrivals {
		if a.Prompt == "" { // texts the trace does not name are drawn from the flags
			serve.AssignPrompts(cfg.Arrivals, texts, *seed)
			cfg.Prompts = &texts
			break
		}
	}
	if *writeTrace != "" {
		f, err := os.Create(*writeTrace)
		if err != nil {
			return fail(1, err)
		}
		err = serve.WriteTrace(f, cfg.Arrivals)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fail(1, err)
		}
	}
	if *compare {
		c, err := serve.CompareCheckpoints(ctx, cfg)
		if err != nil {
			return fail(1, err)
		}
		if *asJSON {
			err = writeJSON(stdout, c)
		} else {
			c.Without.Text(stdout, 0)
			fmt.Fprintln(stdout)
			c.With.Text(stdout, 0)
			fmt.Fprintln(stdout)
			c.Text(stdout)
		}
		if err != nil {
			return fail(1, err)
		}
		return 0
	}
	rep, err := serve.Run(ctx, cfg)
	if err != nil {
		return fail(1, err)
	}
	if *plot != "" {
		if err := rep.WritePlot(*plot, 20); err != nil {
			return fail(1, err)
		}
	}
	if *asJSON {
		err = writeJSON(stdout, rep)
	} else {
		rep.Text(stdout, *sample)
	}
	if err != nil {
		return fail(1, err)
	}
	return 0
}
