package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/agent/etcdclient"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	def := agent.DefaultConfig()
	fs := newFlagSet("agent", "--etcd-endpoints URLS --roles ROLES [flags]", stderr)
	var (
		endpoints  = fs.String("etcd-endpoints", "http://127.0.0.1:2379", "comma-separated etcd client `URLS` (https:// with TLS)")
		etcdCert   = fs.String("etcd-cert", "", "client certificate `FILE` (PEM) for an etcd with --client-cert-auth")
		etcdKey    = fs.String("etcd-key", "", "key `FILE` (PEM) of --etcd-cert")
		etcdCA     = fs.String("etcd-ca", "", "CA `FILE` (PEM) that signed etcd's server certificate (default: system roots)")
		etcdUser   = fs.String("etcd-user", "", "etcd user, for an etcd with auth enabled (see docs/etcd.md for its role)")
		etcdPwFile = fs.String("etcd-password-file", "", "`FILE` holding --etcd-user's password (first line)")
		roles      = fs.String("roles", "encode,denoise,decode", "comma-separated stages this agent serves")
		prefix     = fs.String("prefix", def.Prefix, "etcd key prefix of the mesh")
		nodeID     = fs.String("node-id", "", "node id (default: hostname-<peer id suffix>)")
		httpAddr   = fs.String("http", def.HTTPListen, "client API listen address (empty: off)")
		adminAddr  = fs.String("admin", def.AdminListen, "admin listen address: health, metrics, status (empty: off)")
		adminToken = fs.String("admin-token", "", "bearer token required on admin paths except /livez (required when --admin is not loopback, unless --api-tokens has an admin: token)")
		apiTokens  = fs.String("api-tokens", "", "`FILE` of client API bearer tokens, one a line, \"admin:\" before an admin token; when set every client request needs one and sees only its own jobs (default: off)")
		apiRate    = fs.Float64("api-rate", def.API.RatePerToken, "requests a second per API token (burst: twice that); 0: no limit")
		p2p        = fs.String("p2p-listen", def.P2PListen, "libp2p control-channel multiaddr")
		data       = fs.String("data-listen", def.Transfer.DataListen, "raw TCP data-plane listen address")
		gossipBind = fs.String("gossip-bind", def.Gossip.GossipBind, "memberlist ip:port (port 0: any)")
		gossipKeys = fs.String("gossip-keyring", "", "gossip encryption keys: `FILE` holding a JSON list of base64 AES keys, the first encrypting; re-read every "+def.Gossip.KeyringCheck.String()+" (empty: gossip in clear)")
		leaseTTL   = fs.Duration("lease-ttl", def.Gossip.LeaseTTL, "etcd lease TTL: a dead agent's claims free up after this")
		identity   = fs.String("identity", "", "libp2p key `FILE`, created if missing (default: identity.key in --state-dir)")
		stateDir   = fs.String("state-dir", defaultStateDir(), "`DIR` the agent keeps across restarts: its key, its node id, and the Store's disk tier, where results are written through and served again after a restart (empty: keep nothing, a new node each start)")
		transport  = fs.String("transport", def.Transfer.Transport, "data plane: auto (shm on one host, rdma when both ends have a device, else tcp), tcp, shm or rdma")
		congestion = fs.String("tcp-congestion", def.Transfer.TCPCongestion, "congestion control of data-plane TCP senders (empty: the system default)")
		arenaSize  = fs.String("arena-size", "1GiB", "registered buffer arena for payloads (e.g. 512MiB, 4GiB)")
		storeCap   = fs.String("store-capacity", "", "arena bytes lent to the pooled Store (default: a quarter of --arena-size)")
		spillDir   = fs.String("store-spill-dir", "", "`DIR` of the Store's disk tier: results written through, and copies when its memory is full (default: store/ in --state-dir)")
		spillCap   = fs.String("store-spill-capacity", "", "bytes the Store may keep on disk, e.g. 64GiB (default: 16GiB in --state-dir, else none)")
		stageWait  = fs.Duration("store-stage-timeout", def.Store.StageTimeout, "how long a Store holder keeps a staged copy whose put never committed (its putter died) before dropping it")
		xferMode   = fs.String("transfer-mode", string(def.TransferMode), "how stage outputs move on: p2p (consumer pulls from the producer), store (relayed through the Store, the producer frees its buffer at once) or auto (p2p while a consumer has credit, else store)")
		resultTTL  = fs.Duration("result-ttl", def.ResultTTL, "how long finished files stay in the Store")
		retention  = fs.Duration("job-retention", def.Jobs.Retention, "how long finished job records stay in etcd (0: forever)")
		engineSock = fs.String("engine-socket", "", "Unix socket `PATH` on which an external engine process registers and then runs this agent's stages (docs/engine-protocol.md); empty: the built-in engine")
		scheduler  = fs.String("scheduler", def.Queue.Scheduler.String(), "queue order: priority (class with aging, then earliest deadline_ms, then age) or fifo (enqueue time only: a baseline)")
		preempt    = fs.Duration("preempt-after", def.Queue.PreemptAfter, "an interactive task waiting this long while denoise slots run batch work requeues one batch task in the stage (0: never)")
		noBackpr   = fs.Bool("no-backpressure", false, "start tasks whatever the next stage's backlog (a baseline: waiting latents then grow with the run)")
		noPush     = fs.Bool("no-push", false, "never claim a new task for its hinted worker in the write that creates it; every worker claims its own (a baseline: a handoff then costs two etcd writes)")
		slack      = fs.Int("backpressure-slack", def.Admission.Slack, "outputs that may wait for the next stage beyond its total credits, for the whole upstream pool")
		drainWait  = fs.Duration("drain-timeout", def.DrainTimeout, "on SIGTERM or 'latentmesh drain': how long running tasks may finish (and held outputs be consumed) before the rest are requeued")
		logFormat  = fs.String("log-format", "json", "json or console")
		verbose    = fs.Bool("v", false, "debug logs")
		slots      = slotsFlag{}
		cost       simCost
	)
	for k, v := range def.Slots {
		slots[k] = v
	}
	fs.Var(slots, "slots", "tasks run at once per stage, e.g. `encode=4,denoise=1,decode=2`")
	fs.Var(&cost, "sim-cost", "simulated GPU time, e.g. `encode=5ms,step=20ms,decode=50ms`")
	if code := parse(fs, args); code >= 0 {
		return code
	}
	log, err := newLogger(*logFormat, *verbose, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 2
	}
	defer log.Sync()
	cfg := def
	if cfg.Roles, err = agent.ParseRoles(strings.Split(*roles, ",")); err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 2
	}
	cfg.Prefix, cfg.NodeID, cfg.Slots = *prefix, *nodeID, slots
	cfg.HTTPListen, cfg.AdminListen, cfg.AdminToken = *httpAddr, *adminAddr, *adminToken
	cfg.P2PListen, cfg.Transfer.DataListen, cfg.IdentityFile = *p2p, *data, *identity
	cfg.StateDir = *stateDir
	cfg.Gossip.GossipBind, cfg.Gossip.LeaseTTL = *gossipBind, *leaseTTL
	if *gossipKeys != "" {
		if _, err := gossip.ReadKeyringFile(*gossipKeys); err != nil {
			fmt.Fprintf(stderr, "latentmesh agent: --gossip-keyring: %v\n", err)
			return 2
		}
		cfg.Gossip.KeyringFile = *gossipKeys
	}
	cfg.External.Socket = *engineSock
	cfg.Transfer.Transport, cfg.Transfer.TCPCongestion = *transport, *congestion
	if cfg.Transfer.Arena.Size, err = bytesize.Parse(*arenaSize); err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: --arena-size: %v\n", err)
		return 2
	}
	if err := applyStoreFlags(&cfg, *storeCap, *spillDir, *spillCap, *xferMode); err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 2
	}
	if *stageWait <= 0 {
		fmt.Fprintf(stderr, "latentmesh agent: --store-stage-timeout must be positive\n")
		return 2
	}
	cfg.Store.StageTimeout = *stageWait
	cfg.ResultTTL, cfg.Jobs.Retention = *resultTTL, *retention
	if *apiTokens != "" {
		if cfg.API.Tokens, err = httpapi.LoadTokens(*apiTokens); err != nil {
			fmt.Fprintf(stderr, "latentmesh agent: --api-tokens: %v\n", err)
			return 2
		}
	}
	if *apiRate < 0 {
		fmt.Fprintf(stderr, "latentmesh agent: --api-rate must not be negative\n")
		return 2
	}
	cfg.API.RatePerToken, cfg.API.RateBurst = *apiRate, max(1, int(2**apiRate))
	cost.apply(&cfg.Engine)
	if cfg.Queue.Scheduler, err = routing.ParseScheduler(*scheduler); err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: --scheduler: %v\n", err)
		return 2
	}
	if *preempt < 0 || *slack < 0 || *drainWait < 0 {
		fmt.Fprintf(stderr, "latentmesh agent: --preempt-after, --backpressure-slack and --drain-timeout must not be negative\n")
		return 2
	}
	cfg.Queue.PreemptAfter, cfg.DrainTimeout = *preempt, *drainWait
	cfg.Admission.Slack, cfg.Admission.Off = *slack, *noBackpr
	cfg.Queue.Push = !*noPush
	cfg.Logger = log

	ecc := etcdclient.Config{
		Endpoints: strings.Split(*endpoints, ","),
		CertFile:  *etcdCert, KeyFile: *etcdKey, CAFile: *etcdCA,
		Username: *etcdUser,
		Logger:   log,
	}
	if ecc.Password, err = readPassword(*etcdUser, *etcdPwFile); err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 2
	}
	cli, err := ecc.New(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 1
	}
	defer cli.Close()
	// Fail fast and say so when etcd is not there; systemd restarts us.
	probe, cancelProbe := context.WithTimeout(ctx, 10*time.Second)
	_, err = cli.Get(probe, cfg.Prefix+"/nodes/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	cancelProbe()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: cannot reach etcd at %s: %v\n", *endpoints, err)
		return 1
	}
	a, err := agent.New(cfg, cli)
	if err != nil {
		log.Error("start failed", zap.Error(err))
		return 1
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = a.Start(startCtx)
	cancel()
	if err != nil {
		log.Error("join failed", zap.Error(err))
		a.Close()
		return 1
	}
	// Registered and in gossip: systemd may count the unit started.
	nctx, stopNotify := context.WithCancel(ctx)
	go notifyReady(nctx, log, a)
	select {
	case <-ctx.Done(): // SIGTERM or SIGINT: drain, then leave
	case <-a.Drained(): // drained through the admin endpoint
	}
	stopNotify()
	notifyStopping(log)
	log.Info("shutting down")
	// The drain's own deadline is DrainTimeout; requeuing what still runs
	// then takes an etcd write per task.
	dctx, cancelDrain := context.WithTimeout(context.Background(), cfg.DrainTimeout+cfg.EtcdTimeout)
	if err := a.Drain(dctx); err != nil {
		log.Warn("drain", zap.Error(err))
	}
	cancelDrain()
	if err := a.Close(); err != nil {
		log.Warn("close", zap.Error(err))
	}
	return 0
}

// readPassword reads the first line of file, the password of user. A
// password never comes on the command line, where ps shows it.
func readPassword(user, file string) (string, error) {
	if file == "" {
		if user != "" {
			return "", fmt.Errorf("--etcd-user needs --etcd-password-file")
		}
		return "", nil
	}
	if user == "" {
		return "", fmt.Errorf("--etcd-password-file needs --etcd-user")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("--etcd-password-file: %w", err)
	}
	pw, _, _ := strings.Cut(string(b), "\n")
	pw = strings.TrimSuffix(pw, "\r")
	if pw == "" {
		return "", fmt.Errorf("--etcd-password-file %s: empty password", file)
	}
	return pw, nil
}

// applyStoreFlags sets the Store's capacities and the transfer mode.
// defaultStateDir is where an agent keeps its state unless told: the
// directory systemd made for the unit (StateDirectory=), else
// /var/lib/latentmesh for root, else ~/.local/state/latentmesh.
func defaultStateDir() string {
	if d := os.Getenv("STATE_DIRECTORY"); d != "" {
		return strings.Split(d, ":")[0]
	}
	if os.Geteuid() == 0 {
		return "/var/lib/latentmesh"
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "state", "latentmesh")
	}
	return ""
}

func applyStoreFlags(cfg *agent.Config, capacity, spillDir, spillCap, mode string) error {
	if capacity != "" {
		n, err := bytesize.Parse(capacity)
		if err != nil {
			return fmt.Errorf("--store-capacity: %w", err)
		}
		cfg.StoreMemory = n
	}
	var n int64
	if spillCap != "" {
		var err error
		if n, err = bytesize.Parse(spillCap); err != nil {
			return fmt.Errorf("--store-spill-capacity: %w", err)
		}
	}
	if n > 0 && spillDir == "" && cfg.StateDir == "" {
		return fmt.Errorf("--store-spill-capacity needs --store-spill-dir or --state-dir")
	}
	cfg.Store.SpillDir, cfg.Store.SpillCapacity = spillDir, n
	m, err := jobs.ParseTransferMode(mode)
	if err != nil || m == "" {
		return fmt.Errorf("--transfer-mode %q: want p2p, store or auto", mode)
	}
	cfg.TransferMode = m
	return nil
}
