// Package agent is the latentmesh node daemon: one per GPU node. It joins the
// mesh (gossip), pulls stage tasks it has credit for (jobs, routing), runs
// them on its engine, moves payloads peer to peer (transfer), and serves the
// client HTTP API and a local admin endpoint.
//
// The agent is the top of the stack: it may import every other package of
// latentmesh; none of them imports it. cmd/latentmesh and testbed build agents.
package agent

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdguard"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/grant"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/agent/progress"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
)

// Agent is one running node. Build it with New, then Start; Close stops it.
type Agent struct {
	cfg Config
	log *zap.Logger
	cli *clientv3.Client
	// guard notices an etcd replaced under the client (etcdguard).
	guard *etcdguard.Guard
	// fed is, per stage after one of this agent's roles, the ledger of
	// the tasks its commits created there that are not done: what
	// admission counts (jobs.Fed).
	fed map[jobs.Stage]*jobs.Fed

	id     string
	host   host.Host
	xfer   *transfer.Service
	member *gossip.Membership
	// members is member, published for the admission checks that libp2p
	// and the data plane call from their own goroutines, before New has
	// built member (nil: nobody is admitted yet).
	members atomic.Pointer[gossip.Membership]
	store   *jobs.Store
	// inboxes are watch-fed views of the claims this agent holds on each of
	// its stages' tasks (pushed to it, or running here): its workers start
	// what they find there. Nobody follows a whole stage.
	inboxes map[jobs.Stage]*jobs.Inbox
	// meshChanged fires at every gossip event and every grant received:
	// a worker may have a slot for a waiting task (dispatch.go).
	meshChanged broadcast
	// departed fires when a member leaves (adoptLoop).
	departed broadcast
	// leases says since when each node has been on its lease (liveOn).
	leases leaseAges
	cstore *cache.Store // this node's part of the pooled Store
	// board holds the steps of the stages running here, which progSrv
	// serves to other agents (live.go): progress never goes to etcd.
	board   *progress.Board
	progSrv *progress.Server
	// grants are the credits workers of the next stages granted this
	// agent (grants.go); stopGrants stops taking them.
	grants     *routing.Grants
	stopGrants func()
	alarms     *jobs.AlarmWatcher // etcd's NOSPACE alarm
	// health says whether etcd can serve this agent now; finished keeps
	// the finished job records it can answer for while etcd cannot.
	health   *jobs.Health
	finished *jobs.Finished
	recent   recentJobs // the last jobs it saw, for the status page
	engine   *engine.Engine
	// runner runs the stages' math: the built-in engine, or the external
	// engine registered on ext (the engine socket; nil without one).
	runner  StageRunner
	kv      engine.KVCache // the denoiser's tensor cache across requests; nil for none
	ext     *extengine.Server
	credits map[jobs.Stage]*routing.Credits
	metrics *httpapi.Metrics
	// preempted counts the tasks this agent stopped for interactive work.
	preempted atomic.Int64

	httpLn, adminLn net.Listener
	httpSrv         *http.Server
	adminSrv        *http.Server

	ctx    context.Context // cancelled by Close: the stop signal of every goroutine
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// pullCtx ends when the agent stops pulling work (Drain, or Close):
	// the claim loops wait on it.
	pullCtx  context.Context
	stopPull context.CancelFunc
	workers  sync.WaitGroup // the claim loops, waited for by Drain
	// running is the tasks executing here, for preemption and drain.
	running runningTasks
	// drainOnce starts one drain; drained is closed when it is done.
	drainOnce sync.Once
	draining  atomic.Bool
	drained   chan struct{}
	drainErr  error // set before drained closes

	// handoffsMu guards handoffs: the peer-to-peer stage outputs this node
	// holds, which it gives a ticket for only to the holder of the claim
	// on the task reading them (authorizePayload).
	handoffsMu sync.Mutex
	handoffs   map[string]bool
	released   chan struct{} // closed and replaced at every release

	// inflightMu guards inflight: payloads published by tasks still running,
	// which have no record yet (see resyncHeld).
	inflightMu sync.Mutex
	inflight   map[string]string // payload id -> id of the task that published it

	// blocked is set per stage while its worker finds no task whose output
	// fits (arena, Store): the stage then gossips no free credit.
	blocked map[jobs.Stage]*atomic.Bool
	// held is set per stage while admission holds its worker back (the
	// next stage's budget has no room for this node's outputs): the stage
	// then gossips no free credit either, so producers do not push it
	// tasks it could only give back after the steal grace.
	held map[jobs.Stage]*atomic.Bool
	// books keeps, per stage worked, to whom its free slots are promised
	// and when its busy ones should free (slots.go).
	books map[jobs.Stage]*routing.SlotBook
	// waiting is set per stage (every stage: any agent dispatches) while
	// tasks wait in this agent's ledger of it (NodeMeta.Waiting).
	waiting map[jobs.Stage]*atomic.Bool
	// committing counts, per stage, the tasks whose work is done and whose
	// credit is back but whose outcome is still being written: admission
	// counts them as running.
	committing map[jobs.Stage]*atomic.Int64
	// relayed counts outputs handed on through the Store; heapPulls pulls
	// that landed on the heap because the arena was full.
	relayed, heapPulls atomic.Int64

	// live holds the heartbeats of the pull loops and of the etcd session
	// (Alive: the watchdog's and /livez's answer).
	live *liveness

	closeOnce sync.Once
	closeErr  error
}

// New builds an agent on an etcd client the caller owns. It opens the libp2p
// host, the transfer service and the listeners, so addresses are known before
// Start registers them.
func New(cfg Config, cli *clientv3.Client) (_ *Agent, err error) {
	if cli == nil {
		return nil, errors.New("agent: nil etcd client")
	}
	if cfg, err = cfg.validate(); err != nil {
		return nil, err
	}
	if cfg, err = cfg.applyStateDir(); err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, cli: cli, credits: map[jobs.Stage]*routing.Credits{}, grants: routing.NewGrants(), fed: map[jobs.Stage]*jobs.Fed{}, inflight: map[string]string{}, blocked: map[jobs.Stage]*atomic.Bool{}, held: map[jobs.Stage]*atomic.Bool{}, books: map[jobs.Stage]*routing.SlotBook{}, waiting: map[jobs.Stage]*atomic.Bool{}, committing: map[jobs.Stage]*atomic.Int64{}, handoffs: map[string]bool{}}
	a.ctx, a.cancel = context.WithCancel(context.Background())
	a.pullCtx, a.stopPull = context.WithCancel(a.ctx)
	a.running.init()
	a.drained = make(chan struct{})
	a.released = make(chan struct{})
	a.board = progress.NewBoard()
	a.live = newLiveness(cfg.Roles, stuckAfter(cfg), time.Now)
	defer func() {
		if err != nil {
			a.Close()
		}
	}()

	if a.engine, err = engine.New(cfg.Engine); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if a.host, err = newHost(cfg, a.admitPeer); err != nil {
		return nil, err
	}
	a.id = cfg.NodeID
	if a.id == "" {
		pid := a.host.ID().String()
		a.id = hostname() + "-" + pid[len(pid)-6:]
		if cfg.StateDir != "" {
			if a.id, err = stateNodeIDOf(cfg.StateDir, a.id); err != nil {
				return nil, err
			}
		}
	}
	a.log = cfg.Logger.With(zap.String("node", a.id))
	// Before anything watches: an etcd replaced under the agent ends every
	// watch, and each watcher reads its state again from the new etcd.
	a.guard = etcdguard.Install(cli, a.log)
	if a.metrics, err = httpapi.NewMetrics(prometheus.NewRegistry()); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	cli = observedEtcd(cli, a.metrics) // this agent's etcd requests, timed
	a.cli = cli
	cfg.Transfer.Logger = a.log
	cfg.Transfer.Admit = a.admitPeer
	cfg.Transfer.AuthorizePayload = a.authorizePayload
	if a.xfer, err = transfer.New(cfg.Transfer, a.host); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.runner = builtinRunner{a.engine}
	if cfg.NewRunner != nil {
		if a.runner, err = cfg.NewRunner(a.id); err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
	}
	if cfg.External.Socket != "" {
		ec := cfg.External
		ec.Node, ec.Logger = a.id, a.log
		ec.OnFrame = chainFrame(a.metrics.EngineFrame, ec.OnFrame) // engine health, for metrics
		if a.ext, err = extengine.Listen(ec, a.xfer); err != nil {
			return nil, fmt.Errorf("agent: %w", err)
		}
		a.runner = &externalRunner{srv: a.ext, xfer: a.xfer, limits: cfg.Engine.Limits, log: a.log.Named("engine"), images: a}
	}
	jc := cfg.Jobs
	jc.Logger = a.log
	if a.store, err = jobs.NewStore(cli, jc); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	// An inbox of each role's stage; a ledger of every stage, of the tasks
	// this agent dispatches there (its commits', submissions' and
	// rewinds' tasks, and those it adopts): dispatch.go.
	a.inboxes = map[jobs.Stage]*jobs.Inbox{}
	for _, st := range cfg.Roles {
		a.inboxes[st] = a.store.NewInbox(st, a.id)
	}
	for _, st := range jobs.Stages() {
		a.waiting[st] = &atomic.Bool{}
		a.fed[st] = a.store.NewFed(a.ctx, st, a.id, func(worker string) { a.creditReturned(st, worker) })
	}
	if err = a.metrics.WatchStore(func() cache.LocalStats { return a.cstore.LocalStats() }); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	if err = a.metrics.WatchAgent(a.agentStats); err != nil {
		return nil, fmt.Errorf("agent: metrics: %w", err)
	}
	if cfg.KVCacheBytes > 0 {
		kv := engine.NewKVCache(cfg.KVCacheBytes)
		a.kv = kv
		if err = a.metrics.WatchKV(func() httpapi.KVStats {
			st := kv.Stats()
			return httpapi.KVStats{Hits: st.Hits, Misses: st.Misses, Evictions: st.Evictions, Bytes: st.Bytes}
		}); err != nil {
			return nil, fmt.Errorf("agent: metrics: %w", err)
		}
	}
	for _, r := range cfg.Roles {
		a.credits[r] = routing.NewCredits(cfg.Slots[r])
		a.metrics.InitStage(r)
		a.blocked[r] = &atomic.Bool{}
		a.held[r] = &atomic.Bool{}
		a.books[r] = routing.NewSlotBook()
		a.committing[r] = &atomic.Int64{}
	}
	a.alarms = jobs.NewAlarmWatcher(cli, cfg.AlarmEvery, a.log)
	a.health = jobs.NewHealth(cfg.EtcdHealth, jobs.LeaderProbeKV(etcdguard.Unguarded(cli), cfg.Prefix+"/health"), a.log)
	a.finished = jobs.NewFinished(finishedRecords)
	if cfg.HTTPListen != "" {
		if a.httpLn, err = net.Listen("tcp", cfg.HTTPListen); err != nil {
			return nil, fmt.Errorf("agent: http listen: %w", err)
		}
	}
	if cfg.AdminListen != "" {
		if a.adminLn, err = net.Listen("tcp", cfg.AdminListen); err != nil {
			return nil, fmt.Errorf("agent: admin listen: %w", err)
		}
		// pprof and status tell a reader about the process and the mesh.
		if !loopback(a.adminLn) && cfg.AdminToken == "" && (cfg.API.Tokens == nil || !cfg.API.Tokens.HasAdmin()) {
			return nil, fmt.Errorf("agent: the admin endpoint listens beyond loopback (%s): give it a token (AdminToken, or an admin: token in the API tokens)", a.adminLn.Addr())
		}
	}
	if a.httpLn != nil && !loopback(a.httpLn) && cfg.API.Tokens == nil {
		a.log.Warn("the client API listens beyond loopback without tokens: anyone who reaches it can submit, read and cancel any job",
			zap.String("http", a.httpLn.Addr().String()))
	}

	rec := gossip.NodeRecord{
		ID:        a.id,
		PeerID:    a.host.ID().String(),
		DataAddr:  a.xfer.DataAddr(),
		Roles:     stagesToRoles(cfg.Roles),
		Slots:     slotsByRole(cfg.Roles, cfg.Slots),
		Host:      a.xfer.HostID(), // the same identity the data plane uses for shm
		Version:   Version,
		StartedAt: time.Now().UTC(),
	}
	for _, ma := range a.host.Addrs() {
		rec.P2PAddrs = append(rec.P2PAddrs, ma.String())
	}
	if a.httpLn != nil {
		rec.HTTPAddr = a.httpLn.Addr().String()
	}
	if a.adminLn != nil {
		rec.AdminAddr = a.adminLn.Addr().String()
	}
	gc := cfg.Gossip
	gc.Logger = cfg.Logger // gossip names the node in its own fields
	gc.SessionHeartbeat = a.live.session
	if a.member, err = gossip.New(gc, cli, rec); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.members.Store(a.member)
	sc := cfg.Store
	sc.Node, sc.Logger = a.id, a.log
	sc.Registered = a.registeredNodes
	sc.VerifyHolder = a.registeredAs
	sc.IsMember = a.isMemberPeer
	if a.cstore, err = cache.New(sc, cli, a.xfer, a.host, a.storeMembers, a.orphans); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	// An etcd replaced under us forgot every Store record: the copies
	// they named are judged again against the new etcd.
	a.guard.OnReset(a.cstore.EtcdReplaced)
	return a, nil
}

// newHost opens the libp2p host that carries control messages, with this
// agent's persistent identity, admitting only the peers admit accepts.
func newHost(cfg Config, admit func(peer.ID) bool) (host.Host, error) {
	key, err := loadIdentity(cfg.IdentityFile)
	if err != nil {
		return nil, err
	}
	hc := transfer.DefaultHostConfig(cfg.P2PListen, key)
	hc.Admit, hc.Logger = admit, cfg.Logger
	return transfer.NewHostWith(hc)
}

// loadIdentity reads an Ed25519 key from path, creating it on first start;
// "" returns a fresh key.
func loadIdentity(path string) (crypto.PrivKey, error) {
	if path != "" {
		if b, err := os.ReadFile(path); err == nil {
			k, err := crypto.UnmarshalPrivateKey(b)
			if err != nil {
				return nil, fmt.Errorf("agent: identity %s: %w", path, err)
			}
			return k, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("agent: identity: %w", err)
		}
	}
	k, _, err := crypto.GenerateEd25519Key(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("agent: identity: %w", err)
	}
	if path != "" {
		b, err := crypto.MarshalPrivateKey(k)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			return nil, fmt.Errorf("agent: write identity: %w", err)
		}
	}
	return k, nil
}

// slotsByRole is the record's Slots: each role's credits.
func slotsByRole(roles []jobs.Stage, slots map[jobs.Stage]int) map[string]int {
	out := make(map[string]int, len(roles))
	for _, st := range roles {
		out[string(st)] = slots[st]
	}
	return out
}

func stagesToRoles(st []jobs.Stage) []string {
	out := make([]string, len(st))
	for i, s := range st {
		out[i] = string(s)
	}
	return out
}

// modelSteps is the default step count the engines serving model
// registered (gossiped with the models each agent serves), or 0: a request
// that names no steps gets it.
func (a *Agent) modelSteps(model string) int {
	if model == "" || model == engine.DefaultModel {
		return 0
	}
	if n := a.runner.DefaultSteps(model); n > 0 {
		return n
	}
	for _, p := range a.member.Peers() {
		if n := p.Meta.DefaultSteps(model); p.Alive && n > 0 {
			return n
		}
	}
	return 0
}

// Start joins the mesh, starts the stage workers and serves HTTP.
func (a *Agent) Start(ctx context.Context) error {
	a.member.UpdateMeta(a.meta())
	// The record the registration writes names the models' encoders (a
	// registered external engine's come with gossipEngine).
	if err := a.member.SetModels(ctx, a.modelRecords()); err != nil {
		return fmt.Errorf("agent: node record: %w", err)
	}
	// The Store serves before the node registers: a member that finds it
	// registered may ask it for a copy at once.
	a.cstore.Start()
	a.progSrv = progress.Serve(a.host, a.board, a.admitPeer, a.log)
	a.stopGrants = grant.Serve(a.host, a.admitPeer, a.takeGrant, a.log)
	if err := a.member.Start(ctx); err != nil {
		return fmt.Errorf("agent: join: %w", err)
	}
	a.wg.Go(func() { a.alarms.Run(a.ctx) })
	a.wg.Go(func() { a.health.Run(a.ctx) })
	a.wg.Go(a.watchLeaseContact)
	a.wg.Go(func() { a.store.WatchReleases(a.ctx, a.id, a.release, a.resyncHeld) })
	for _, q := range a.inboxes {
		a.wg.Go(func() { q.Run(a.ctx) })
	}
	for st, f := range a.fed {
		a.wg.Go(f.Run)
		a.wg.Go(func() { a.dispatchLoop(st) })
	}
	a.wg.Go(a.adoptLoop)
	for _, st := range a.cfg.Roles {
		a.workers.Go(func() { a.worker(st) })
		if st == jobs.Denoise && a.cfg.Queue.PreemptAfter > 0 && a.cfg.Queue.Scheduler != routing.FIFO {
			a.workers.Go(func() { a.preemptLoop(st) })
		}
	}
	a.wg.Go(a.reportLoop)
	a.wg.Go(a.gossipEngine)
	a.wg.Go(a.gossipStoreRoom)
	a.wg.Go(a.forgetDeparted)
	if a.httpLn != nil {
		api := a.apiConfig()
		a.httpSrv = httpapi.NewServer(httpapi.NewHandler(api, a), api.Server, a.log)
		a.wg.Go(func() { a.serve(a.httpSrv, a.httpLn, "http") })
	}
	if a.adminLn != nil {
		a.adminSrv = httpapi.NewServer(httpapi.NewAdminHandler(httpapi.AdminConfig{
			Live:   a.Alive,
			Ready:  a.ready,
			Status: func(ctx context.Context) (any, error) { return a.Status(ctx) },
			Store: func(ctx context.Context, job string, objects bool) (any, error) {
				return a.StoreStatus(ctx, job, objects)
			},
			Jobs: func(ctx context.Context, limit int) (any, error) { return a.RecentJobs(ctx, limit) },
			Drain: func(ctx context.Context, wait bool) error {
				a.wg.Go(func() { a.Drain(a.ctx) })
				if !wait {
					return nil
				}
				select {
				case <-a.drained:
					return a.drainErr
				case <-ctx.Done():
					return ctx.Err()
				}
			},
			Metrics: a.metrics.Handler(),
			Token:   a.cfg.AdminToken,
			Tokens:  a.cfg.API.Tokens,
			Server:  a.cfg.AdminServer,
			Logger:  a.log,
		}), a.cfg.AdminServer, a.log)
		a.wg.Go(func() { a.serve(a.adminSrv, a.adminLn, "admin") })
	}
	a.log.Info("agent started",
		zap.Strings("roles", stagesToRoles(a.cfg.Roles)),
		zap.String("http", a.HTTPAddr()), zap.String("admin", a.AdminAddr()),
		zap.String("data", a.xfer.DataAddr()), zap.String("peer", a.host.ID().String()))
	return nil
}

func (a *Agent) apiConfig() httpapi.Config {
	c := a.cfg.API
	c.ModelSteps = a.modelSteps
	c.ModelLimits = a.modelLimits
	c.Logger = a.log
	c.Metrics = a.metrics
	return c
}

func (a *Agent) serve(srv *http.Server, ln net.Listener, name string) {
	var err error
	if a.cfg.TLS != nil {
		srv.TLSConfig = a.cfg.TLS.Clone()
		err = srv.ServeTLS(ln, "", "") // the certificate comes from TLSConfig
	} else {
		err = srv.Serve(ln)
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		a.log.Error("server stopped", zap.String("server", name), zap.Error(err))
	}
}

// ready is /readyz: registered in etcd with a live lease, etcd up (no
// etcd call here: a probe must be cheap and fast), and etcd able to take
// writes (no NOSPACE alarm).
func (a *Agent) ready() error {
	if a.draining.Load() {
		return errors.New("draining: not taking work")
	}
	if a.member.Lease() == 0 {
		return errors.New("not registered in etcd (no lease)")
	}
	if err := a.etcdDown(); err != nil {
		return err
	}
	return a.alarms.NoSpace()
}

// ID is the node id.
func (a *Agent) ID() string { return a.id }

// HTTPAddr is the client API address ("" when disabled).
func (a *Agent) HTTPAddr() string { return addrOf(a.httpLn) }

// AdminAddr is the admin endpoint address ("" when disabled).
func (a *Agent) AdminAddr() string { return addrOf(a.adminLn) }

// loopback reports whether ln accepts connections from this host only.
func loopback(ln net.Listener) bool {
	ta, ok := ln.Addr().(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

func addrOf(ln net.Listener) string {
	if ln == nil {
		return ""
	}
	return ln.Addr().String()
}

// Store is the job store this agent uses (the demo submits through it).
func (a *Agent) Store() *jobs.Store { return a.store }

// Close leaves the mesh and stops everything. Running tasks are abandoned:
// their claims vanish with the revoked lease and other agents take them.
// Idempotent.
func (a *Agent) Close() error {
	a.closeOnce.Do(func() {
		a.cancel()
		a.workers.Wait()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var errs []error
		for _, srv := range []*http.Server{a.httpSrv, a.adminSrv} {
			if srv != nil {
				errs = append(errs, srv.Shutdown(shutdownCtx))
			}
		}
		for _, ln := range []net.Listener{a.httpLn, a.adminLn} {
			if ln != nil {
				ln.Close() // never served when Start was not called
			}
		}
		if a.ext != nil {
			errs = append(errs, a.ext.Close()) // its waits end with the engine connection
		}
		a.wg.Wait()
		if a.progSrv != nil {
			a.progSrv.Close()
		}
		if a.stopGrants != nil {
			a.stopGrants()
		}
		if a.cstore != nil {
			errs = append(errs, a.cstore.Close()) // before the transfer service its copies live in
		}
		if a.member != nil {
			errs = append(errs, a.member.Close())
		}
		if a.xfer != nil {
			errs = append(errs, a.xfer.Close())
		}
		if a.host != nil {
			errs = append(errs, a.host.Close())
		}
		a.closeErr = errors.Join(errs...)
	})
	return a.closeErr
}

// The httpapi.Jobs interface: the job store, counted in metrics. Each etcd
// call made for a client request is bounded by EtcdTimeout, and refused at
// once while etcd is down (etcdDown), so a client learns that etcd is
// unreachable (503, jobs.ErrUnavailable) instead of waiting on gRPC; reads
// are answered without quorum meanwhile (outage.go).

// onEtcd runs f, etcd calls for a client request, with ctx bounded by
// EtcdTimeout and needing a leader (a member without one refuses at once
// instead of holding the call to its deadline). Health tracks the call: it
// is cancelled as soon as etcd is found down. An unanswered call is named
// jobs.ErrUnavailable.
func (a *Agent) onEtcd(ctx context.Context, f func(context.Context) error) error {
	if err := a.etcdDown(); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), a.cfg.EtcdTimeout)
	defer cancel()
	tctx, done := a.health.Track(cctx)
	err := a.etcdErr(ctx, tctx, f(tctx))
	if ctx.Err() != nil {
		done(ctx.Err()) // the caller gave up, whatever error the call made of it: no news of etcd
	} else {
		done(err)
	}
	return err
}

// etcdErr turns an error of a call made under ctx (tracked as tctx) into
// jobs.ErrUnavailable when etcd, not the caller, ran out of time, could not
// be reached or refused for want of a leader, or was found down meanwhile.
func (a *Agent) etcdErr(ctx, tctx context.Context, err error) error {
	switch {
	case err == nil, ctx.Err() != nil, errors.Is(err, jobs.ErrUnavailable):
		return err
	case errors.Is(context.Cause(tctx), jobs.ErrUnavailable):
		return context.Cause(tctx)
	case jobs.IsUnavailable(err):
		return fmt.Errorf("%w: %v", jobs.ErrUnavailable, err)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("%w: no answer within %v: %v", jobs.ErrUnavailable, a.cfg.EtcdTimeout, err)
	}
	return err
}

// Submit stores a new job, unless the mesh cannot take it (checkSubmit).
func (a *Agent) Submit(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error) {
	if err := a.checkSubmit(spec, opts); err != nil {
		a.metrics.JobRefused()
		return jobs.Job{}, err
	}
	abort, err := a.submitInputs(ctx, &spec, &opts)
	if err != nil {
		a.metrics.JobRefused()
		return jobs.Job{}, err
	}
	opts.Dispatcher = a.id // a first task with no worker free waits in this agent's ledger
	var j jobs.Job
	var task jobs.Task
	err = a.onEtcd(ctx, func(ctx context.Context) (err error) {
		// The conditioning cache's lookup may read etcd (an entry held
		// elsewhere): under the submit's deadline, so that an outage
		// refuses the job within one EtcdTimeout.
		if opts.Cond == nil {
			opts.Cond = a.cachedCond(ctx, spec)
		}
		first := jobs.Encode
		if len(opts.Cond) > 0 {
			first = jobs.Denoise // the conditioning is in the cache: no encode
		}
		if opts.Push == nil {
			// The first task goes, claimed, to a worker with a free slot.
			_, opts.Push = a.pushTarget(first, spec)
		}
		if opts.Push != nil && opts.Cond != nil {
			opts.Cond = a.issueTickets(opts.Cond, opts.Push.Node) // for the entries held here
		}
		j, task, err = a.store.SubmitTask(ctx, spec, opts)
		return err
	})
	if err != nil {
		abort() // the job's staged objects (its image) are no one's (a submit with no answer that landed is counted by its ledger's watch)
	}
	if jobs.IsNoSpace(err) {
		a.alarms.Observe(err)
		return jobs.Job{}, a.alarms.NoSpace() // ErrNoSpace with what to do: a 503
	}
	if err == nil {
		a.fed[task.Stage].Created(task) // its push's worker has its credit back when it is gone
		a.metrics.JobSubmitted(opts.Class)
		a.recent.note(j.ID)
	} else if errors.Is(err, jobs.ErrUnavailable) {
		a.metrics.JobRefused()
	}
	return j, err
}

// Get reads a job, with a running denoise's step from the node running
// it (withLiveStep).
func (a *Agent) Get(ctx context.Context, id string) (jobs.Job, error) {
	j, err := a.getRecord(ctx, id)
	if err != nil {
		return j, err
	}
	return a.withLiveStep(ctx, j), nil
}

// getRecord reads a job from etcd; while etcd cannot answer with quorum,
// without it (getWithoutQuorum).
func (a *Agent) getRecord(ctx context.Context, id string) (j jobs.Job, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) error {
		j, err = a.store.Get(ctx, id)
		return err
	})
	if errors.Is(err, jobs.ErrUnavailable) {
		return a.getWithoutQuorum(ctx, id, err)
	}
	if err == nil {
		a.finished.Note(j)
	}
	return j, err
}

// Wait blocks until the job finishes or ctx ends; ctx, not EtcdTimeout,
// bounds it (it is a long poll), and its end is ctx.Err() itself. While
// etcd is down a finished job is answered without quorum at once, and one
// not finished is waited for until etcd is back: nothing commits without
// quorum.
func (a *Agent) Wait(ctx context.Context, id string) (jobs.Job, error) {
	for {
		if why := a.etcdDown(); why != nil {
			if j, err := a.getWithoutQuorum(ctx, id, why); err == nil && j.State.Terminal() {
				return j, nil
			}
			if err := a.awaitEtcd(ctx); err != nil {
				return jobs.Job{}, err
			}
			continue
		}
		tctx, done := a.health.TrackWait(ctx)
		j, err := a.store.Wait(tctx, id)
		switch {
		case err == nil:
			done(nil)
			a.finished.Note(j)
			return j, nil
		case ctx.Err() != nil:
			done(ctx.Err()) // the wait ran out: the caller answers with the job as it stands
			return jobs.Job{}, ctx.Err()
		}
		err = a.etcdErr(ctx, tctx, err)
		done(err)
		if !errors.Is(err, jobs.ErrUnavailable) {
			return jobs.Job{}, err
		}
		// etcd went down during the wait: wait on without it.
	}
}

// Cancel stops a job.
func (a *Agent) Cancel(ctx context.Context, id string) (j jobs.Job, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) error {
		j, err = a.store.Cancel(ctx, id)
		return err
	})
	return j, err
}

// Delete removes a finished job and its Store objects.
func (a *Agent) Delete(ctx context.Context, id string) error {
	a.finished.Forget(id) // first: a delete that goes unanswered may still land
	return a.onEtcd(ctx, func(ctx context.Context) error { return a.store.Delete(ctx, id) })
}

// StreamFrames streams a video's frame previews as they decode (httpapi.FrameStreamer).
func (a *Agent) StreamFrames(ctx context.Context, id string, emit func(jobs.Frame) error) (jobs.Job, error) {
	return a.store.StreamFrames(ctx, id, a.fetchObject, emit)
}

// meta is this node's gossiped soft state.
func (a *Agent) meta() gossip.NodeMeta {
	var m gossip.NodeMeta
	total := 0
	for _, st := range a.cfg.Roles {
		c := a.credits[st]
		// Roles are the stages this node takes work for now (its etcd
		// record has the ones it is configured for): not while draining,
		// nor while a stage has no room for its outputs, admission holds
		// it back, or it has no engine slot. Producers hint and push only
		// to those.
		if a.takingWork(st) && a.runner.Slots(st) > 0 {
			m.Roles = append(m.Roles, string(st))
			_, free := a.slots(st)
			m.Free.Set(string(st), uint32(free))
			if free == 0 {
				m.Room.Set(string(st), uint32(a.queueCredit(st))) // busy: what a short stage still takes
			}
		}
		m.Running += uint32(c.InUse())
		total += c.Total()
		if len(a.batchOnly(st)) > 0 {
			m.Yields |= gossip.StageBit(string(st))
		}
	}
	for st, w := range a.waiting {
		if w.Load() {
			m.Waiting |= gossip.StageBit(string(st))
		}
	}
	if total > 0 {
		m.Load = float32(m.Running) / float32(total)
	}
	if st := a.xfer.Stats(); st.HasArena {
		m.FreeBufferBytes = uint64(st.Arena.Free)
	}
	m.StoreFree = uint64(a.cstore.Room())
	for model, stages := range a.runner.Models() {
		roles := make([]string, 0, len(stages))
		for _, st := range stages {
			if a.credits[st] != nil { // served by the engine and a role of this agent
				roles = append(roles, string(st))
			}
		}
		if len(roles) > 0 && len(m.Models) < gossip.MaxMetaModels {
			ms := gossip.NewModelStages(model, roles...)
			ms.DefaultSteps = uint16(min(a.runner.DefaultSteps(model), math.MaxUint16))
			m.Models = append(m.Models, ms)
		}
	}
	if a.ext != nil && len(m.Models) == 0 {
		// Serving nothing yet must not read as "the built-in model".
		m.Models = []gossip.ModelStages{{Name: "-", Stages: 0}}
	}
	slices.SortFunc(m.Models, func(x, y gossip.ModelStages) int { return strings.Compare(x.Name, y.Name) })
	return m
}

// gossipEngine republishes this node's meta whenever its engine registers
// or goes away, and wakes the workers (via Changed) to claim or stop.
//
// It publishes after taking the change channel, never before: an engine
// that registered between Start's first meta and this loop's first wait
// (an engine started with its agent registers within milliseconds) was
// never advertised, and its model never appeared until it reconnected.
func (a *Agent) gossipEngine() {
	for {
		ch := a.runner.Changed()
		if ch == nil {
			return // the built-in engine never changes
		}
		leaseChanged := a.member.LeaseChanged() // a registration may not carry the models
		a.publishMeta()
		a.publishModels()
		a.dropStaleCond()
		select {
		case <-a.ctx.Done():
			return
		case <-ch:
		case <-leaseChanged:
		}
	}
}

// resyncHeld releases held payloads that have no record and are not being
// produced or committed by a running task: their release events were lost
// to an etcd compaction.
func (a *Agent) resyncHeld() {
	// Held and in-flight are read together (begin publishes and notes a
	// payload under the same lock), so no payload is seen held but not yet
	// in flight; a task committing meanwhile leaves a record behind.
	a.inflightMu.Lock()
	held := a.xfer.HeldIDs()
	inflight := make(map[string]bool, len(a.inflight))
	for id := range a.inflight {
		inflight[id] = true
	}
	a.inflightMu.Unlock()
	recorded, err := a.store.Recorded(a.ctx, a.id)
	if err != nil {
		a.log.Warn("resync held payloads", zap.Error(err))
		return
	}
	for _, id := range held {
		if !recorded[id] && !inflight[id] {
			a.log.Info("releasing payload whose release was compacted away", zap.String("payload", id))
			a.release(id)
		}
	}
}

// gossipStoreRoom republishes this node's meta when its Store room changes,
// so that producers waiting for room (and placement) see it: at most ten
// times a second, whatever the rate of puts.
func (a *Agent) gossipStoreRoom() {
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-a.cstore.RoomChanged():
		}
		a.publishMeta()
		a.sleep(100 * time.Millisecond)
	}
}

// forgetDeparted follows the membership's events: it drops the data-plane
// state kept for producers that left the mesh (an shm mapping of a
// departed agent's arena would otherwise keep its memory alive for good),
// has the Store repair what they held and the dispatch adopt what they
// dispatched, and wakes the dispatchers at every change.
func (a *Agent) forgetDeparted() {
	events, stop := a.member.Subscribe()
	defer stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			a.meshChanged.Fire()
			if ev.Type == gossip.EventDeregistered && ev.Peer.Record.PeerID != "" {
				a.xfer.Forget(ev.Peer.Record.PeerID)
			}
			if ev.Type == gossip.EventDeregistered || ev.Type == gossip.EventDead {
				a.cstore.Kick()   // re-replicate what it held
				a.departed.Fire() // adopt the tasks it dispatched (adoptLoop)
			}
		}
	}
}

// reportLoop refreshes queue-depth and credit gauges every two seconds.
// Each agent reports the tasks waiting in its own ledgers (dispatch.go),
// so an idle agent sends etcd nothing for them, and a sum over agents is
// the mesh's backlog.
func (a *Agent) reportLoop() {
	for {
		every := 2 * time.Second
		for st, f := range a.fed {
			a.metrics.SetQueueDepth(st, f.WaitingByClass(a.liveOn))
		}
		for st := range a.credits {
			_, free := a.slots(st)
			a.metrics.SetCredits(st, free, a.credits[st].InUse())
		}
		a.sleep(every)
		if a.ctx.Err() != nil {
			return
		}
	}
}

// slots is what stage st can run here: the agent's credits (--slots),
// bounded by the engine's declared slots (an external engine's; none while
// it is not registered). Gossip, status and metrics all show this.
func (a *Agent) slots(st jobs.Stage) (total, free int) {
	c, engine := a.credits[st], a.runner.Slots(st)
	queued := 0 // claims pushed here that wait for a slot: the next free ones are theirs
	if q := a.inboxes[st]; q != nil {
		queued = q.Waiting(a.member.Lease())
	}
	return min(c.Total(), engine), max(0, min(c.Free(), engine-c.InUse())-queued)
}

// Status is the admin view of this node and what it sees of the mesh.
type Status struct {
	Node    gossip.NodeRecord         `json:"node"`
	Credits map[jobs.Stage]CreditInfo `json:"credits"`
	Peers   []PeerStatus              `json:"peers"`
	Queues  map[jobs.Stage]QueueInfo  `json:"queues"`
	Data    DataInfo                  `json:"data_plane"`
	Store   cache.LocalStats          `json:"store"`
	// EtcdResets counts the times the etcd client saw etcd replaced (an
	// empty or restored etcd at the same address) and started over.
	EtcdResets int64 `json:"etcd_resets"`
	// Preempted counts the batch tasks this agent gave back for waiting
	// interactive work.
	Preempted int64 `json:"preempted"`
}

// DataInfo is this node's data plane: what it holds and how it pulled.
type DataInfo struct {
	Transport    string           `json:"transport"` // configured mode
	HeldPayloads int              `json:"held_payloads"`
	HeldBytes    int64            `json:"held_bytes"`
	ArenaBytes   int64            `json:"arena_bytes,omitempty"`
	ArenaFree    int64            `json:"arena_free,omitempty"`
	Pulls        map[string]int64 `json:"pulls_by_transport"`
	StorePulls   map[string]int64 `json:"store_pulls_by_transport"` // copies into and reads from the Store
	// IssuedPulls counts the pulls that used the ticket their producer
	// issued with a pushed task, asking it for none.
	IssuedPulls int64 `json:"issued_ticket_pulls"`
	// HeapFallbacks counts outputs and HeapPulls pulls that landed on the
	// heap because the arena was full (workers check for room before they
	// claim, so these stay rare); Relayed counts outputs handed on through
	// the Store.
	HeapFallbacks int64 `json:"heap_fallbacks"`
	HeapPulls     int64 `json:"heap_pulls"`
	Relayed       int64 `json:"relayed"`
}

// CreditInfo is one stage's slot ledger.
type CreditInfo struct {
	Total int `json:"total"`
	Free  int `json:"free"`
}

// PeerStatus is one peer as this node sees it.
type PeerStatus struct {
	ID      string            `json:"id"`
	Roles   []string          `json:"roles"`
	Alive   bool              `json:"alive"`
	Suspect bool              `json:"suspect,omitempty"`
	Free    map[string]uint32 `json:"free_credits"`
	Load    float32           `json:"load"`
	HTTP    string            `json:"http_addr,omitempty"`
	// Slots is each role's total credits; Models the models its engine
	// serves (empty: the built-in model); StoreFree the largest object its
	// Store can take now, all as the peer registered or gossiped them.
	Slots     map[string]int `json:"slots,omitempty"`
	Models    []string       `json:"models,omitempty"`
	StoreFree uint64         `json:"store_free"`
}

// QueueInfo is one stage's queue.
type QueueInfo struct {
	Queued  int64 `json:"queued"`
	Running int64 `json:"running"`
	// ByClass counts the stage's tasks of each priority class, queued or
	// running.
	ByClass map[routing.Class]int64 `json:"by_class"`
}

// Status reports this node, its peers and the queues.
func (a *Agent) Status(ctx context.Context) (Status, error) {
	st := Status{
		Node:    a.member.Self().Record,
		Credits: map[jobs.Stage]CreditInfo{},
		Queues:  map[jobs.Stage]QueueInfo{},
	}
	for s := range a.credits {
		total, free := a.slots(s)
		st.Credits[s] = CreditInfo{Total: total, Free: free}
	}
	for _, p := range a.member.Peers() {
		st.Peers = append(st.Peers, PeerStatus{
			ID: p.Record.ID, Roles: p.Record.Roles, Alive: p.Alive, Suspect: p.Suspect,
			Free: freeByRole(p.Meta.Free),
			Load: p.Meta.Load, HTTP: p.Record.HTTPAddr,
			Slots: p.Record.Slots, Models: modelNames(p.Meta.Models), StoreFree: p.Meta.StoreFree,
		})
	}
	for _, s := range jobs.Stages() {
		byClass, running, err := a.store.ClassDepth(ctx, s) // on demand: nobody follows a whole stage
		if err != nil {
			return Status{}, err
		}
		var total int64
		for _, n := range byClass {
			total += n
		}
		st.Queues[s] = QueueInfo{Queued: total - running, Running: running, ByClass: byClass}
	}
	xs := a.xfer.Stats()
	st.Data = DataInfo{
		Transport: a.cfg.Transfer.Transport, HeldPayloads: xs.Payloads, HeldBytes: xs.PayloadBytes,
		ArenaBytes: xs.Arena.Size, ArenaFree: xs.Arena.Free, Pulls: xs.Pulls, StorePulls: xs.StorePulls, IssuedPulls: xs.IssuedPulls,
		HeapFallbacks: xs.HeapFallbacks, HeapPulls: a.heapPulls.Load(), Relayed: a.relayed.Load(),
	}
	st.Store = a.cstore.LocalStats()
	st.EtcdResets = a.guard.Resets()
	st.Preempted = a.preempted.Load()
	return st, nil
}

// modelNames lists the names of gossiped models.
func modelNames(ms []gossip.ModelStages) []string {
	out := make([]string, 0, len(ms))
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return out
}

// freeByRole lists gossiped free credits by stage name.
func freeByRole(c gossip.StageCredits) map[string]uint32 {
	out := make(map[string]uint32, 3)
	for _, st := range jobs.Stages() {
		out[string(st)] = c.For(string(st))
	}
	return out
}

// sameHost reports whether node runs on this agent's host (and so can take
// payloads over shared memory).
func (a *Agent) sameHost(p gossip.Peer) bool {
	return p.Record.Host != "" && p.Record.Host == a.xfer.HostID()
}
