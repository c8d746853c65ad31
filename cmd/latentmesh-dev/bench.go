package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"

	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/cmd/internal/cli"
	"github.com/latentmesh/latentmesh/testbed"
	"github.com/latentmesh/latentmesh/testbed/bench"
)

const benchUsage = `usage: latentmesh-dev bench <transfer|overlap|store|serve|api|control> [flags]

  transfer   data-plane throughput against raw TCP (tcp) and memcpy (shm),
             producer and consumer in two processes
  overlap    chunked pull-and-decode of a video latent against pull whole,
             then decode
  store      pooled Store put (R copies along a chain: until the first and
             until all R) and get against p2p pulls of the same size, on an
             in-process mesh of Store nodes and etcd
  serve      an in-process mesh of simulated GPUs serving an open-loop
             load of published models (testbed/costmodel), colocated or
             disaggregated: throughput, goodput, latency, breakdown
  api        tiny jobs through the client HTTP API: client latency, what
             the control plane adds to the stages, jobs/s, a per-job
             breakdown (an in-process dev mesh, or --server)
  control    what one job and one idle agent cost etcd, counted by etcd
             itself (/metrics), on fleets of 4 and 26 agents, each on its
             own Debian etcd 3.4 (scripts/install-deps.sh installs it)

Run 'latentmesh-dev bench <command> -h' for its flags.
`

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, benchUsage)
		return 2
	}
	switch args[0] {
	case "transfer":
		return runBenchTransfer(ctx, args[1:], stdout, stderr)
	case "overlap":
		return runBenchOverlap(ctx, args[1:], stdout, stderr)
	case "store":
		return runBenchStore(ctx, args[1:], stdout, stderr)
	case "serve":
		return runBenchServe(ctx, args[1:], stdout, stderr)
	case "api":
		return runBenchAPI(ctx, args[1:], stdout, stderr)
	case "control":
		return runBenchControl(ctx, args[1:], stdout, stderr)
	case "producer":
		return runBenchProducer(ctx, args[1:], stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, benchUsage)
		return 0
	}
	fmt.Fprintf(stderr, "latentmesh-dev bench: unknown benchmark %q\n\n%s", args[0], benchUsage)
	return 2
}

// sizesFlag is --sizes 4MiB,64MiB,256MiB.
type sizesFlag []int64

func (s *sizesFlag) String() string {
	parts := make([]string, len(*s))
	for i, n := range *s {
		parts[i] = bytesize.Format(n)
	}
	return strings.Join(parts, ",")
}

func (s *sizesFlag) Set(v string) error {
	n, err := bytesize.ParseList(v)
	if err != nil {
		return err
	}
	*s = n
	return nil
}

// listFlag is a comma-separated list of words.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	*l = nil
	for _, w := range strings.Split(v, ",") {
		if w = strings.TrimSpace(w); w != "" {
			*l = append(*l, w)
		}
	}
	if len(*l) == 0 {
		return fmt.Errorf("empty list %q", v)
	}
	return nil
}

// intsFlag is a comma-separated list of positive integers: --agents 4,26.
type intsFlag []int

func (l *intsFlag) String() string {
	parts := make([]string, len(*l))
	for i, n := range *l {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ",")
}

func (l *intsFlag) Set(v string) error {
	*l = nil
	for _, w := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(w))
		if err != nil || n <= 0 {
			return fmt.Errorf("want positive integers, comma-separated, got %q", v)
		}
		*l = append(*l, n)
	}
	return nil
}

// frameSize is --size WxH.
type frameSize struct{ w, h int }

func (f *frameSize) String() string { return fmt.Sprintf("%dx%d", f.w, f.h) }

func (f *frameSize) Set(v string) error {
	if _, err := fmt.Sscanf(v, "%dx%d", &f.w, &f.h); err != nil || f.String() != v {
		return fmt.Errorf("want WxH, e.g. 256x256, got %q", v)
	}
	return nil
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func runBenchTransfer(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := bench.DefaultTransferConfig()
	fs := newFlagSet("bench transfer", "[flags]", stderr)
	sizes := sizesFlag(cfg.Sizes)
	transports := listFlag(cfg.Transports)
	fs.Var(&sizes, "sizes", "payload `sizes`, comma-separated (B, KiB, MiB, GiB, KB, MB, GB)")
	fs.Var(&transports, "transports", "`transports` to measure: tcp (against raw TCP), shm (against memcpy)")
	fs.IntVar(&cfg.Conns, "conns", cfg.Conns, "TCP connections per pull, for transfer and the raw-TCP baseline")
	fs.IntVar(&cfg.Reps, "reps", cfg.Reps, "measured repetitions per size, after one warm-up")
	fs.IntVar(&cfg.Chunks, "chunks", cfg.Chunks, "chunks of the chunked pull measured beside each size (1: none)")
	fs.BoolVar(&cfg.Transfer.ChecksumTCP, "checksum", cfg.Transfer.ChecksumTCP, "verify XXH3 block checksums on TCP pulls (the service default)")
	fs.StringVar(&cfg.Transfer.TCPCongestion, "tcp-congestion", cfg.Transfer.TCPCongestion, "congestion control of the data plane's senders and of the tuned raw-TCP baseline (empty: the system default, no tuned baseline)")
	asJSON := fs.Bool("json", false, "print machine-readable results")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	cfg.Sizes, cfg.Transports, cfg.Progress = sizes, transports, stderr
	rep, err := bench.RunTransfer(ctx, cfg)
	return report("transfer", rep, err, *asJSON, stdout, stderr)
}

// report prints a benchmark's results as a table, or JSON with --json, and
// returns the exit code.
func report(name string, rep interface{ WriteTable(io.Writer) error }, err error, asJSON bool, stdout, stderr io.Writer) int {
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev bench %s: %v\n", name, err)
		return 1
	}
	if asJSON {
		err = writeJSON(stdout, rep)
	} else {
		err = rep.WriteTable(stdout)
	}
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	return 0
}

func runBenchOverlap(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := bench.DefaultOverlapConfig()
	fs := newFlagSet("bench overlap", "[flags]", stderr)
	size := frameSize{cfg.Width, cfg.Height}
	fs.IntVar(&cfg.Frames, "frames", cfg.Frames, "video frames (one chunk each)")
	fs.Var(&size, "size", "frame size `WxH` in pixels (multiples of 8)")
	fs.DurationVar(&cfg.ChunkInterval, "chunk-interval", cfg.ChunkInterval, "how often the producer finishes a frame; 0: one frame's measured decode time (a balanced pipeline)")
	fs.IntVar(&cfg.Reps, "reps", cfg.Reps, "measured repetitions of each path, after one warm-up")
	asJSON := fs.Bool("json", false, "print machine-readable results")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	cfg.Width, cfg.Height, cfg.Progress = size.w, size.h, stderr
	rep, err := bench.RunOverlap(ctx, cfg)
	return report("overlap", rep, err, *asJSON, stdout, stderr)
}

func runBenchStore(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := bench.DefaultStoreConfig()
	fs := newFlagSet("bench store", "[flags]", stderr)
	sizes := sizesFlag(cfg.Sizes)
	transports := listFlag(cfg.Transports)
	fs.Var(&sizes, "sizes", "object `sizes`, comma-separated (B, KiB, MiB, GiB, KB, MB, GB)")
	fs.Var(&transports, "transports", "`transports` to measure: tcp, shm (each against p2p pulls over it)")
	fs.IntVar(&cfg.Reps, "reps", cfg.Reps, "measured repetitions per size, after one warm-up")
	fs.IntVar(&cfg.Replicas, "replicas", cfg.Replicas, "copies of each put (R), on as many holders")
	fs.IntVar(&cfg.Chunks, "chunks", cfg.Chunks, "chunks of each object (1: a checkpoint's; more: the chain pulls chunk by chunk)")
	asJSON := fs.Bool("json", false, "print machine-readable results")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run (mesh included) to `FILE`")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if *cpuProfile != "" {
		stop, err := startCPUProfile(*cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev bench store: %v\n", err)
			return 1
		}
		defer stop()
	}
	cfg.Sizes, cfg.Transports, cfg.Progress = sizes, transports, stderr
	rep, err := bench.RunStore(ctx, cfg)
	return report("store", rep, err, *asJSON, stdout, stderr)
}

func runBenchAPI(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := testbed.DefaultAPIBenchConfig()
	fs := newFlagSet("bench api", "[flags]", stderr)
	fs.StringVar(&cfg.Server, "server", "", "client API `URL` to load; empty: start an in-process 3-agent dev mesh with embedded etcd")
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "concurrent clients, each with one job at a time")
	fs.IntVar(&cfg.Jobs, "jobs", cfg.Jobs, "jobs in all, after one warm-up job")
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "denoise steps per job")
	fs.IntVar(&cfg.DenoiseSlots, "denoise-slots", 0, "denoise slots of the in-process mesh's denoise agent (0: the default, 1)")
	fs.BoolVar(&cfg.EtcdFsync, "etcd-fsync", false, "in-process mesh: the embedded etcd fsyncs its log, as an etcd whose data must survive a crash (default: not, since its temporary directory is removed on exit)")
	fs.BoolVar(&cfg.NoPush, "no-push", false, "in-process mesh: no claim is pushed with its task; dispatchers hand every task on against workers' grants (a baseline)")
	fs.DurationVar(&cfg.EtcdWriteDelay, "etcd-write-delay", 0, "in-process mesh: every etcd write the agents send waits this long first, as on a loaded etcd (0: none)")
	fs.BoolVar(&cfg.NoOffers, "no-offers", false, "in-process mesh: a pushed task starts once its write's watch event arrives, not from the claim its writer offers over libp2p (a baseline)")
	fs.IntVar(&cfg.Slack, "backpressure-slack", cfg.Slack, "in-process mesh: the agents' backpressure slack for the whole upstream pool (negative: the agent default, 1; each producer adds its own --backpressure-per-producer share, 2)")
	fs.BoolVar(&cfg.EtcdGRPC, "etcd-grpc", false, "in-process mesh: agents reach the embedded etcd over loopback gRPC, as remote agents do (default: function calls, as 'latentmesh-dev dev')")
	size := frameSize{cfg.Width, cfg.Height}
	fs.Var(&size, "size", "image size `WxH` in pixels (multiples of 8)")
	asJSON := fs.Bool("json", false, "print machine-readable results")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run (mesh included) to `FILE`")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	cfg.Width, cfg.Height = size.w, size.h
	if *cpuProfile != "" {
		stop, err := startCPUProfile(*cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "latentmesh-dev bench api: %v\n", err)
			return 1
		}
		defer stop()
	}
	rep, err := testbed.RunAPIBench(ctx, cfg)
	return report("api", rep, err, *asJSON, stdout, stderr)
}

func runBenchControl(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg := testbed.DefaultControlBenchConfig()
	fs := newFlagSet("bench control", "[flags]", stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: latentmesh-dev bench control [flags]

What one job costs etcd, and what an idle agent does, at several fleet
sizes, as etcd itself counts it: its /metrics are read before and after
the jobs and after an idle window. Each fleet is 1 encode, N-2 denoise
and 1 decode agents in this process (simulated GPU time, a few ms a
stage), on a fresh etcd started with its default flags: Debian's etcd
3.4 from PATH (scripts/install-deps.sh installs it), or --etcd-endpoints.
Jobs go through the client HTTP API (submit, then long-poll). Per job:
watch events sent, raft proposals, ranges, transactions and the gRPC
requests; idle: per agent and second. The simulator (latentmesh-dev sim)
runs on each fleet's shape, and its events and write transactions a job
are shown beside etcd's. The last lines compare the largest fleet with
the smallest, both with the budget of issue 18, and the simulator with
etcd.

`)
		fs.PrintDefaults()
	}
	agents := intsFlag(cfg.Agents)
	var endpoints listFlag
	fs.Var(&agents, "agents", "fleet `sizes` in agents, comma-separated: 1 encode + N-2 denoise + 1 decode each (N >= 3)")
	fs.IntVar(&cfg.Jobs, "jobs", cfg.Jobs, "jobs per fleet, after one warm-up job")
	fs.IntVar(&cfg.Steps, "steps", cfg.Steps, "denoise steps per job")
	fs.IntVar(&cfg.Clients, "clients", cfg.Clients, "concurrent clients, each with one job at a time (the default keeps every job on a free denoise slot in a 4-agent fleet)")
	fs.DurationVar(&cfg.Idle, "idle", cfg.Idle, "idle window measured after the jobs")
	fs.DurationVar(&cfg.Sim.Step, "step-time", cfg.Sim.Step, "simulated GPU time of one denoise step")
	fs.Var(&endpoints, "etcd-endpoints", "`URLs` of a one-member etcd to use instead of starting one per fleet (each fleet then gets a key prefix of its own)")
	fs.StringVar(&cfg.EtcdMetrics, "etcd-metrics", "", "`URL` of that etcd's Prometheus endpoint (default: the first endpoint + /metrics)")
	asJSON := fs.Bool("json", false, "print machine-readable results")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if cfg.EtcdMetrics != "" && len(endpoints) == 0 {
		fmt.Fprintln(stderr, "latentmesh-dev bench control: --etcd-metrics needs --etcd-endpoints")
		return 2
	}
	cfg.Agents, cfg.EtcdEndpoints, cfg.Progress = agents, endpoints, stderr
	rep, err := testbed.RunControlBench(ctx, cfg)
	return report("control", rep, err, *asJSON, stdout, stderr)
}

// runBenchProducer is the hidden producer child of the benchmarks: it serves
// requests on stdin until stdin closes.
func runBenchProducer(ctx context.Context, args []string, stderr io.Writer) int {
	cfg := bench.DefaultProducerConfig()
	fs := newFlagSet("bench producer", "(started by bench transfer and bench overlap)", stderr)
	fs.StringVar(&cfg.ListenIP, "listen-ip", cfg.ListenIP, "IPv4 `address` the producer's libp2p host, data plane and raw-TCP server listen on")
	if code := cli.Parse(fs, args); code >= 0 {
		return code
	}
	if err := bench.ServeProducer(ctx, cfg, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintf(stderr, "latentmesh-dev bench producer: %v\n", err)
		return 1
	}
	return 0
}

// startCPUProfile profiles this process into path until the returned stop.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
