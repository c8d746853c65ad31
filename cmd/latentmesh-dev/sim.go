package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
	"github.com/latentmesh/latentmesh/testbed/serve"
	"github.com/latentmesh/latentmesh/testbed/sim"
)

func runSim(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	def := sim.DefaultConfig()
	models, err := costmodel.Load()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev sim: %v\n", err)
		return 1
	}
	fs := newFlagSet("sim", "[--gpus N | --pools E:D:V] [--duration D | --trace FILE] [--model M] [--etcd-profile local|dedicated] [--measure-etcd] [--json]", stderr)
	gpus := fs.Int("gpus", 10000, "largest cluster size; the table also runs 100 and 1,000 GPUs below it")
	duration := fs.Duration("duration", time.Hour, "simulated time jobs arrive for, per run of the table (then every job drains; 0: no table)")
	sweepDur := fs.Duration("sweep-duration", 2*time.Minute, "simulated time per size of the etcd-load sweep (0: no sweep)")
	sweepModes := fs.String("sweep-modes", "mesh,mesh-nopush,mesh-nohints,central", "modes the etcd-load sweep runs, comma-separated: mesh, mesh-nopush, mesh-nohints, central")
	model := fs.String("model", def.Model, "model whose stage costs the GPUs spend: "+strings.Join(models.Names(), ", "))
	load := fs.Float64("load", def.Load, "arrival rate as a share of the pools' capacity")
	seed := fs.Uint64("seed", def.Seed, "random seed; a seed gives the same run")
	measure := fs.Bool("measure-etcd", false, "measure etcd on this machine first (embedded etcd, about 10 s) instead of the recorded figures")
	profile := fs.String("etcd-profile", sim.ProfileLocal, "etcd modelled: local (as measured on this machine) or dedicated (a dedicated cluster: 10x every capacity, the same idle latencies)")
	gossip := fs.Duration("gossip-delay", def.GossipDelay, "age of gossiped free credits")
	dispatch := fs.Duration("dispatch-cost", def.DispatchCost, "central dispatcher's time per decision")
	pools := fs.String("pools", "", "run this one shape E:D:V (encode, denoise, decode GPUs) instead of the 100 / 1,000 / --gpus table, and no sweep")
	trace := fs.String("trace", "", "replay the arrivals of a bench serve trace (--write-trace; every job of --model) instead of Poisson arrivals at --load")
	slack := fs.Int("backpressure-slack", def.Admission.Slack, "outputs that may wait for the next stage beyond its total credits, for the whole upstream pool (the agents' --backpressure-slack)")
	perProducer := fs.Int("backpressure-per-producer", def.Admission.PerProducer, "outputs that may wait for the next stage beyond its total credits, for each worker of the stage before it (the agents' --backpressure-per-producer)")
	steal := fs.Bool("steal", false, "a proposal the agents do not make yet: idle mesh workers take the claims pushed to busy peers that those would start last (one hand-over write each), against the mesh's queueing tail")
	noOffers := fs.Bool("no-offers", false, "the mesh starts a pushed task once its write and watch event land, not from its writer's offer (the agent's --no-offers: a baseline)")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if _, err := sim.EtcdProfile(*profile, def.Etcd); err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev sim: --etcd-profile: %v\n", err)
		return 2
	}
	if *duration < 0 || *sweepDur < 0 || (*duration == 0 && *sweepDur == 0) {
		fmt.Fprintln(stderr, "latentmesh-dev sim: --duration and --sweep-duration must not be negative, nor both 0")
		return 2
	}
	if _, err := models.Model(*model); err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev sim: --model: %v\n", err)
		return 2
	}
	if *slack < 0 || *perProducer < 0 {
		fmt.Fprintln(stderr, "latentmesh-dev sim: --backpressure-slack and --backpressure-per-producer must not be negative")
		return 2
	}
	var shape costmodel.Pools
	if *pools != "" {
		if shape, err = costmodel.ParsePools(*pools); err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev sim: --pools: %v\n", err)
			return 2
		}
		*gpus, *sweepDur = shape.Encode+shape.Denoise+shape.Decode, 0
	}
	var arrivals []sim.Arrival
	if *trace != "" {
		if arrivals, err = readSimTrace(*trace, *model); err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev sim: --trace: %v\n", err)
			return 2
		}
		if len(arrivals) == 0 {
			fmt.Fprintln(stderr, "latentmesh-dev sim: --trace: no arrivals")
			return 2
		}
		*duration = arrivals[len(arrivals)-1].At + time.Millisecond // the last arrival is inside it
	}
	var swept []sim.Mode
	for _, name := range strings.Split(*sweepModes, ",") {
		m, err := sim.ParseMode(strings.TrimSpace(name))
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev sim: --sweep-modes: %v\n", err)
			return 2
		}
		swept = append(swept, m)
	}
	base := def
	base.Model, base.Load, base.Seed, base.Duration = *model, *load, *seed, *duration
	base.GossipDelay, base.DispatchCost = *gossip, *dispatch
	base.Pools, base.Arrivals = shape, arrivals
	base.Admission.Slack, base.Admission.PerProducer = *slack, *perProducer
	base.Queue.Offer = !*noOffers
	base.Steal = *steal
	if *measure {
		fmt.Fprintln(stderr, "measuring the embedded etcd...")
		if base.Etcd, err = sim.MeasureEtcd(ctx, sim.DefaultMeasureConfig()); err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev sim: measure etcd: %v\n", err)
			return 1
		}
	}
	if base.Etcd, err = sim.EtcdProfile(*profile, base.Etcd); err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev sim: %v\n", err)
		return 2
	}
	rep := sim.Report{Etcd: base.Etcd}
	var sizes []int
	for _, n := range []int{100, 1000} {
		if n < *gpus && *pools == "" {
			sizes = append(sizes, n)
		}
	}
	sizes = append(sizes, *gpus)
	start := time.Now()
	var table, sweep []sim.Config
	for _, n := range sizes {
		for _, m := range sim.Modes() {
			cfg := base
			cfg.GPUs, cfg.Mode = n, m
			if *duration > 0 {
				table = append(table, cfg)
			}
		}
	}
	if *sweepDur > 0 {
		for _, n := range []int{10, 30, 100, 300, 1000, 3000, 10000, 30000} {
			if n > 3**gpus {
				break
			}
			for _, m := range swept {
				cfg := base
				cfg.GPUs, cfg.Mode, cfg.Duration = n, m, *sweepDur
				sweep = append(sweep, cfg)
			}
		}
	}
	results, err := sim.RunAll(ctx, slices.Concat(table, sweep), func(r sim.Result) {
		fmt.Fprintf(stderr, "  %d GPUs %s for %v: %.1f s\n", r.GPUs, r.Mode, r.Duration, r.WallSeconds)
	})
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev sim: %v\n", err)
		if ctx.Err() != nil {
			return 1
		}
		return 2
	}
	rep.Runs = results[:len(table)]
	rep.SetSweep(results[len(table):])
	fmt.Fprintf(stderr, "simulated in %.1f s\n", time.Since(start).Seconds())
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev sim: %v\n", err)
			return 1
		}
		return 0
	}
	rep.Text(stdout)
	return 0
}

// readSimTrace reads a bench serve trace (serve.ReadTrace) as the
// simulator's arrivals: every job must be of model, the one the simulator
// runs.
func readSimTrace(path, model string) ([]sim.Arrival, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	arr, err := serve.ReadTrace(f)
	if err != nil {
		return nil, err
	}
	out := make([]sim.Arrival, 0, len(arr))
	for i, a := range arr {
		if a.Model != model {
			return nil, fmt.Errorf("arrival %d is of %s; the simulator runs one model (--model %s)", i+1, a.Model, model)
		}
		c, err := routing.ParseClass(a.Class)
		if err != nil {
			return nil, err
		}
		out = append(out, sim.Arrival{At: a.At, Class: c})
	}
	return out, nil
}
