package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/testbed"
)

func runDev(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("dev", "[flags]", stderr)
	var (
		httpAddr   = fs.String("http", "127.0.0.1:8080", "client API address of the first agent")
		adminAddr  = fs.String("admin", "127.0.0.1:9090", "admin address of the first agent")
		adminToken = fs.String("admin-token", "", "bearer token for the admin endpoints (required when --admin is not loopback)")
		n          = fs.Int("agents", 3, "agents to run: 1 (all roles), 3 or more (roles round-robin: encode, denoise, decode), or 0 (etcd only, for separate 'latentmesh agent' processes)")
		etcdListen = fs.String("etcd-listen", "127.0.0.1:2379", "embedded etcd client address (port 0: any free port)")
		prefix     = fs.String("prefix", "/latentmesh/default", "etcd key prefix of the mesh")
		verbose    = fs.Bool("v", false, "debug logs")
		cost       cli.SimCost
	)
	fs.Var(&cost, "sim-cost", "simulated GPU time, e.g. `encode=5ms,step=20ms,decode=50ms`")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if *n < 0 || *n == 2 {
		fmt.Fprintf(stderr, "latentmesh-dev dev: --agents %d: want 0, 1, or 3 or more (every stage needs an agent)\n", *n)
		return 2
	}
	log, err := cli.NewLogger("console", *verbose, stderr)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	cfg := testbed.DefaultClusterConfig()
	cfg.Logger = log
	cfg.Etcd.ClientURL = "http://" + *etcdListen
	cfg.Agent.Prefix, cfg.Agent.AdminToken = *prefix, *adminToken
	cost.Apply(&cfg.Agent.Engine)
	cfg.Topology = "" // agents are added below
	cl, err := testbed.StartCluster(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev dev: %v\n", err)
		return 1
	}
	defer cl.Close()
	fmt.Fprintf(stdout, "etcd endpoint: %s (prefix %s)\n", strings.Join(cl.Etcd.Endpoints(), ","), *prefix)

	for i := 0; i < *n; i++ {
		ac := cfg.Agent
		ac.Logger = log
		if *n == 1 {
			ac.Roles, ac.NodeID = jobs.Stages(), "dev-all"
		} else {
			st := jobs.Stages()[i%3]
			ac.Roles, ac.NodeID = []jobs.Stage{st}, fmt.Sprintf("dev-%s-%d", st, i/3+1)
		}
		if i == 0 {
			ac.HTTPListen, ac.AdminListen = *httpAddr, *adminAddr
		}
		a, err := cl.AddAgentConfig(ctx, ac)
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev dev: agent %s: %v\n", ac.NodeID, err)
			return 1
		}
		fmt.Fprintf(stdout, "agent %-16s roles=%-24s http=%s admin=%s\n", a.ID(), fmt.Sprint(ac.Roles), a.HTTPAddr(), a.AdminAddr())
	}
	if *n == 0 {
		fmt.Fprintf(stdout, "join agents with: latentmesh agent --etcd-endpoints %s --roles encode,denoise,decode\n", cl.Etcd.Endpoints()[0])
	} else {
		fmt.Fprintf(stdout, "try: latentmesh generate --server http://%s --prompt \"a red fox\" -o fox.png\n", cl.Agents[0].HTTPAddr())
	}
	fmt.Fprintln(stdout, "running; Ctrl-C to stop")
	<-ctx.Done()
	fmt.Fprintln(stdout, "stopping")
	return 0
}
