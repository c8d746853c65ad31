package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
	"github.com/latentmesh/latentmesh/testbed/sim"
	"github.com/latentmesh/latentmesh/testbed/simgpu"
	"github.com/latentmesh/latentmesh/transfer"
)

// The control plane's budget per job (issue 18): what a job may cost etcd
// whatever the fleet's size.
const (
	ControlBudgetProposals = 6  // raft proposals committed per job
	ControlBudgetEvents    = 16 // watch events sent per job
	// ControlBudgetSpread is how far the largest fleet's figures per job
	// may be from the smallest's: a job costs the same at any size.
	ControlBudgetSpread = 0.10
)

// controlBenchModel is the name of the simulated model every agent serves.
const controlBenchModel = "ctlbench-sim"

// ControlBenchConfig configures RunControlBench: jobs through the client
// HTTP API on fleets of several sizes, each on its own etcd, counted by
// etcd itself (its /metrics): what one job, and one idle agent, cost etcd.
type ControlBenchConfig struct {
	// Agents are the fleet sizes, in agents: 1 encode, n-2 denoise and
	// 1 decode agent each (n >= 3).
	Agents []int
	// Jobs per fleet, after one warm-up job.
	Jobs int
	// Steps are each job's denoise steps.
	Steps int
	// Clients submit and long-poll one job at a time each, round robin
	// over the agents' client APIs.
	Clients int
	// Idle is the window measured after the jobs, with nothing submitted.
	Idle time.Duration
	// Sim is the model every agent serves: simulated GPU time per stage
	// and its tensors' shapes.
	Sim simgpu.Model
	// Agent is every agent's base config; node id, roles, prefix and the
	// engine are set per agent.
	Agent agent.Config
	// Etcd is the etcd started for each fleet, so fleets share no history.
	Etcd EtcdProcessConfig
	// EtcdEndpoints, when set, is an etcd of the caller's used instead of
	// starting one; each fleet then runs under a key prefix of its own.
	// Its figures are one member's: give a one-member etcd.
	EtcdEndpoints []string
	// EtcdMetrics is that etcd's Prometheus endpoint; "" is
	// EtcdEndpoints[0] + "/metrics", where etcd serves it by default.
	EtcdMetrics string
	// Progress, if not nil, receives a line per phase of each fleet.
	Progress io.Writer
	Logger   *zap.Logger
}

// DefaultControlBenchConfig is issue 18's set-up: fleets of 4 and 26
// agents on Debian's etcd with its default flags, 120 jobs of 20 steps.
func DefaultControlBenchConfig() ControlBenchConfig {
	return ControlBenchConfig{
		Agents: []int{4, 26}, // 2 and 24 denoise agents
		Jobs:   120,          // enough that the warm-up's and the window's edges are noise
		Steps:  20,           // a typical image model's denoise
		// Two clients keep at most two jobs in flight: the smallest
		// fleet's denoise slots. No task then waits for a slot in any
		// fleet (every handoff is a pushed claim), so the fleets differ
		// in size only, not in queueing.
		Clients: 2,
		Idle:    10 * time.Second, // three lease renewals and a Store pass per agent
		Sim: simgpu.Model{
			// A few ms of simulated GPU time per stage: 120 jobs take
			// seconds, and the CPU is left to the control plane.
			Encode: 2 * time.Millisecond,
			Step:   2 * time.Millisecond,
			Decode: 5 * time.Millisecond,
			// KiB-sized payloads: they move peer to peer, never via etcd.
			Cond:        transfer.TensorMeta{DType: transfer.BFloat16, Shape: []int64{1, 16, 64}, NumChunks: 1},
			Latent:      transfer.TensorMeta{DType: transfer.BFloat16, Shape: []int64{1, 4, 8, 8}, NumChunks: 1},
			ResultBytes: 4 << 10,
		},
		Agent:  controlBenchAgent(),
		Etcd:   DefaultEtcdProcessConfig(),
		Logger: zap.NewNop(),
	}
}

// controlBenchAgent is a test agent (loopback, fast gossip, a small
// arena) that talks to etcd as a deployed one does: the default alarm
// poll, lease TTL and Store passes, so the idle figures are a deployed
// agent's.
func controlBenchAgent() agent.Config {
	prod := agent.DefaultConfig()
	c := agent.DefaultLocalConfig()
	c.AlarmEvery = prod.AlarmEvery
	c.Gossip.LeaseTTL = prod.Gossip.LeaseTTL
	c.Store.MaintainEvery, c.Store.OrphanBatch = prod.Store.MaintainEvery, prod.Store.OrphanBatch
	c.AdminListen = ""               // nothing reads it
	c.Transfer.Arena.Size = 16 << 20 // payloads are KiB; 26 agents share one machine
	return c
}

// ControlBenchReport is what RunControlBench measured, a row per fleet.
type ControlBenchReport struct {
	EtcdVersion string              `json:"etcd_version"`
	Jobs        int                 `json:"jobs"`
	Steps       int                 `json:"steps"`
	Clients     int                 `json:"clients"`
	Fleets      []ControlBenchFleet `json:"fleets"`
}

// ControlBenchFleet is one fleet's figures.
type ControlBenchFleet struct {
	Agents  int `json:"agents"`
	Denoise int `json:"denoise_agents"`
	Jobs    int `json:"jobs"` // that succeeded; every job must
	// Seconds is the jobs' window: the first submit to the last answer.
	Seconds    float64 `json:"seconds"`
	JobsPerSec float64 `json:"jobs_per_s"`
	// PerJob is etcd's counters over the jobs' window (from a quiet mesh
	// to a quiet mesh), divided by the jobs.
	PerJob EtcdCost `json:"per_job"`
	// PerJobLessIdle is PerJob less what the fleet costs idle over the
	// same window (lease renewals and the Store's passes).
	PerJobLessIdle EtcdCost `json:"per_job_less_idle"`
	// EventsByWatch splits PerJob.Events by the watch that received them
	// (its key, ids left out), as the agents' client counted them.
	EventsByWatch map[string]float64 `json:"events_per_job_by_watch"`
	IdleSeconds   float64            `json:"idle_seconds"`
	// IdlePerAgent is etcd's counters over the idle window, per agent
	// and second.
	IdlePerAgent EtcdCost `json:"idle_per_agent_s"`
	// Sim is what the simulator counts for a job on a fleet of this shape
	// (simulateFleet), to check it against etcd's count.
	Sim SimPerJob `json:"sim"`
}

// SimPerJob is the simulator's count of what a job costs etcd on a mesh
// of a fleet's shape: testbed/sim's Mesh mode on 1 encode, the fleet's
// denoise and 1 decode GPU, every job's texts cached as here, at 30% of
// the pools' capacity for an hour (no task waits for a slot, as with the
// bench's two clients).
type SimPerJob struct {
	Jobs   int     `json:"jobs"`
	Writes float64 `json:"writes"` // write transactions: compare EtcdCost.Txns
	Events float64 `json:"watch_events"`
}

// simulateFleet runs the simulator on a fleet of n agents' shape.
func simulateFleet(n int) (SimPerJob, error) {
	c := sim.DefaultConfig()
	c.Mode, c.Seed, c.Load, c.Duration = sim.Mesh, 1, 0.3, time.Hour
	c.GPUs, c.Pools, c.CondCached = n, costmodel.Pools{Encode: 1, Denoise: n - 2, Decode: 1}, true
	r, err := sim.Run(c)
	if err != nil {
		return SimPerJob{}, err
	}
	return SimPerJob{Jobs: r.Completed, Writes: r.EtcdWritesPerJob, Events: r.EtcdEventsPerJob}, nil
}

// EtcdCost is a difference of etcd's counters, scaled (per job, or per
// agent and second).
type EtcdCost struct {
	// Events are watch events sent to watchers: one write seen by three
	// watches is three (etcd_debugging_mvcc_events_total).
	Events float64 `json:"watch_events"`
	// Proposals are raft proposals committed
	// (etcd_server_proposals_committed_total): writes, lease grants and
	// revocations, and on etcd 3.4 every alarm list.
	Proposals float64 `json:"raft_proposals"`
	// Ranges are ranges read in etcd's store (etcd_mvcc_range_total),
	// compares of transactions included.
	Ranges  float64 `json:"ranges"`
	Puts    float64 `json:"puts"`    // etcd_mvcc_put_total
	Deletes float64 `json:"deletes"` // etcd_mvcc_delete_total
	// Txns are transactions sent (the gRPC Txn calls).
	Txns float64 `json:"txns"`
	// MVCCTxns are the store's transactions of more than one operation
	// (etcd_mvcc_txn_total), a compare excluded.
	MVCCTxns      float64 `json:"mvcc_txns"`
	LeaseGrants   float64 `json:"lease_grants"`   // etcd_debugging_lease_granted_total
	LeaseRenewals float64 `json:"lease_renewals"` // etcd_debugging_lease_renewed_total
	// Requests are the gRPC requests received, by method: calls, and
	// the messages sent on a stream (a keepalive, a watch created).
	Requests map[string]float64 `json:"grpc_requests"`
}

// RunControlBench measures each fleet of cfg.Agents in turn.
func RunControlBench(ctx context.Context, cfg ControlBenchConfig) (ControlBenchReport, error) {
	if err := cfg.check(); err != nil {
		return ControlBenchReport{}, err
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	rep := ControlBenchReport{Jobs: cfg.Jobs, Steps: cfg.Steps, Clients: cfg.Clients}
	for i, n := range cfg.Agents {
		f, version, err := runControlFleet(ctx, cfg, i, n)
		if err != nil {
			return ControlBenchReport{}, fmt.Errorf("testbed: bench control, %d agents: %w", n, err)
		}
		rep.EtcdVersion = version
		rep.Fleets = append(rep.Fleets, f)
	}
	return rep, nil
}

func (cfg *ControlBenchConfig) check() error {
	switch {
	case len(cfg.Agents) == 0:
		return errors.New("testbed: bench control needs a fleet size")
	case cfg.Jobs <= 0 || cfg.Clients <= 0 || cfg.Steps <= 0:
		return errors.New("testbed: bench control needs jobs, clients and steps")
	case cfg.Idle <= 0:
		return errors.New("testbed: bench control needs an idle window")
	}
	for _, n := range cfg.Agents {
		if n < 3 {
			return fmt.Errorf("testbed: bench control: a fleet of %d agents: at least 3 (encode, denoise, decode)", n)
		}
	}
	if len(cfg.EtcdEndpoints) == 0 && cfg.Etcd.Binary == "" {
		if _, err := EtcdBinaryAvailable(); err != nil {
			return err
		}
	}
	return nil
}

// runControlFleet measures one fleet of n agents; i numbers it in the run.
func runControlFleet(ctx context.Context, cfg ControlBenchConfig, i, n int) (f ControlBenchFleet, version string, err error) {
	progress := func(format string, a ...any) {
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "bench control: %d agents: "+format+"\n", append([]any{n}, a...)...)
		}
	}
	endpoints, metrics := cfg.EtcdEndpoints, cfg.EtcdMetrics
	prefix := cfg.Agent.Prefix
	if len(endpoints) == 0 {
		e, err := StartEtcdProcess(ctx, cfg.Etcd)
		if err != nil {
			return f, "", err
		}
		defer func() { err = errors.Join(err, e.Close()) }()
		endpoints, metrics = e.Endpoints(), ""
	} else {
		// A shared etcd keeps earlier fleets' keys: give this one its own.
		prefix = fmt.Sprintf("/latentmesh/ctlbench-%d-%d-%d", time.Now().Unix(), i, n)
	}
	if metrics == "" {
		metrics = strings.TrimRight(endpoints[0], "/") + "/metrics"
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Clients + 1}, Timeout: time.Minute}
	defer hc.CloseIdleConnections()
	scrape := func() (etcdScrape, error) { return scrapeEtcd(ctx, hc, metrics) }
	if _, err := scrape(); err != nil {
		return f, "", err
	}

	start := time.Now()
	cc := DefaultClusterConfig()
	cc.Topology = "" // agents added below, once their watches are tallied
	cc.EtcdEndpoints = endpoints
	cc.Logger = cfg.Logger
	cl, err := StartCluster(ctx, cc)
	if err != nil {
		return f, "", err
	}
	defer func() { err = errors.Join(err, cl.Close()) }()
	tally := tallyWatches(cl.Client, prefix)
	f = ControlBenchFleet{Agents: n, Denoise: n - 2}
	for k := range n {
		ac := cfg.Agent
		ac.Prefix = prefix
		switch {
		case k == 0:
			ac.NodeID, ac.Roles = "encode-1", []jobs.Stage{jobs.Encode}
		case k == n-1:
			ac.NodeID, ac.Roles = "decode-1", []jobs.Stage{jobs.Decode}
		default:
			ac.NodeID, ac.Roles = fmt.Sprintf("denoise-%02d", k), []jobs.Stage{jobs.Denoise}
		}
		ac.Logger = cfg.Logger.Named(ac.NodeID)
		ac.NewRunner = simgpu.Config{Models: map[string]simgpu.Model{controlBenchModel: cfg.Sim}}.Runner
		if _, err := cl.AddAgentConfig(ctx, ac); err != nil {
			return f, "", fmt.Errorf("start %s: %w", ac.NodeID, err)
		}
	}
	if err := waitMeshReady(ctx, cl, controlBenchModel); err != nil {
		return f, "", err
	}
	clients := make([]*httpapi.Client, len(cl.Agents))
	for k, a := range cl.Agents {
		clients[k] = &httpapi.Client{BaseURL: "http://" + a.HTTPAddr(), HTTP: hc}
	}
	steps := cfg.Steps
	req := httpapi.JobRequest{Model: controlBenchModel, Prompt: "bench control", Steps: &steps}
	if _, err := benchJob(ctx, clients[0], req); err != nil {
		return f, "", fmt.Errorf("warm-up job: %w", err)
	}
	s0, err := waitQuiet(ctx, scrape, cfg.Logger)
	if err != nil {
		return f, "", err
	}
	e0 := tally.snap()
	progress("ready in %.1fs; %d jobs from %d clients", time.Since(start).Seconds(), cfg.Jobs, cfg.Clients)

	var (
		left  atomic.Int64
		done  atomic.Int64
		wg    sync.WaitGroup
		errMu sync.Mutex
		first error
	)
	left.Store(int64(cfg.Jobs))
	jctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t0 := time.Now()
	for c := range cfg.Clients {
		cli := clients[c%len(clients)]
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				if _, err := benchJob(jctx, cli, req); err != nil {
					errMu.Lock()
					if first == nil {
						first = err
						cancel() // every client stops; the run has failed
					}
					errMu.Unlock()
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	f.Seconds = time.Since(t0).Seconds()
	if first != nil {
		return f, "", first
	}
	f.Jobs = int(done.Load())
	f.JobsPerSec = float64(f.Jobs) / f.Seconds
	// Every Wait has returned: the jobs are finished. What their commits
	// set off (a producer's release of its payload, a record's removal)
	// belongs to them too: the window ends when etcd is quiet again.
	s1, err := waitQuiet(ctx, scrape, cfg.Logger)
	if err != nil {
		return f, "", err
	}
	e1 := tally.snap()
	progress("%.1f jobs/s; idle for %v", f.JobsPerSec, cfg.Idle)

	select {
	case <-time.After(cfg.Idle):
	case <-ctx.Done():
		return f, "", ctx.Err()
	}
	s2, err := scrape()
	if err != nil {
		return f, "", err
	}
	f.IdleSeconds = s2.at.Sub(s1.at).Seconds()
	f.PerJob = s1.minus(s0).scale(1 / float64(f.Jobs))
	f.IdlePerAgent = s2.minus(s1).scale(1 / (float64(n) * f.IdleSeconds))
	idle := f.IdlePerAgent.scale(float64(n) * s1.at.Sub(s0.at).Seconds() / float64(f.Jobs))
	f.PerJobLessIdle = f.PerJob.minus(idle)
	f.EventsByWatch = map[string]float64{}
	for k, v := range e1 {
		if d := v - e0[k]; d != 0 {
			f.EventsByWatch[k] = float64(d) / float64(f.Jobs)
		}
	}
	if f.Sim, err = simulateFleet(n); err != nil {
		return f, "", err
	}
	return f, s2.version, nil
}

// meshReadyTimeout bounds the wait for a fleet's gossip to converge.
const meshReadyTimeout = 2 * time.Minute

// waitMeshReady waits until every agent sees every other alive through
// gossip and model served on every stage: submissions go through, and
// each producer sees its next stage's free slots (pushed claims).
func waitMeshReady(ctx context.Context, cl *Cluster, model string) error {
	deadline := time.Now().Add(meshReadyTimeout)
	backoff := 50 * time.Millisecond
	for {
		ready, why := meshReady(ctx, cl, model)
		if ready {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("mesh not ready within %v: %s", meshReadyTimeout, why)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

func meshReady(ctx context.Context, cl *Cluster, model string) (bool, string) {
	for _, a := range cl.Agents {
		if !a.ModelServed(model) {
			return false, a.ID() + " does not see " + model + " served"
		}
	}
	for _, a := range cl.Agents {
		st, err := a.Status(ctx)
		if err != nil {
			return false, fmt.Sprintf("status of %s: %v", a.ID(), err)
		}
		alive := 0
		for _, p := range st.Peers {
			if p.Alive {
				alive++
			}
		}
		if alive != len(cl.Agents) {
			return false, fmt.Sprintf("%s sees %d of %d agents alive", a.ID(), alive, len(cl.Agents))
		}
	}
	return true, ""
}

// Quiet is etcd's revision unchanged for quietFor, seen within quietWithin.
const (
	quietFor    = time.Second
	quietWithin = 15 * time.Second
	quietPoll   = 200 * time.Millisecond
)

// waitQuiet scrapes etcd until its revision has not moved for quietFor,
// and returns that scrape: nothing the mesh set off is still writing. A
// mesh that keeps writing is measured anyway, after quietWithin (the
// idle figures then show the writes).
func waitQuiet(ctx context.Context, scrape func() (etcdScrape, error), log *zap.Logger) (etcdScrape, error) {
	last, err := scrape()
	if err != nil {
		return etcdScrape{}, err
	}
	since, deadline := last.at, last.at.Add(quietWithin)
	for {
		select {
		case <-ctx.Done():
			return etcdScrape{}, ctx.Err()
		case <-time.After(quietPoll):
		}
		s, err := scrape()
		if err != nil {
			return etcdScrape{}, err
		}
		if s.revision != last.revision {
			since = s.at
		}
		last = s
		if s.at.Sub(since) >= quietFor {
			return s, nil
		}
		if s.at.After(deadline) {
			log.Warn("etcd's revision kept moving; measuring anyway", zap.Duration("waited", quietWithin))
			return s, nil
		}
	}
}

// etcdScrape is one read of the counters etcd exports at /metrics.
type etcdScrape struct {
	at       time.Time
	version  string
	revision float64
	cost     EtcdCost // the counters' values, not yet a difference
}

// The metric names, checked against Debian's etcd 3.4.23. The store's
// counters are etcd_mvcc_* from 3.4 on; 3.4 also exports them as
// etcd_debugging_mvcc_* (with the same values), which 3.5 dropped.
const (
	metricEvents        = "etcd_debugging_mvcc_events_total"
	metricProposals     = "etcd_server_proposals_committed_total"
	metricRanges        = "etcd_mvcc_range_total"
	metricPuts          = "etcd_mvcc_put_total"
	metricDeletes       = "etcd_mvcc_delete_total"
	metricMVCCTxns      = "etcd_mvcc_txn_total"
	metricLeaseGrants   = "etcd_debugging_lease_granted_total"
	metricLeaseRenewals = "etcd_debugging_lease_renewed_total"
	metricRevision      = "etcd_debugging_mvcc_current_revision"
	metricVersion       = "etcd_server_version"
	metricGRPCReceived  = "grpc_server_msg_received_total"
)

// scrapeEtcd reads url, an etcd's /metrics.
func scrapeEtcd(ctx context.Context, hc *http.Client, url string) (etcdScrape, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return etcdScrape{}, fmt.Errorf("etcd metrics %s: %w", url, err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return etcdScrape{}, fmt.Errorf("etcd metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return etcdScrape{}, fmt.Errorf("etcd metrics %s: %s", url, resp.Status)
	}
	s, err := parseEtcdMetrics(resp.Body)
	if err != nil {
		return etcdScrape{}, fmt.Errorf("etcd metrics %s: %w", url, err)
	}
	s.at = time.Now()
	return s, nil
}

// parseEtcdMetrics reads etcd's counters from its text exposition.
func parseEtcdMetrics(r io.Reader) (etcdScrape, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(r)
	if err != nil {
		return etcdScrape{}, err
	}
	var missing []string
	value := func(name string, required bool) float64 {
		mf := mfs[name]
		if mf == nil || len(mf.GetMetric()) == 0 {
			if required {
				missing = append(missing, name)
			}
			return 0
		}
		return metricValue(mf.GetMetric()[0])
	}
	var s etcdScrape
	s.cost = EtcdCost{
		Events:        value(metricEvents, true),
		Proposals:     value(metricProposals, true),
		Ranges:        value(metricRanges, true),
		Puts:          value(metricPuts, true),
		Deletes:       value(metricDeletes, true),
		MVCCTxns:      value(metricMVCCTxns, true),
		LeaseGrants:   value(metricLeaseGrants, false),
		LeaseRenewals: value(metricLeaseRenewals, false),
		Requests:      map[string]float64{},
	}
	s.revision = value(metricRevision, true)
	if mf := mfs[metricGRPCReceived]; mf != nil {
		for _, m := range mf.GetMetric() {
			if v := metricValue(m); v != 0 {
				s.cost.Requests[labelValue(m, "grpc_method")] += v
			}
		}
	} else {
		missing = append(missing, metricGRPCReceived)
	}
	s.cost.Txns = s.cost.Requests["Txn"]
	if mf := mfs[metricVersion]; mf != nil && len(mf.GetMetric()) > 0 {
		s.version = labelValue(mf.GetMetric()[0], "server_version")
	}
	if len(missing) > 0 {
		return etcdScrape{}, fmt.Errorf("not an etcd 3.4 or later: no %s", strings.Join(missing, ", "))
	}
	return s, nil
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// minus is the counters' growth from b to s.
func (s etcdScrape) minus(b etcdScrape) EtcdCost { return s.cost.minus(b.cost) }

func (c EtcdCost) minus(b EtcdCost) EtcdCost {
	return c.combine(b, func(x, y float64) float64 { return x - y })
}

func (c EtcdCost) scale(k float64) EtcdCost {
	return c.combine(EtcdCost{}, func(x, _ float64) float64 { return x * k })
}

// combine applies op to each counter of c and b.
func (c EtcdCost) combine(b EtcdCost, op func(x, y float64) float64) EtcdCost {
	out := EtcdCost{
		Events: op(c.Events, b.Events), Proposals: op(c.Proposals, b.Proposals), Ranges: op(c.Ranges, b.Ranges),
		Puts: op(c.Puts, b.Puts), Deletes: op(c.Deletes, b.Deletes), Txns: op(c.Txns, b.Txns), MVCCTxns: op(c.MVCCTxns, b.MVCCTxns),
		LeaseGrants: op(c.LeaseGrants, b.LeaseGrants), LeaseRenewals: op(c.LeaseRenewals, b.LeaseRenewals),
		Requests: map[string]float64{},
	}
	for k, v := range c.Requests {
		if d := op(v, b.Requests[k]); d != 0 {
			out.Requests[k] = d
		}
	}
	for k, v := range b.Requests {
		if _, ok := c.Requests[k]; !ok {
			if d := op(0, v); d != 0 {
				out.Requests[k] = d
			}
		}
	}
	return out
}

// watchTally counts the events the watches of a client receive, by the
// kind of watch: its key with the mesh's prefix and ids left out. It is
// how the bench says whose watches etcd's events go to.
type watchTally struct {
	clientv3.Watcher
	prefix string

	mu     sync.Mutex
	events map[string]int64 // mu guards
}

// tallyWatches wraps cli's Watcher. Call it before anything watches.
func tallyWatches(cli *clientv3.Client, prefix string) *watchTally {
	t := &watchTally{Watcher: cli.Watcher, prefix: prefix, events: map[string]int64{}}
	cli.Watcher = t
	return t
}

// Watch forwards the watch's responses, counting their events, until the
// watch ends (its channel closes: ctx done or the client closed).
func (t *watchTally) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	in := t.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	kind := watchKind(t.prefix, key)
	go func() {
		defer close(out)
		for wr := range in {
			if n := len(wr.Events); n > 0 {
				t.mu.Lock()
				t.events[kind] += int64(n)
				t.mu.Unlock()
			}
			select {
			case out <- wr:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

func (t *watchTally) snap() map[string]int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.events)
}

// watchKind names a watch by its key under prefix, job and node ids left
// out: "queues/denoise/", "queues/decode/tasks/<class>/<node>/",
// "queues/decode/tasks/<task>", "objects/<job>...",
// "jobs/<job>", "payloads/<node>/", "holders/<node>/".
func watchKind(prefix, key string) string {
	rest, ok := strings.CutPrefix(key, prefix+"/")
	if !ok {
		return key
	}
	top, sub, nested := strings.Cut(rest, "/")
	switch {
	case !nested:
		return rest
	case top == "jobs" || top == "progress" || top == "ended":
		return top + "/<job>"
	case top == "payloads" || top == "holders":
		return top + "/<node>/"
	case top == "objects" && sub != "":
		return top + "/<job>..."
	case top == "queues":
		stage, rest, _ := strings.Cut(sub, "/")
		if kind, task, _ := strings.Cut(rest, "/"); kind == "tasks" && task != "" {
			if strings.HasSuffix(task, "/") {
				return top + "/" + stage + "/tasks/<class>/<node>/" // a dispatcher's watch of the tasks it created (jobs.Fed)
			}
			return top + "/" + stage + "/tasks/<task>" // a dispatcher's watch of one task it adopted (jobs.Fed)
		}
		return top + "/" + stage + "/"
	}
	return top + "/"
}

// WriteTable prints rep for people: a row per fleet, where the events go,
// and the fleets' figures against the budget.
func (rep ControlBenchReport) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "etcd %s; %d jobs of %d steps per fleet, %d clients\n", rep.EtcdVersion, rep.Jobs, rep.Steps, rep.Clients)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "agents\tevents/job\tproposals/job\tranges/job\ttxns/job\tidle proposals/agent/s\tidle ranges/agent/s\tjobs/s\tsim events/job\tsim txns/job\t")
	for _, f := range rep.Fleets {
		fmt.Fprintf(tw, "%d\t%.1f\t%.2f\t%.1f\t%.2f\t%.3f\t%.3f\t%.1f\t%.1f\t%.2f\t\n", f.Agents, f.PerJob.Events, f.PerJob.Proposals,
			f.PerJob.Ranges, f.PerJob.Txns, f.IdlePerAgent.Proposals, f.IdlePerAgent.Ranges, f.JobsPerSec, f.Sim.Events, f.Sim.Writes)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var kinds []string
	for _, f := range rep.Fleets {
		for k := range f.EventsByWatch {
			if !slices.Contains(kinds, k) {
				kinds = append(kinds, k)
			}
		}
	}
	slices.Sort(kinds)
	fmt.Fprintln(w, "events/job by the watch that received them:")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "watch\t")
	for _, f := range rep.Fleets {
		fmt.Fprintf(tw, "%d agents\t", f.Agents)
	}
	fmt.Fprintln(tw)
	for _, k := range kinds {
		fmt.Fprintf(tw, "%s\t", k)
		for _, f := range rep.Fleets {
			fmt.Fprintf(tw, "%.1f\t", f.EventsByWatch[k])
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if _, err := fmt.Fprintln(w, rep.Verdict()); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, rep.SimVerdict())
	return err
}

// SimAgreement is how far the simulator's counts a job may be from
// etcd's (ControlBenchFleet.Sim): it models the agent's operations, and a
// drift between them is a bug in one.
const SimAgreement = 0.10

// SimOff is the largest relative difference, over the fleets, between
// the simulator's events and write transactions a job and etcd's.
func (rep ControlBenchReport) SimOff() (events, writes float64) {
	for _, f := range rep.Fleets {
		events = max(events, math.Abs(f.Sim.Events-f.PerJob.Events)/f.PerJob.Events)
		writes = max(writes, math.Abs(f.Sim.Writes-f.PerJob.Txns)/f.PerJob.Txns)
	}
	return events, writes
}

// SimVerdict says whether the simulator's counts agree with etcd's.
func (rep ControlBenchReport) SimVerdict() string {
	ev, wr := rep.SimOff()
	ok := "yes"
	if ev > SimAgreement || wr > SimAgreement {
		ok = "no"
	}
	return fmt.Sprintf("simulator against etcd, a job on the same fleets: events at most %.0f%% off, write txns %.0f%% off (within %.0f%%: %s)", 100*ev, 100*wr, 100*SimAgreement, ok)
}

// Verdict compares the largest fleet's events and proposals per job with
// the smallest's, and every fleet's with the budget (issue 18).
func (rep ControlBenchReport) Verdict() string {
	if len(rep.Fleets) == 0 {
		return "no fleets"
	}
	small, large := rep.Fleets[0], rep.Fleets[0]
	worst := rep.Fleets[0].PerJob
	for _, f := range rep.Fleets {
		if f.Agents < small.Agents {
			small = f
		}
		if f.Agents > large.Agents {
			large = f
		}
		worst.Events = max(worst.Events, f.PerJob.Events)
		worst.Proposals = max(worst.Proposals, f.PerJob.Proposals)
	}
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return math.Inf(1)
		}
		return a / b
	}
	within := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	budget := fmt.Sprintf("budget: events/job <= %d: %s (%.1f at most), proposals/job <= %d: %s (%.2f at most)",
		ControlBudgetEvents, within(worst.Events <= ControlBudgetEvents), worst.Events,
		ControlBudgetProposals, within(worst.Proposals <= ControlBudgetProposals), worst.Proposals)
	if large.Agents == small.Agents {
		return budget // one size: nothing to compare it with
	}
	re := ratio(large.PerJob.Events, small.PerJob.Events)
	rp := ratio(large.PerJob.Proposals, small.PerJob.Proposals)
	return fmt.Sprintf("%d agents against %d: events/job x%.2f, proposals/job x%.2f (within %.0f%%: %s); %s",
		large.Agents, small.Agents, re, rp, 100*ControlBudgetSpread,
		within(math.Abs(re-1) < ControlBudgetSpread && math.Abs(rp-1) < ControlBudgetSpread), budget)
}
