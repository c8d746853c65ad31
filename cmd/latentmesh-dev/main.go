// Command latentmesh-dev is the developer's and benchmarker's latentmesh:
// the demo, a single-process dev cluster, the benchmarks, the fault-injection
// testbed, pool planning and the control-plane simulator. They run on
// testbed's in-process meshes and an embedded etcd, which the daemon binary
// (cmd/latentmesh) does not link; each subcommand parses its flags and
// calls into a package.
package main

import (
	"context"
	"flag"
	"io"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
)

const usage = `latentmesh-dev: the latentmesh demo, dev cluster, benchmarks and simulators

usage: latentmesh-dev <command> [flags]

commands:
  demo       run built-in (or given) prompts on an embedded cluster and write the files
  dev        run an embedded etcd (and agents) for use through the HTTP API
  bench      benchmark the data plane (transfer), chunked decode (overlap), the Store (store), serving (serve), the API (api) and etcd load (control)
  testbed    fault-injection runs on hosts in network namespaces ('testbed chaos', as root)
  plan       size encode:denoise:decode pools for a model, GPU count and rate, and say why
  sim        simulate the control plane at 1,000-10,000 GPUs (mesh vs a central dispatcher): etcd load, conflicts, delays

The daemon and its client commands (agent, generate, status, drain, store,
engine check) are the latentmesh binary's. Run 'latentmesh-dev <command> -h'
for a command's flags.
`

func main() { cli.Main(run) }

// run dispatches a subcommand and returns the exit code: 0 ok, 1 failure,
// 2 bad usage.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return cli.Dispatch(ctx, "latentmesh-dev", usage, map[string]cli.Command{
		"demo":    runDemo,
		"dev":     runDev,
		"bench":   runBench,
		"testbed": runTestbed,
		"plan":    runPlan,
		"sim":     runSim,
	}, args, stdout, stderr)
}

// newFlagSet returns the flag set of `latentmesh-dev name`.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	return cli.NewFlagSet("latentmesh-dev", name, synopsis, stderr)
}
