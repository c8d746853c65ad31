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
	"net"
	"net/http"
	"os"
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
	"github.com/latentmesh/latentmesh/agent/offer"
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
	// stopOffers stops taking offered claims (offers.go).
	stopOffers func()
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
	if cfg.Queue.Push && cfg.Queue.Offer {
		jc.Offer = a.sendOffer
	}
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
	a.stopOffers = offer.Serve(a.host, a.admitPeer, a.takeOffer, a.log)
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
		if a.stopOffers != nil {
			a.stopOffers()
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
