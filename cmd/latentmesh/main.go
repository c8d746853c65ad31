// Command latentmesh is the latentmesh binary that nodes run and packages
// ship: the agent daemon and its client and operator commands. It links
// neither the test harness (testbed, its benches and simulators) nor an
// etcd server (deps_test.go keeps it so); the demo, the dev cluster and the
// benchmarks are cmd/latentmesh-dev's. Each subcommand parses its flags and
// calls into a package.
package main

import (
	"context"
	"io"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
)

const usage = `latentmesh: disaggregated diffusion serving on a peer-to-peer mesh

usage: latentmesh <command> [flags]

commands:
  agent      run one agent daemon against an etcd cluster
  config     'config print': the agent's effective settings as YAML; 'config docs': docs/config.md
  generate   ask a running agent for one image or video, with a progress bar
  status     show an agent's view: node, peers and credits, queues, data plane
  drain      take an agent out of service: stop pulling, finish or requeue its tasks, leave, exit 0
  store      the pooled Store: 'store stat' (by mode and tier), 'store ls [--job ID]'
  version    print the version (also --version)
  engine     'engine check': drive an external engine through the worker protocol, pass/fail per check

The demo, the dev cluster, the benchmarks, the testbed, plan and sim are
latentmesh-dev's (go build ./cmd/latentmesh-dev). Run 'latentmesh <command>
-h' for a command's flags.
`

func main() { cli.Main(run) }

// run dispatches a subcommand and returns the exit code: 0 ok, 1 failure,
// 2 bad usage.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		return runVersion(ctx, nil, stdout, stderr)
	}
	return cli.Dispatch(ctx, "latentmesh", usage, map[string]cli.Command{
		"agent":    runAgent,
		"config":   runConfig,
		"generate": runGenerate,
		"status":   runStatus,
		"drain":    runDrain,
		"store":    runStore,
		"version":  runVersion,
		"engine":   runEngine,
	}, args, stdout, stderr)
}
