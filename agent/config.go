package agent

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// Config is everything one agent needs. Nested configs belong to the layers
// the agent builds on; the agent overrides only what ties them together
// (prefix, logger, node identity).
type Config struct {
	// NodeID names the agent in etcd and gossip. "" derives one from the
	// hostname and the libp2p peer id.
	NodeID string
	// Roles are the stages this agent serves.
	Roles []jobs.Stage
	// Prefix is the etcd key prefix of the mesh.
	Prefix string
	// Slots is the number of tasks of each stage run at once: the agent's
	// credits. A worker pulls only while it holds one.
	Slots map[jobs.Stage]int
	// IdentityFile keeps the libp2p private key across restarts; "" uses a
	// fresh key each start (fine for demo and tests), or the state
	// directory's.
	IdentityFile string
	// StateDir is what the agent keeps across restarts (see state.go): its
	// key and node id, unless IdentityFile and NodeID are set, and the
	// Store's disk tier, where results are written through and recovered
	// at the next start, unless Store.SpillDir is set. "" keeps nothing.
	StateDir string
	// P2PListen is the libp2p control-channel multiaddr.
	P2PListen string
	// HTTPListen is the client API address; "" disables it.
	HTTPListen string
	// AdminListen is the admin endpoint (health, metrics, status); "" disables it.
	AdminListen string
	// AdminToken, when set, is required as a bearer token on admin paths but /livez.
	AdminToken string
	// TLS, when set, serves the client API and the admin endpoint over
	// HTTPS with it (cmd/latentmesh gives it an httpapi.CertReloader's
	// GetCertificate, which picks up replaced files); nil: plain HTTP.
	TLS *tls.Config
	// TransientRetries bounds attempts of a task failing for transient reasons
	// (transfer errors) before the job fails.
	TransientRetries int
	// RetryBackoff is the first backoff of a transiently failed task; it doubles per attempt.
	RetryBackoff time.Duration
	// EarlyHandoff commits a chunked (video) denoise stage as soon as its
	// first frame chunk is final, so decode overlaps the denoiser's tail.
	// It applies to peer-to-peer handoffs; a Store relay copies the whole
	// latent first.
	EarlyHandoff bool
	// TransferMode is how this agent hands its stage outputs on, unless a
	// job asks otherwise: p2p, store or auto (see jobs.TransferMode).
	TransferMode jobs.TransferMode
	// StoreMemory is how many arena bytes this agent lends to the Store;
	// StoreMemoryAuto lends a quarter of the arena.
	StoreMemory int64
	// ResultTTL is how long a finished file stays in the Store.
	ResultTTL time.Duration
	// PreviewTTL bounds how long a video frame preview stays in the Store
	// if the decode that made it never commits (a commit deletes them).
	PreviewTTL time.Duration
	// CheckpointEvery is how many denoise steps pass between step
	// checkpoints when neither the request nor the model's registration
	// says (0: none). Preemption and drain checkpoint where they stop
	// whatever it says, when the engine can.
	CheckpointEvery int
	// CheckpointTTL bounds how long a checkpoint stays in the Store if its
	// job never releases it (a stage's commit or the job's end does).
	CheckpointTTL time.Duration
	// KVCacheBytes bounds the denoiser's tensor cache: what a denoise
	// computes from the conditioning alone (the unconditional branch's
	// attention keys and values), kept across requests (0: none).
	KVCacheBytes int64
	// CondCacheBytes is this agent's room for conditioning cache entries
	// (what encoders made of texts, shared by the whole mesh), within its
	// Store memory; least recently used entries are evicted past it. 0
	// turns the conditioning cache off on this agent: it neither looks up
	// nor publishes entries.
	CondCacheBytes int64
	// AlarmEvery is how often etcd's alarms are read (NOSPACE refuses new
	// jobs and turns /readyz to 503).
	AlarmEvery time.Duration
	// EtcdTimeout bounds each etcd call made for a client request, and each
	// attempt of a stage's commit: past it etcd counts as unreachable (503
	// with Retry-After) rather than leaving the client waiting on gRPC.
	EtcdTimeout time.Duration
	// EtcdHealth tunes how fast the agent learns that etcd lost its
	// quorum, and that it has it back (jobs.Health): while it is down,
	// submissions are refused at once and reads are served without quorum.
	EtcdHealth jobs.HealthConfig

	Gossip   gossip.Config
	Transfer transfer.Config
	// Store configures this agent's part of the Store; Prefix, Node,
	// Logger and (with StoreMemory) MemoryCapacity are set by the agent.
	Store  cache.Config
	Jobs   jobs.Config
	Engine engine.Config
	// External is the engine socket: with External.Socket set, an external
	// engine process (sdk/python, docs/engine-protocol.md) runs this
	// agent's stages instead of the built-in engine, serving the models it
	// registers; until one registers the agent claims nothing.
	External extengine.Config
	// NewRunner, when set, builds the runner of this agent's stages, given
	// its node id, in place of the built-in engine: the benches' simulated
	// GPU (testbed/simgpu's Config.Runner); nil in production. An engine
	// socket (External.Socket) takes precedence.
	NewRunner func(node string) (StageRunner, error)
	API       httpapi.Config
	// AdminServer bounds the admin endpoint's connections (timeouts, in-flight cap).
	AdminServer httpapi.ServerConfig
	// Queue orders each stage's queue (priority or fifo, aging, deadlines)
	// and decides preemption (Queue.PreemptAfter; denoise only).
	Queue routing.QueuePolicy
	// Admission is the backpressure chain (Admission.Off: none).
	Admission routing.Admission
	// DrainTimeout bounds how long Drain (SIGTERM, `latentmesh drain`)
	// lets running tasks finish and held outputs be consumed; past it the
	// tasks still running are requeued.
	DrainTimeout time.Duration

	Logger *zap.Logger
}

// DefaultConfig is one agent serving every stage, with the client API on
// loopback port 8080 and admin on 9090, a 1 GiB registered arena and the
// transport chosen per peer pair.
func DefaultConfig() Config {
	tc := transfer.DefaultConfig()
	tc.Arena = arena.DefaultConfig() // stage outputs and pulls live here
	return Config{
		Roles:  jobs.Stages(),
		Prefix: "/latentmesh/default",
		Slots: map[jobs.Stage]int{
			jobs.Encode:  4, // encodes are short and bursty
			jobs.Denoise: 1, // one denoise job owns the GPU (batching is the engine's business)
			jobs.Decode:  2, // decode one while the next latent lands
		},
		P2PListen:        "/ip4/127.0.0.1/tcp/0",
		HTTPListen:       "127.0.0.1:8080",
		AdminListen:      "127.0.0.1:9090",       // loopback: admin is for the operator on the node
		TransientRetries: 5,                      // a peer restarting, a network blip
		RetryBackoff:     200 * time.Millisecond, // 0.2+0.4+0.8+1.6 s: rides out a restart
		EarlyHandoff:     true,                   // the RFC's chunked denoise->decode overlap
		TransferMode:     jobs.Auto,              // p2p while a consumer has credit, else relay
		StoreMemory:      StoreMemoryAuto,
		ResultTTL:        24 * time.Hour,   // a day to download a result; the record says when it goes
		PreviewTTL:       10 * time.Minute, // previews are for watching a decode, not for keeping
		CheckpointTTL:    time.Hour,        // longer than any denoise; a commit releases them sooner
		KVCacheBytes:     64 << 20,         // thousands of negative prompts' keys and values
		CondCacheBytes:   64 << 20,         // thousands of texts' embeddings; a T5-XXL one is 4 MiB
		AlarmEvery:       5 * time.Second,  // a full etcd is noticed within seconds; one cheap read
		EtcdTimeout:      5 * time.Second,  // a healthy etcd answers in milliseconds; a leader election takes ~1 s
		EtcdHealth:       jobs.DefaultHealthConfig(),
		Gossip:           gossip.DefaultConfig(),
		Transfer:         tc,
		Store:            cache.DefaultConfig(),
		Jobs:             jobs.DefaultConfig(),
		Engine:           engine.DefaultConfig(),
		External:         extengine.DefaultConfig(""), // no socket: the built-in engine
		API:              httpapi.DefaultConfig(),
		AdminServer:      httpapi.DefaultAdminServerConfig(),
		Queue:            routing.DefaultQueuePolicy(),
		Admission:        routing.DefaultAdmission(),
		DrainTimeout:     30 * time.Second, // most stages finish; a long video is requeued
		Logger:           zap.NewNop(),
	}
}

// StoreMemoryAuto lends a quarter of the arena to the Store: the rest stays
// for the agent's own stage outputs and pulls.
const StoreMemoryAuto = -1

// DefaultLocalConfig suits an agent in a test or the demo: fast gossip and a
// short lease, ephemeral ports, no fixed HTTP/admin ports.
func DefaultLocalConfig() Config {
	c := DefaultConfig()
	c.Gossip = gossip.DefaultLocalConfig()
	c.HTTPListen = "127.0.0.1:0"
	c.AdminListen = "127.0.0.1:0"
	c.RetryBackoff = 50 * time.Millisecond
	// Several agents share one test machine: a small arena, still pre-faulted.
	c.Transfer.Arena.Size = 64 << 20
	c.Transfer.Arena.HugePages = false
	c.Store.MaintainEvery = time.Second // re-replicate quickly in tests
	// The same rate of job-record reads for the orphan check as the
	// default (500 per 10 s pass), at ten passes as often.
	c.Store.OrphanBatch = 50
	c.Store.StageTimeout = 30 * time.Second
	c.AlarmEvery = time.Second
	return c
}

func (c Config) validate() (Config, error) {
	if len(c.Roles) == 0 {
		return c, errors.New("agent: no roles")
	}
	seen := map[jobs.Stage]bool{}
	for _, r := range c.Roles {
		if _, ok := c.Slots[r]; !ok || c.Slots[r] <= 0 {
			return c, fmt.Errorf("agent: role %q needs a positive slot count", r)
		}
		if seen[r] {
			return c, fmt.Errorf("agent: role %q given twice", r)
		}
		seen[r] = true
	}
	if c.TransientRetries < 1 || c.RetryBackoff <= 0 {
		return c, errors.New("agent: TransientRetries and RetryBackoff must be positive")
	}
	if c.TransferMode == "" {
		c.TransferMode = jobs.Auto
	}
	if _, err := jobs.ParseTransferMode(string(c.TransferMode)); err != nil {
		return c, fmt.Errorf("agent: %w", err)
	}
	if c.ResultTTL <= 0 || c.PreviewTTL <= 0 || c.CheckpointTTL <= 0 || c.AlarmEvery <= 0 || c.EtcdTimeout <= 0 {
		return c, errors.New("agent: ResultTTL, PreviewTTL, CheckpointTTL, AlarmEvery and EtcdTimeout must be positive")
	}
	if c.CheckpointEvery < 0 || c.KVCacheBytes < 0 || c.CondCacheBytes < 0 {
		return c, errors.New("agent: CheckpointEvery, KVCacheBytes and CondCacheBytes must not be negative")
	}
	if c.DrainTimeout < 0 || c.Queue.PreemptAfter < 0 || c.Admission.Slack < 0 || c.Admission.PerProducer < 0 {
		return c, errors.New("agent: DrainTimeout, Queue.PreemptAfter, Admission.Slack and Admission.PerProducer must not be negative")
	}
	switch {
	case c.StoreMemory == StoreMemoryAuto:
		c.Store.MemoryCapacity = c.Transfer.Arena.Size / 4
	case c.StoreMemory >= 0:
		c.Store.MemoryCapacity = c.StoreMemory
	default:
		return c, fmt.Errorf("agent: StoreMemory %d: want bytes or StoreMemoryAuto", c.StoreMemory)
	}
	if c.Store.MemoryCapacity > c.Transfer.Arena.Size && c.Transfer.Arena.Size > 0 {
		return c, fmt.Errorf("agent: Store memory %d exceeds the %d-byte arena it is lent from", c.Store.MemoryCapacity, c.Transfer.Arena.Size)
	}
	// Cache entries take at most a quarter of the Store's memory, so that
	// latents in flight always find room.
	c.Store.CacheCapacity = min(c.CondCacheBytes, c.Store.MemoryCapacity/4)
	if c.Store.CacheEntries == 0 {
		// Each entry's record is about 1 KiB of etcd: 512 of them per
		// agent keep a mesh of 100 agents' entries within 50 MiB of etcd's
		// 2 GiB quota, and hold thousands of distinct texts mesh-wide.
		c.Store.CacheEntries = 512
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.TLS != nil && len(c.TLS.Certificates) == 0 && c.TLS.GetCertificate == nil {
		return c, errors.New("agent: TLS has no certificate")
	}
	if c.External.Socket != "" && c.Transfer.Arena.Size <= 0 {
		return c, errors.New("agent: an engine socket needs an arena: the engine reads and writes tensors in it")
	}
	if c.External.BatchWindow < 0 || c.External.BatchWindow > time.Minute {
		return c, fmt.Errorf("agent: engine batch window %v, want 0-1m", c.External.BatchWindow)
	}
	// One prefix and one logger tie the layers together.
	c.Gossip.Prefix, c.Jobs.Prefix, c.Store.Prefix = c.Prefix, c.Prefix, c.Prefix
	c.Gossip.Logger, c.Transfer.Logger, c.Jobs.Logger, c.API.Logger = c.Logger, c.Logger, c.Logger, c.Logger
	c.Store.Logger = c.Logger
	slots := make(map[jobs.Stage]int, len(c.Slots))
	for k, v := range c.Slots {
		slots[k] = v
	}
	c.Slots = slots
	c.Roles = append([]jobs.Stage(nil), c.Roles...)
	return c, nil
}

// ParseRoles turns "encode,denoise" into stages.
func ParseRoles(list []string) ([]jobs.Stage, error) {
	var out []jobs.Stage
	for _, r := range list {
		switch st := jobs.Stage(r); st {
		case jobs.Encode, jobs.Denoise, jobs.Decode:
			out = append(out, st)
		default:
			return nil, fmt.Errorf("agent: unknown role %q (want encode, denoise or decode)", r)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("agent: no roles given")
	}
	return out, nil
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "localhost"
	}
	return h
}
