// Command latentmesh is the latentmesh binary: the agent daemon, a
// single-process dev cluster, the demo, a client and benchmarks. Each
// subcommand parses its flags and calls into a package.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `latentmesh: disaggregated diffusion serving on a peer-to-peer mesh

usage: latentmesh <command> [flags]

commands:
  demo       run built-in (or given) prompts on an embedded cluster and write the files
  dev        run an embedded etcd (and agents) for use through the HTTP API
  agent      run one agent daemon against an etcd cluster
  config     'config print': the agent's effective settings as YAML; 'config docs': docs/config.md
  generate   ask a running agent for one image or video, with a progress bar
  status     show an agent's view: node, peers and credits, queues, data plane
  drain      take an agent out of service: stop pulling, finish or requeue its tasks, leave, exit 0
  store      the pooled Store: 'store stat' (by mode and tier), 'store ls [--job ID]'
  version    print the version (also --version)
  engine     'engine check': drive an external engine through the worker protocol, pass/fail per check
  bench      benchmark the data plane (transfer), chunked decode (overlap) and the Store (store)
  testbed    fault-injection runs on hosts in network namespaces ('testbed chaos', as root)
  plan       size encode:denoise:decode pools for a model, GPU count and rate, and say why
  sim        simulate the control plane at 1,000-10,000 GPUs (mesh vs a central dispatcher): etcd load, conflicts, delays

Run 'latentmesh <command> -h' for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches a subcommand and returns the exit code: 0 ok, 1 failure,
// 2 bad usage.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmds := map[string]func(context.Context, []string, io.Writer, io.Writer) int{
		"demo":     runDemo,
		"dev":      runDev,
		"agent":    runAgent,
		"config":   runConfig,
		"generate": runGenerate,
		"status":   runStatus,
		"drain":    runDrain,
		"store":    runStore,
		"version":  runVersion,
		"bench":    runBench,
		"engine":   runEngine,
		"testbed":  runTestbed,
		"plan":     runPlan,
		"sim":      runSim,
	}
	switch args[0] {
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	case "--version", "-version":
		return runVersion(ctx, nil, stdout, stderr)
	}
	cmd, ok := cmds[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "latentmesh: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	return cmd(ctx, args[1:], stdout, stderr)
}
