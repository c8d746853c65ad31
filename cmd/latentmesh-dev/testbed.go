package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/testbed"
)

const testbedUsage = `usage: latentmesh-dev testbed <chaos> [flags]

  chaos      agents on hosts in network namespaces and a 3-member etcd under
             steady load while random faults are injected (kill -9,
             SIGSTOP/SIGCONT, partitions, shaped links, etcd member and
             leader kills), then invariant checks (needs root)

Run 'latentmesh-dev testbed <command> -h' for its flags.
`

func runTestbed(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, testbedUsage)
		return 2
	}
	switch args[0] {
	case "chaos":
		return runChaos(ctx, args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, testbedUsage)
		return 0
	}
	fmt.Fprintf(stderr, "latentmesh-dev testbed: unknown command %q\n\n%s", args[0], testbedUsage)
	return 2
}

func runChaos(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := testbed.DefaultChaosConfig()
	fs := newFlagSet("testbed chaos", "[--agents N] [--duration D] [--seed S] [--json] [flags]", stderr)
	fs.IntVar(&cfg.Agents, "agents", cfg.Agents, "agents, one per host; agent i serves stage i mod 3, agents past the last whole three serve every stage")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long load and faults run")
	fs.Int64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the faults, their targets and times, and the requests")
	fs.Float64Var(&cfg.Rate, "rate", cfg.Rate, "submissions a second (open loop)")
	fs.DurationVar(&cfg.FaultEvery, "fault-every", cfg.FaultEvery, "mean gap between fault starts")
	fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "once faults stop, how long to wait for every job to finish, and again for leaks to clear")
	fs.StringVar(&cfg.Dir, "dir", "", "keep agent logs, keys and etcd data in `DIR` (default: a temporary directory, kept only when an invariant fails)")
	fs.StringVar(&cfg.Binary, "agent-binary", "", "the `latentmesh` executable the agents run (default: the one beside this executable, else the one on $PATH)")
	asJSON := fs.Bool("json", false, "print the report as JSON on stdout")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if cfg.Agents < 3 {
		fmt.Fprintf(stderr, "latentmesh-dev testbed chaos: --agents %d: want at least 3 (one per stage)\n", cfg.Agents)
		return 2
	}
	if cfg.Binary == "" {
		bin, err := agentBinary()
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev testbed chaos: %v (build it with 'go build -o DIR/latentmesh ./cmd/latentmesh', or give --agent-binary)\n", err)
			return 1
		}
		cfg.Binary = bin
	}
	cfg.Progress = stderr
	rep, err := testbed.RunChaos(ctx, cfg)
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", err, context.Cause(ctx))
		}
		fmt.Fprintf(stderr, "latentmesh-dev testbed chaos: %v\n", err)
		return 1
	}
	if *asJSON {
		if err := writeJSON(stdout, rep); err != nil {
			return 1
		}
	} else {
		fmt.Fprintf(stdout, "accepted %d  completed %d  failed %d  lost %d  duplicate commits %d  leaked payloads %d  corrupt %d\n",
			rep.Accepted, rep.Completed, rep.Failed, rep.Lost, rep.DuplicateCommits, rep.LeakedPayloads, rep.Corrupt)
		fmt.Fprintf(stdout, "faults injected %d %v; refused %d, unanswered %d, unacknowledged %d\n",
			rep.FaultsInjected, rep.Faults, rep.Refused, rep.Unanswered, rep.Unacknowledged)
		for _, v := range rep.Violations {
			fmt.Fprintln(stdout, v)
		}
	}
	if !rep.OK() {
		fmt.Fprintf(stderr, "latentmesh-dev testbed chaos: invariants violated; logs in %s\n", rep.Dir)
		return 1
	}
	return 0
}

// agentBinary finds the latentmesh executable that runs `agent`: the one
// beside this executable (as `go build -o DIR/ ./cmd/...` leaves them),
// else the one on $PATH.
func agentBinary() (string, error) {
	if exe, err := os.Executable(); err == nil {
		bin := filepath.Join(filepath.Dir(exe), "latentmesh")
		if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() {
			return bin, nil
		}
	}
	return exec.LookPath("latentmesh")
}
