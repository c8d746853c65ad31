package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/etcdclient"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// defaultConfigFile is read when --config (or LATENTMESH_CONFIG) names no
// other file; it may be absent.
const defaultConfigFile = "/etc/latentmesh/agent.yaml"

// agentSettings is what `latentmesh agent` is configured with. Options
// land in cfg and etcd directly where they can; the rest are kept as
// given until build turns them into configuration (a file read, a check).
type agentSettings struct {
	cfg  agent.Config
	etcd etcdclient.Config

	etcdPasswordFile           string
	adminToken, adminTokenFile string
	apiTokens                  string
	apiRate                    float64
	storeCap, spillDir         string
	spillCap, transferMode     string
	scheduler                  string
	noPush                     bool
	noOffers                   bool
	tlsCert, tlsKey            string
	logFormat                  string
	verbose                    bool
	slots                      slotsFlag
	cost                       simCost

	opts options
	// source says where each option not at its default was set: the
	// config file, a variable or a flag (config print writes it).
	source map[string]string
	// unknownEnv are LATENTMESH_* variables that name no option.
	unknownEnv []string
}

// envOfOtherUse are LATENTMESH_* variables that are not options.
var envOfOtherUse = map[string]bool{
	"LATENTMESH_CONFIG": true, // the config file itself
	"LATENTMESH_FLAGS":  true, // scripts/latentmesh-agent.service's flags
}

// newAgentSettings returns the settings at their defaults, which come from
// agent.DefaultConfig and its layers', and the table of their options.
func newAgentSettings() *agentSettings {
	def := agent.DefaultConfig()
	s := &agentSettings{
		cfg:          def,
		etcd:         etcdclient.Config{Endpoints: []string{"http://127.0.0.1:2379"}},
		apiRate:      def.API.RatePerToken,
		transferMode: string(def.TransferMode),
		scheduler:    def.Queue.Scheduler.String(),
		noPush:       !def.Queue.Push,
		noOffers:     !def.Queue.Offer,
		logFormat:    "json",
		slots:        slotsFlag(def.Slots), // a fresh map per DefaultConfig
	}
	s.cfg.StateDir = defaultStateDir()
	c, e := &s.cfg, &s.etcd
	s.opts = options{
		{name: "etcd-endpoints", value: listValue{&e.Endpoints}, help: "etcd client `URLS`, comma-separated (https:// with TLS)"},
		{name: "etcd-cert", value: stringValue{&e.CertFile}, help: "client certificate `FILE` (PEM) for an etcd with --client-cert-auth"},
		{name: "etcd-key", value: stringValue{&e.KeyFile}, help: "key `FILE` (PEM) of etcd-cert"},
		{name: "etcd-ca", value: stringValue{&e.CAFile}, help: "CA `FILE` (PEM) that signed etcd's server certificate (default: system roots)"},
		{name: "etcd-user", value: stringValue{&e.Username}, help: "etcd user, for an etcd with auth enabled (see docs/etcd.md for its role)"},
		{name: "etcd-password-file", value: stringValue{&s.etcdPasswordFile}, help: "`FILE` holding etcd-user's password (first line)"},
		{name: "roles", value: rolesValue{&c.Roles}, help: "stages this agent serves, comma-separated: encode, denoise, decode"},
		{name: "slots", value: s.slots, help: "tasks run at once per stage, e.g. `encode=4,denoise=1,decode=2` (stages not named keep their default)"},
		{name: "prefix", value: stringValue{&c.Prefix}, help: "etcd key prefix of the mesh"},
		{name: "node-id", value: stringValue{&c.NodeID}, help: "node id (default: kept in state-dir, else hostname-<peer id suffix>)"},
		{name: "state-dir", value: stringValue{&c.StateDir}, doc: "systemd's `$STATE_DIRECTORY`, else `/var/lib/latentmesh` as root, else `~/.local/state/latentmesh`",
			help: "`DIR` the agent keeps across restarts: its key, its node id, and the Store's disk tier, where results are written through and served again after a restart (empty: keep nothing, a new node each start)"},
		{name: "identity", value: stringValue{&c.IdentityFile}, help: "libp2p key `FILE`, created if missing (default: identity.key in state-dir)"},
		{name: "http", value: stringValue{&c.HTTPListen}, help: "client API listen address (empty: off)"},
		{name: "admin", value: stringValue{&c.AdminListen}, help: "admin listen address: health, metrics, status (empty: off)"},
		{name: "admin-token", value: stringValue{&s.adminToken}, secret: true,
			help: "bearer token required on admin paths except /livez (required when admin is not loopback, unless api-tokens has an admin: token); prefer admin-token-file."},
		{name: "admin-token-file", value: stringValue{&s.adminTokenFile}, help: "`FILE` holding admin-token (first line), so that it is not on the command line"},
		{name: "api-tokens", value: stringValue{&s.apiTokens}, help: "`FILE` of client API bearer tokens, one a line, \"admin:\" before an admin token; when set every client request needs one and sees only its own jobs (default: off)"},
		{name: "api-rate", value: floatValue{&s.apiRate}, help: "requests a second per API token (burst: twice that); 0: no limit"},
		{name: "tls-cert", value: stringValue{&s.tlsCert}, help: "certificate `FILE` (PEM, chain after the leaf): serve the client API and the admin endpoint over HTTPS; read again when it changes, and on SIGHUP (docs/tls.md)"},
		{name: "tls-key", value: stringValue{&s.tlsKey}, help: "key `FILE` (PEM) of tls-cert"},
		{name: "p2p-listen", value: stringValue{&c.P2PListen}, help: "libp2p control-channel multiaddr"},
		{name: "data-listen", value: stringValue{&c.Transfer.DataListen}, help: "raw TCP data-plane listen address"},
		{name: "data-advertise", value: stringValue{&c.Transfer.DataAdvertise}, help: "host:port other agents dial for the data plane, when it is not data-listen's (a 0.0.0.0 bind, NAT) (empty: the bound address)"},
		{name: "gossip-bind", value: stringValue{&c.Gossip.GossipBind}, help: "memberlist ip:port (port 0: any)"},
		{name: "gossip-advertise", value: stringValue{&c.Gossip.GossipAdvertise}, help: "ip:port other agents dial for gossip, when it is not gossip-bind's (a 0.0.0.0 bind, NAT); port 0: the bound port (empty: derived from the bind address)"},
		{name: "gossip-keyring", value: stringValue{&c.Gossip.KeyringFile}, help: "gossip encryption keys: `FILE` holding a JSON list of base64 AES keys, the first encrypting; re-read every " + def.Gossip.KeyringCheck.String() + " (empty: gossip in clear)"},
		{name: "lease-ttl", value: durationValue{&c.Gossip.LeaseTTL}, help: "etcd lease TTL: a dead agent's claims free up after this"},
		{name: "transport", value: stringValue{&c.Transfer.Transport}, help: "data plane: auto (shm on one host, rdma when both ends have a device, else tcp), tcp, shm or rdma"},
		{name: "tcp-congestion", value: stringValue{&c.Transfer.TCPCongestion}, help: "congestion control of data-plane TCP senders (empty: the system default)"},
		{name: "arena-size", value: bytesValue{&c.Transfer.Arena.Size}, help: "registered buffer arena for payloads (e.g. 512MiB, 4GiB)"},
		{name: "store-capacity", value: stringValue{&s.storeCap}, help: "arena bytes lent to the pooled Store (empty: a quarter of arena-size)"},
		{name: "store-spill-dir", value: stringValue{&s.spillDir}, help: "`DIR` of the Store's disk tier: results written through, and copies when its memory is full (empty: store/ in state-dir)"},
		{name: "store-spill-capacity", value: stringValue{&s.spillCap}, help: "bytes the Store may keep on disk, e.g. 64GiB (empty: 16GiB in state-dir, else none)"},
		{name: "store-stage-timeout", value: durationValue{&c.Store.StageTimeout}, help: "how long a Store holder keeps a staged copy whose put never committed (its putter died) before dropping it"},
		{name: "transfer-mode", value: stringValue{&s.transferMode}, help: "how stage outputs move on: p2p (consumer pulls from the producer), store (relayed through the Store, the producer frees its buffer at once) or auto (p2p while a consumer has credit, else store)"},
		{name: "result-ttl", value: durationValue{&c.ResultTTL}, help: "how long finished files stay in the Store"},
		{name: "checkpoint-every", value: intValue{&c.CheckpointEvery}, help: "denoise steps between step checkpoints in the Store, unless the request (checkpoint_every) or the model's registration says (0: none; a preemption or drain checkpoints where it stops regardless)"},
		{name: "kv-cache-bytes", value: bytesValue{&c.KVCacheBytes}, help: "memory for tensors a denoise computes from the conditioning alone (the negative prompt's attention keys and values), reused across requests (0: none)"},
		{name: "cond-cache-bytes", value: bytesValue{&c.CondCacheBytes}, help: "room for conditioning cache entries this agent holds: what encoders made of prompts and negative prompts, found by every agent so a repeated text skips encode (at most a quarter of the Store's memory; 0: the cache is off here)"},
		{name: "checkpoint-ttl", value: durationValue{&c.CheckpointTTL}, help: "how long a checkpoint stays in the Store if its job never releases it (a denoise commit, or the job's end, does)"},
		{name: "job-retention", value: durationValue{&c.Jobs.Retention}, help: "how long finished job records stay in etcd (0: forever)"},
		{name: "engine-socket", value: stringValue{&c.External.Socket}, help: "Unix socket `PATH` on which an external engine process registers and then runs this agent's stages (docs/engine-protocol.md); empty: the built-in engine"},
		{name: "engine-batch-window", value: durationValue{&c.External.BatchWindow}, help: "how long a task of a model whose engine batches its stage waits for more of its kind before its batch goes (a batch goes at once when full, or when no other task of the stage is on its way here)"},
		{name: "scheduler", value: stringValue{&s.scheduler}, help: "queue order: priority (class with aging, then earliest deadline_ms, then age) or fifo (enqueue time only: a baseline)"},
		{name: "preempt-after", value: durationValue{&c.Queue.PreemptAfter}, help: "an interactive task waiting this long while denoise slots run batch work requeues one batch task in the stage (0: never)"},
		{name: "no-backpressure", value: boolValue{&c.Admission.Off}, help: "start tasks whatever the next stage's backlog (a baseline: waiting latents then grow with the run)"},
		{name: "no-push", value: boolValue{&s.noPush}, help: "never claim a new task for a worker in the write that creates it; its dispatcher hands it on against a worker's grant instead (a baseline: a handoff then costs two etcd writes)"},
		{name: "no-offers", value: boolValue{&s.noOffers}, help: "start a pushed task only once the write that pushes it has answered and its watch event arrived, not from the claim its writer sends over libp2p with the write (a baseline: each handoff then waits for a raft write)"},
		{name: "backpressure-slack", value: intValue{&c.Admission.Slack}, help: "outputs that may wait for the next stage beyond its total credits, for the whole upstream pool"},
		{name: "backpressure-per-producer", value: intValue{&c.Admission.PerProducer}, help: "outputs that may wait for the next stage beyond its total credits, for each agent of the stage before it (its running task and one on its way: without it, many producers before few consumer slots each wait for their last output)"},
		{name: "drain-timeout", value: durationValue{&c.DrainTimeout}, help: "on SIGTERM or 'latentmesh drain': how long running tasks may finish (and held outputs be consumed) before the rest are requeued"},
		{name: "sim-cost", value: &s.cost, help: "simulated GPU time of the built-in engine, e.g. `encode=5ms,step=20ms,decode=50ms`"},
		{name: "log-format", value: stringValue{&s.logFormat}, help: "json or console"},
		{name: "verbose", short: "v", value: boolValue{&s.verbose}, help: "debug logs"},
	}
	return s
}

// set records that option name was set, and by what.
func (s *agentSettings) setBy(by string) func(string) {
	return func(name string) { s.source[name] = by }
}

// loadAgentSettings reads the agent's settings: the defaults, then the
// config file (--config, else LATENTMESH_CONFIG, else defaultConfigFile
// when there is one), then LATENTMESH_* variables from environ, then the
// flags in args. extra registers more flags (config print's). It returns
// the exit code to use when loading ended the command (-1 to go on).
func loadAgentSettings(name string, args, environ []string, stderr io.Writer, extra func(*flag.FlagSet)) (*agentSettings, int) {
	var configFile string
	flags := func(s *agentSettings, out io.Writer) *flag.FlagSet {
		fs := newFlagSet(name, "[--config FILE] [flags]", out)
		s.opts.register(fs)
		fs.StringVar(&configFile, "config", "", "")
		if extra != nil {
			extra(fs)
		}
		fs.Usage = func() {
			fmt.Fprintf(out, "usage: latentmesh %s [--config FILE] [flags]\n\n", name)
			fmt.Fprintf(out, "Settings come from defaults, then the config file, then LATENTMESH_* variables,\nthen flags; docs/config.md lists them.\n\n")
			fmt.Fprintf(out, "  --config FILE    [LATENTMESH_CONFIG]\n    \tYAML config file (default %s, when it exists)\n", defaultConfigFile)
			if extra != nil {
				fs.VisitAll(func(f *flag.Flag) {
					if _, ok := s.opts.lookup(f.Name); !ok && f.Name != "config" && !isShort(s.opts, f.Name) {
						fmt.Fprintf(out, "  --%s\n    \t%s\n", f.Name, f.Usage)
					}
				})
			}
			s.opts.writeUsage(out)
		}
		return fs
	}
	// Flags are read twice: first, to learn the config file and to report
	// bad flags before anything else; last, over the file and environment.
	if code := parse(flags(newAgentSettings(), stderr), args); code >= 0 {
		return nil, code
	}
	s := newAgentSettings()
	s.source = map[string]string{}
	path, must := defaultConfigFile, false
	if v := envValue(environ, "LATENTMESH_CONFIG"); v != "" {
		path, must = v, true
	}
	if configFile != "" {
		path, must = configFile, true
	}
	fail := func(err error) (*agentSettings, int) {
		fmt.Fprintf(stderr, "latentmesh %s: %v\n", name, err)
		return nil, 2
	}
	if err := s.opts.loadFile(path, must, s.setBy(path)); err != nil {
		return fail(fmt.Errorf("config file: %w", err))
	}
	var err error
	if s.unknownEnv, err = s.opts.loadEnv(environ, envOfOtherUse, func(n string) { s.source[n] = envName(n) }); err != nil {
		return fail(err)
	}
	fs := flags(s, stderr)
	if err := fs.Parse(args); err != nil { // the first pass took these flags
		return nil, 2
	}
	fs.Visit(func(f *flag.Flag) {
		if o, ok := s.opts.lookup(f.Name); ok {
			s.source[o.name] = "--" + o.name
		} else if o, ok := shortOption(s.opts, f.Name); ok {
			s.source[o.name] = "-" + f.Name
		}
	})
	return s, -1
}

func isShort(opts options, name string) bool { _, ok := shortOption(opts, name); return ok }

func shortOption(opts options, short string) (option, bool) {
	for _, o := range opts {
		if o.short != "" && o.short == short {
			return o, true
		}
	}
	return option{}, false
}

func envValue(environ []string, key string) string {
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			return v
		}
	}
	return ""
}

// build turns the settings into the agent's configuration and its etcd
// client's, reading the files the settings name (tokens, password,
// certificate). The certificate reloader, when TLS is on, is returned for
// SIGHUP. Errors name the option.
func (s *agentSettings) build(log *zap.Logger) (agent.Config, etcdclient.Config, *httpapi.CertReloader, error) {
	cfg, ecc := s.cfg, s.etcd
	fail := func(format string, a ...any) (agent.Config, etcdclient.Config, *httpapi.CertReloader, error) {
		return agent.Config{}, etcdclient.Config{}, nil, fmt.Errorf(format, a...)
	}
	if len(cfg.Roles) == 0 {
		return fail("--roles: no stage given")
	}
	if len(ecc.Endpoints) == 0 {
		return fail("--etcd-endpoints: no endpoint given")
	}
	cfg.Slots = s.slots
	var err error
	if cfg.AdminToken, err = secret("admin-token", s.adminToken, s.adminTokenFile); err != nil {
		return fail("%v", err)
	}
	if cfg.Gossip.KeyringFile != "" {
		if _, err := gossip.ReadKeyringFile(cfg.Gossip.KeyringFile); err != nil {
			return fail("--gossip-keyring: %v", err)
		}
	}
	if err := checkAdvertise(cfg.Gossip.GossipAdvertise, cfg.Transfer.DataAdvertise); err != nil {
		return fail("%v", err)
	}
	if err := applyStoreFlags(&cfg, s.storeCap, s.spillDir, s.spillCap, s.transferMode); err != nil {
		return fail("%v", err)
	}
	if cfg.Store.StageTimeout <= 0 {
		return fail("--store-stage-timeout must be positive")
	}
	if s.apiTokens != "" {
		if cfg.API.Tokens, err = httpapi.LoadTokens(s.apiTokens); err != nil {
			return fail("--api-tokens: %v", err)
		}
	}
	if s.apiRate < 0 {
		return fail("--api-rate must not be negative")
	}
	cfg.API.RatePerToken, cfg.API.RateBurst = s.apiRate, max(1, int(2*s.apiRate))
	s.cost.Apply(&cfg.Engine)
	if cfg.Queue.Scheduler, err = routing.ParseScheduler(s.scheduler); err != nil {
		return fail("--scheduler: %v", err)
	}
	if cfg.Queue.PreemptAfter < 0 || cfg.Admission.Slack < 0 || cfg.Admission.PerProducer < 0 || cfg.DrainTimeout < 0 {
		return fail("--preempt-after, --backpressure-slack, --backpressure-per-producer and --drain-timeout must not be negative")
	}
	cfg.Queue.Push = !s.noPush
	cfg.Queue.Offer = !s.noOffers
	if ecc.Password, err = readPassword(ecc.Username, s.etcdPasswordFile); err != nil {
		return fail("%v", err)
	}
	var certs *httpapi.CertReloader
	switch {
	case s.tlsCert != "" && s.tlsKey != "":
		if certs, err = httpapi.NewCertReloader(s.tlsCert, s.tlsKey, log); err != nil {
			return fail("--tls-cert, --tls-key: %v", err)
		}
		cfg.TLS = certs.ServerConfig()
	case s.tlsCert != "" || s.tlsKey != "":
		return fail("--tls-cert and --tls-key go together")
	}
	cfg.Logger, ecc.Logger = log, log
	return cfg, ecc, certs, nil
}

// maxSecretFile bounds a secret file: a token is tens of bytes.
const maxSecretFile = 64 << 10

// secret is the value of a secret option given inline (value) or as a
// file (name-file): the file's first line, trimmed. Both is an error.
func secret(name, value, file string) (string, error) {
	if file == "" {
		return value, nil
	}
	if value != "" {
		return "", fmt.Errorf("--%s and --%s-file both given: give one", name, name)
	}
	b, err := readBounded(file, maxSecretFile)
	if err != nil {
		return "", fmt.Errorf("--%s-file: %w", name, err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	if line = strings.TrimSpace(line); line == "" {
		return "", fmt.Errorf("--%s-file %s: empty first line", name, file)
	}
	return line, nil
}

// checkAdvertise checks the addresses other agents are told to dial: an
// IP and port for gossip (memberlist's), a host and non-zero port for the
// data plane, neither an unspecified address (0.0.0.0, ::), which no peer
// can dial.
func checkAdvertise(gossipAddr, dataAddr string) error {
	if gossipAddr != "" {
		host, port, err := net.SplitHostPort(gossipAddr)
		ip := net.ParseIP(host)
		p, perr := strconv.Atoi(port)
		if err != nil || ip == nil || ip.IsUnspecified() || perr != nil || p < 0 || p > 65535 {
			return fmt.Errorf("--gossip-advertise %q: want ip:port with an IP other agents can reach (port 0: the bound port)", gossipAddr)
		}
	}
	if dataAddr != "" {
		host, port, err := net.SplitHostPort(dataAddr)
		p, perr := strconv.Atoi(port)
		ip := net.ParseIP(host)
		if err != nil || host == "" || (ip != nil && ip.IsUnspecified()) || perr != nil || p < 1 || p > 65535 {
			return fmt.Errorf("--data-advertise %q: want host:port other agents can dial (a reachable host or IP, a port from 1 to 65535)", dataAddr)
		}
	}
	return nil
}

// warnUnknownEnv logs the LATENTMESH_* variables that set nothing: most
// likely a misspelt option.
func (s *agentSettings) warnUnknownEnv(log *zap.Logger) {
	if len(s.unknownEnv) > 0 {
		log.Warn("environment variables that name no option (docs/config.md lists them)", zap.Strings("vars", s.unknownEnv))
	}
}
