package testbed

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// ChaosConfig is one run of `latentmesh-dev testbed chaos`: agents on hosts in
// network namespaces with a 3-member etcd, steady load while random
// faults are injected, then invariant checks.
type ChaosConfig struct {
	// Binary is the latentmesh executable the agents run (the chaos
	// command passes its own).
	Binary string
	// Agents is how many agents, one per host. Agent i serves stage i mod
	// 3; agents past the last whole three serve every stage.
	Agents int
	// Duration is how long load and faults run.
	Duration time.Duration
	// Seed seeds the choice of faults, their targets and times, and the
	// load's requests.
	Seed int64
	// Rate is the load: submissions a second, open loop (a slow answer
	// does not slow the next submission).
	Rate float64
	// FaultEvery is the mean gap between fault starts (uniform in half to
	// one and a half of it).
	FaultEvery time.Duration
	// Settle bounds how long, once faults stop, the run waits for every
	// job to finish, and then again for leaked records and copies to go.
	Settle time.Duration
	// LeaseTTL is the agents' etcd lease TTL: a dead or cut-off agent's
	// claims free up after it.
	LeaseTTL time.Duration
	// StageTimeout is the agents' --store-stage-timeout: a staged copy
	// whose putter was killed before its commit is held this long.
	StageTimeout time.Duration
	// SimCost is the agents' --sim-cost, so stages last long enough for
	// faults to land mid-task.
	SimCost string
	// ArenaSize is each agent's --arena-size.
	ArenaSize string
	// Dir holds agent logs, keys and etcd data; "" makes a temporary one,
	// removed unless the run found a violation or failed.
	Dir string
	// Progress receives human-readable progress; may be nil.
	Progress io.Writer
}

// DefaultChaosConfig is the long run: 6 agents for two minutes.
func DefaultChaosConfig() ChaosConfig {
	return ChaosConfig{
		Agents:       6,                                   // two per stage
		Duration:     120 * time.Second,                   // room for 20+ faults
		Seed:         1,                                   // a run is repeatable in its choices
		Rate:         2,                                   // well under the mesh's capacity, so backlogs come from faults
		FaultEvery:   4 * time.Second,                     // about 30 faults in two minutes
		Settle:       90 * time.Second,                    // retries back off up to 16 s; five attempts
		LeaseTTL:     2 * time.Second,                     // faults longer than this cost the agent its claims
		StageTimeout: 15 * time.Second,                    // a killed putter's staged copies go before the leak check ends
		SimCost:      "encode=20ms,step=40ms,decode=60ms", // a job lasts about a quarter second
		ArenaSize:    "64MiB",                             // six agents' arenas fit a small machine
		Dir:          "",                                  // a temporary directory
		Progress:     nil,                                 // quiet
	}
}

// ChaosReport is what a chaos run found. Lost, DuplicateCommits,
// LeakedPayloads and Corrupt must be zero.
type ChaosReport struct {
	// Accepted counts submissions answered 2xx: the mesh promised them.
	Accepted int `json:"accepted"`
	// Completed counts accepted jobs that succeeded with a result that
	// reads back byte-identical to the engine run in one process.
	Completed int `json:"completed"`
	// Failed counts accepted jobs that ended failed with a reason.
	Failed int `json:"failed"`
	// Lost counts accepted jobs that, after the settle, are not finished
	// (queued, running, cancelled, or gone from etcd), failed without a
	// reason, or succeeded with a result no agent can read.
	Lost int `json:"lost"`
	// DuplicateCommits counts stage commits in etcd's history of the job
	// records that must not have happened (see duplicateCommits), plus
	// result records not written by the commit that finished their job.
	DuplicateCommits int `json:"duplicate_commits"`
	// LeakedPayloads counts, after the settle, payload and object records
	// that belong to no live job (a succeeded job's result excepted), and
	// payloads and Store copies agents hold beyond what records name.
	LeakedPayloads int `json:"leaked_payloads"`
	// FaultsInjected counts faults injected; Faults breaks them down.
	FaultsInjected int               `json:"faults_injected"`
	Faults         map[FaultKind]int `json:"faults"`
	// Corrupt counts succeeded jobs whose result differs from the engine's.
	Corrupt int `json:"corrupt"`
	// Refused counts submissions answered 503 or 429 (not accepted);
	// Unanswered those that got no answer (a paused or cut-off agent, a
	// timeout); Unacknowledged the jobs found in etcd that no submission
	// was told of (an answer lost on its way): they are checked for
	// duplicate commits and leaks, not counted as accepted.
	Refused        int `json:"refused"`
	Unanswered     int `json:"unanswered"`
	Unacknowledged int `json:"unacknowledged"`
	// RefusedShare and UnansweredShare are Refused and Unanswered over
	// every submission made.
	RefusedShare    float64 `json:"refused_share"`
	UnansweredShare float64 `json:"unanswered_share"`
	// Repair is how long Store objects went short of live copies, as an
	// etcd watch outside the mesh saw it (repairWatch), through the faults
	// and the settle.
	Repair RepairFigures `json:"repair"`
	// FailureCodes counts failed jobs by error code.
	FailureCodes map[string]int `json:"failure_codes,omitempty"`
	Agents       int            `json:"agents"`
	Seed         int64          `json:"seed"`
	DurationS    float64        `json:"duration_s"` // load and faults
	SettleS      float64        `json:"settle_s"`   // from the end of faults to every job finished
	WallS        float64        `json:"wall_s"`     // the whole run, setup and checks included
	// Violations are the evidence for every non-zero invariant.
	Violations []string `json:"violations,omitempty"`
	// Dir holds the agents' logs when the run kept them.
	Dir string `json:"dir,omitempty"`
}

// OK reports whether every invariant held.
func (r *ChaosReport) OK() bool {
	return r.Lost == 0 && r.DuplicateCommits == 0 && r.LeakedPayloads == 0 && r.Corrupt == 0
}

// chaosAdminToken guards the chaos agents' admin endpoints.
const chaosAdminToken = "testbed-chaos-admin-token-0123456789"

// chaosSpecs are the load's requests: small images and a few small
// videos. Few distinct specs, so each reference output is computed once.
var chaosSpecs = []engine.Spec{
	{Prompt: "a red fox in the snow", Seed: 1, Width: 64, Height: 64, Steps: 4},
	{Prompt: "a lighthouse at dusk", Seed: 2, Width: 96, Height: 64, Steps: 5},
	{Prompt: "a bowl of oranges", Seed: 3, Width: 64, Height: 96, Steps: 4},
	{Prompt: "neon street in the rain", Seed: 4, Width: 128, Height: 96, Steps: 6},
	{Prompt: "a sailing boat", Seed: 5, Width: 64, Height: 64, Steps: 3},
	{Prompt: "mountains under stars", Seed: 6, Width: 96, Height: 96, Steps: 4},
	{Prompt: "waves on a beach", Seed: 7, Width: 64, Height: 64, Steps: 3, Frames: 4},
	{Prompt: "a flickering candle", Seed: 8, Width: 64, Height: 64, Steps: 3, Frames: 3},
}

// chaosModes are the transfer modes the load asks for ("" is the agents'
// default, auto), so both peer-to-peer and Store handoffs are hit.
var chaosModes = []string{"", "p2p", "store"}

// chaosRun is one run's state.
type chaosRun struct {
	cfg    ChaosConfig
	log    io.Writer
	start  time.Time
	prefix string
	net    *Net
	etcd   *EtcdCluster
	cli    *clientv3.Client
	agents []*HostAgent

	mu sync.Mutex
	// mu guards the fields below.
	accepted   map[string]int // job id -> index in chaosSpecs
	warm       string         // the warm-up job
	refused    int
	unanswered int
}

func (r *chaosRun) logf(format string, a ...any) {
	fmt.Fprintf(r.log, "chaos %6.1fs  "+format+"\n", append([]any{time.Since(r.start).Seconds()}, a...)...)
}

// RunChaos runs the chaos test and checks its invariants. An error means
// the run could not be made (no root, no etcd, a process that would not
// start); a violated invariant is in the report, not an error.
func RunChaos(ctx context.Context, cfg ChaosConfig) (rep *ChaosReport, err error) {
	if ok, why := NetAvailable(); !ok {
		return nil, fmt.Errorf("testbed: chaos needs hosts in network namespaces: %s", why)
	}
	if _, err := EtcdBinaryAvailable(); err != nil {
		return nil, err
	}
	switch {
	case cfg.Binary == "":
		return nil, errors.New("testbed: chaos: Binary is not set")
	case cfg.Agents < 3:
		return nil, fmt.Errorf("testbed: chaos: %d agents; want at least 3 (one per stage)", cfg.Agents)
	case cfg.Agents > 200:
		return nil, fmt.Errorf("testbed: chaos: %d agents; at most 200 hosts fit the test network", cfg.Agents)
	case cfg.Duration <= 0 || cfg.Rate <= 0 || cfg.FaultEvery <= 0 || cfg.Settle <= 0 || cfg.LeaseTTL <= 0 || cfg.StageTimeout <= 0:
		return nil, errors.New("testbed: chaos: Duration, Rate, FaultEvery, Settle, LeaseTTL and StageTimeout must be positive (start from DefaultChaosConfig)")
	}
	r := &chaosRun{cfg: cfg, log: cfg.Progress, start: time.Now(), prefix: agent.DefaultConfig().Prefix, accepted: map[string]int{}}
	if r.log == nil {
		r.log = io.Discard
	}
	dir, keep := cfg.Dir, cfg.Dir != ""
	if dir == "" {
		if dir, err = os.MkdirTemp("", "latentmesh-chaos-"); err != nil {
			return nil, fmt.Errorf("testbed: chaos dir: %w", err)
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("testbed: chaos dir: %w", err)
	}
	defer func() {
		if err != nil || (rep != nil && !rep.OK()) {
			keep = true
		}
		if rep != nil && keep {
			rep.Dir = dir
		}
		if !keep {
			os.RemoveAll(dir)
		} else {
			r.logf("agent logs kept in %s", dir)
		}
	}()
	defer r.close()
	if err := r.setUp(ctx, dir); err != nil {
		return nil, err
	}
	return r.run(ctx)
}

// setUp builds the network, the etcd cluster and the agents.
func (r *chaosRun) setUp(ctx context.Context, dir string) error {
	var err error
	if r.net, err = NewNet(); err != nil {
		return err
	}
	hosts := make([]*Host, r.cfg.Agents)
	for i := range hosts {
		if hosts[i], err = r.net.AddHost(fmt.Sprintf("chaos%d", i)); err != nil {
			return err
		}
	}
	ecfg := DefaultEtcdClusterConfig()
	ecfg.Dir, ecfg.IP = dir, r.net.RootIP()
	r.logf("starting a %d-member etcd on %s", ecfg.Members, ecfg.IP)
	if r.etcd, err = StartEtcdCluster(ctx, ecfg); err != nil {
		return err
	}
	if r.cli, err = NewEtcdClient(r.etcd.Endpoints(), nil); err != nil {
		return err
	}
	keyring := filepath.Join(dir, "gossip-keyring.json")
	key := make([]byte, 32)
	rand.Read(key)
	if err := os.WriteFile(keyring, fmt.Appendf(nil, "[%q]\n", base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		return err
	}
	stages := jobs.Stages()
	whole := r.cfg.Agents / 3 * 3
	for i, h := range hosts {
		roles := []string{string(stages[i%3])}
		if i >= whole {
			roles = []string{string(jobs.Encode), string(jobs.Denoise), string(jobs.Decode)}
		}
		id := fmt.Sprintf("agent-%d", i)
		out, err := os.OpenFile(filepath.Join(dir, id+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return err
		}
		a, err := NewHostAgent(HostAgentConfig{
			Binary: r.cfg.Binary, Host: h, NodeID: id, Roles: roles, Endpoints: r.etcd.Endpoints(),
			Prefix: r.prefix, Keyring: keyring, AdminToken: chaosAdminToken,
			Identity: filepath.Join(dir, id+".key"), StateDir: filepath.Join(dir, id+".state"),
			Extra: []string{"--lease-ttl", r.cfg.LeaseTTL.String(), "--arena-size", r.cfg.ArenaSize,
				"--store-stage-timeout", r.cfg.StageTimeout.String(), "--sim-cost", r.cfg.SimCost},
			Output: out,
		}, r.cli)
		if err != nil {
			out.Close()
			return err
		}
		r.agents = append(r.agents, a)
	}
	r.logf("starting %d agents", len(r.agents))
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	errs := make([]error, len(r.agents))
	var wg sync.WaitGroup
	for i, a := range r.agents {
		wg.Go(func() { errs[i] = a.Start(sctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// close stops the agents, etcd and the network.
func (r *chaosRun) close() {
	var wg sync.WaitGroup
	for _, a := range r.agents {
		wg.Go(func() { a.Stop(10 * time.Second) })
	}
	wg.Wait()
	if r.cli != nil {
		r.cli.Close()
	}
	if r.etcd != nil {
		r.etcd.Close()
	}
	if r.net != nil {
		if err := r.net.Close(); err != nil {
			r.logf("close network: %v", err)
		}
	}
}

func (r *chaosRun) run(ctx context.Context) (*ChaosReport, error) {
	// One job through the mesh before the faults: a mesh that cannot run
	// a job at all is a failed setup, not a chaos finding.
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	warm, _, err := r.client(r.agents[0]).Generate(wctx, r.request(0, ""), nil)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("testbed: chaos: warm-up job: %w", err)
	}
	r.mu.Lock()
	r.warm = warm.ID
	r.mu.Unlock()
	r.logf("warm-up job %s %s; load %.1f jobs/s and a fault every ~%v for %v",
		warm.ID, warm.State, r.cfg.Rate, r.cfg.FaultEvery, r.cfg.Duration)

	rep := &ChaosReport{Agents: r.cfg.Agents, Seed: r.cfg.Seed}
	loadStart := time.Now()
	fctx, stopFaults := context.WithTimeout(ctx, r.cfg.Duration)
	defer stopFaults()
	in := newInjector(r.agents, r.etcd, r.cfg.Seed, r.cfg.FaultEvery, r.log, r.start)
	repairs := newRepairWatch(r.cli, r.prefix)
	rctx, stopRepairs := context.WithCancel(ctx)
	var rwg sync.WaitGroup
	rwg.Go(func() { repairs.run(rctx) })
	defer rwg.Wait()
	defer stopRepairs()
	var wg sync.WaitGroup
	wg.Go(func() { in.run(fctx) })
	wg.Go(func() { r.load(fctx) })
	wg.Go(func() { r.progress(fctx) })
	wg.Wait() // the load's submissions are answered, every fault undone
	rep.DurationS = time.Since(loadStart).Seconds()
	rep.Faults, rep.FaultsInjected, err = in.result()
	if err != nil {
		return nil, fmt.Errorf("testbed: chaos: a fault could not be injected or undone: %w", err)
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	r.mu.Lock()
	rep.Accepted, rep.Refused, rep.Unanswered = len(r.accepted), r.refused, r.unanswered
	r.mu.Unlock()
	r.logf("faults stopped: %d injected; %d accepted, %d refused, %d unanswered; settling",
		rep.FaultsInjected, rep.Accepted, rep.Refused, rep.Unanswered)

	settleStart := time.Now()
	snap, err := r.settle(ctx)
	if err != nil {
		return nil, err
	}
	rep.SettleS = time.Since(settleStart).Seconds()
	stopRepairs()
	rwg.Wait()
	rep.Repair = repairs.figures()
	if n := rep.Accepted + rep.Refused + rep.Unanswered; n > 0 {
		rep.RefusedShare, rep.UnansweredShare = float64(rep.Refused)/float64(n), float64(rep.Unanswered)/float64(n)
	}
	if err := r.checkJobs(ctx, snap, rep); err != nil {
		return nil, err
	}
	if err := r.checkHistory(ctx, snap, rep); err != nil {
		return nil, err
	}
	if err := r.checkLeaks(ctx, rep); err != nil {
		return nil, err
	}
	rep.WallS = time.Since(r.start).Seconds()
	r.logf("done: accepted %d, completed %d, failed %d, lost %d, duplicate commits %d, leaked %d, corrupt %d, faults %d",
		rep.Accepted, rep.Completed, rep.Failed, rep.Lost, rep.DuplicateCommits, rep.LeakedPayloads, rep.Corrupt, rep.FaultsInjected)
	r.logf("repairs: %d measured, p50 %.2fs p99 %.2fs max %.2fs (results: %d, p99 %.2fs), %d short at the end; refused %.1f%%, unanswered %.1f%%",
		rep.Repair.Measured, rep.Repair.P50S, rep.Repair.P99S, rep.Repair.MaxS, rep.Repair.ResultsMeasured, rep.Repair.ResultsP99S,
		rep.Repair.ShortAtEnd, 100*rep.RefusedShare, 100*rep.UnansweredShare)
	return rep, nil
}

func (r *chaosRun) client(a *HostAgent) *httpapi.Client {
	return &httpapi.Client{BaseURL: "http://" + a.Record().HTTPAddr}
}

// request is the job request for chaosSpecs[i] in transfer mode mode.
func (r *chaosRun) request(i int, mode string) httpapi.JobRequest {
	s := chaosSpecs[i].WithDefaults()
	return httpapi.JobRequest{
		Prompt: s.Prompt, Seed: &s.Seed, Width: &s.Width, Height: &s.Height, Frames: &s.Frames,
		Steps: &s.Steps, GuidanceScale: &s.GuidanceScale, TransferMode: mode,
	}
}

// load submits jobs open loop at cfg.Rate until ctx is done, each to a
// random agent whose process is up (it may be paused or cut off: then the
// submission goes unanswered), and waits for the submissions in flight.
func (r *chaosRun) load(ctx context.Context) {
	rng := mrand.New(mrand.NewPCG(uint64(r.cfg.Seed), 0x6c6d6c6f6164)) // "lmload"
	every := time.Duration(float64(time.Second) / r.cfg.Rate)
	tick := time.NewTicker(every)
	defer tick.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var up []*HostAgent
		for _, a := range r.agents {
			if a.Running() {
				up = append(up, a)
			}
		}
		if len(up) == 0 {
			continue
		}
		a := up[rng.IntN(len(up))]
		spec := rng.IntN(len(chaosSpecs))
		mode := chaosModes[rng.IntN(len(chaosModes))]
		req, c := r.request(spec, mode), r.client(a)
		wg.Go(func() {
			// Not ctx: a submission made before the end is seen through.
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			job, err := c.Submit(sctx, req)
			r.mu.Lock()
			defer r.mu.Unlock()
			var apiErr *httpapi.APIError
			switch {
			case err == nil:
				r.accepted[job.ID] = spec
			case errors.As(err, &apiErr) && (apiErr.Status == 503 || apiErr.Status == 429):
				r.refused++
			default:
				r.unanswered++
			}
		})
	}
}

// progress prints a line every 10 s while load runs.
func (r *chaosRun) progress(ctx context.Context) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		a, ref, un := len(r.accepted), r.refused, r.unanswered
		r.mu.Unlock()
		r.logf("load: %d accepted, %d refused, %d unanswered", a, ref, un)
	}
}

// settle waits, once every fault is undone, until every agent is
// registered again and every job in etcd is finished, up to cfg.Settle.
// It returns the snapshot that showed it (or the last one, when the
// settle ran out: the unfinished jobs are then lost).
func (r *chaosRun) settle(ctx context.Context) (etcdSnapshot, error) {
	deadline := time.Now().Add(r.cfg.Settle)
	var last etcdSnapshot
	var lastErr error
	said := time.Time{}
	for {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		snap, err := readSnapshot(sctx, r.cli, r.prefix)
		unreg := 0
		if err == nil {
			last = snap
			unreg, err = r.unregistered(sctx)
		}
		cancel()
		if err != nil {
			lastErr = err
		} else {
			lastErr = nil
			open := 0
			for _, j := range snap.Jobs {
				if !j.State.Terminal() {
					open++
				}
			}
			if open == 0 && unreg == 0 {
				return snap, nil
			}
			if time.Since(said) > 5*time.Second {
				r.logf("settling: %d jobs unfinished, %d agents not registered", open, unreg)
				said = time.Now()
			}
		}
		if time.Now().After(deadline) {
			if last.Jobs == nil {
				return last, fmt.Errorf("testbed: chaos: cannot read etcd after the faults: %w", lastErr)
			}
			r.logf("settle ran out after %v", r.cfg.Settle)
			return last, nil
		}
		select {
		case <-ctx.Done():
			return last, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// unregistered counts agents with no registration in etcd.
func (r *chaosRun) unregistered(ctx context.Context) (int, error) {
	resp, err := r.cli.Get(ctx, r.prefix+"/nodes/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, err
	}
	have := map[string]bool{}
	for _, kv := range resp.Kvs {
		have[strings.TrimPrefix(string(kv.Key), r.prefix+"/nodes/")] = true
	}
	n := 0
	for _, a := range r.agents {
		if !have[a.ID()] {
			n++
		}
	}
	return n, nil
}

// checkJobs sorts the accepted jobs into completed, failed and lost, and
// reads every succeeded job's result back through the agents, comparing
// it with the engine run in one process.
func (r *chaosRun) checkJobs(ctx context.Context, snap etcdSnapshot, rep *ChaosReport) error {
	r.mu.Lock()
	warm := r.warm
	accepted := make(map[string]int, len(r.accepted))
	for id, s := range r.accepted {
		accepted[id] = s
	}
	r.mu.Unlock()
	for id := range snap.Jobs {
		if _, ok := accepted[id]; !ok && id != warm {
			rep.Unacknowledged++
		}
	}
	eng, err := engine.New(engine.DefaultConfig())
	if err != nil {
		return err
	}
	refs := map[int][]byte{}
	ids := make([]string, 0, len(accepted))
	for id := range accepted {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	r.logf("reading %d results back", len(ids))
	for _, id := range ids {
		j, ok := snap.Jobs[id]
		switch {
		case !ok:
			rep.Lost++
			rep.Violations = append(rep.Violations, fmt.Sprintf("lost: accepted job %s has no record in etcd", id))
			continue
		case j.State == jobs.Failed && j.Error != nil && j.Error.Code != "":
			rep.Failed++
			if rep.FailureCodes == nil {
				rep.FailureCodes = map[string]int{}
			}
			rep.FailureCodes[j.Error.Code]++
			continue
		case j.State != jobs.Succeeded:
			rep.Lost++
			rep.Violations = append(rep.Violations, fmt.Sprintf("lost: accepted job %s is %s at stage %q (error %+v)", id, j.State, j.Stage, j.Error))
			continue
		}
		spec := accepted[id]
		want, ok := refs[spec]
		if !ok {
			if want, _, err = eng.Generate(ctx, chaosSpecs[spec].WithDefaults()); err != nil {
				return fmt.Errorf("testbed: chaos: reference output: %w", err)
			}
			refs[spec] = want
		}
		got, err := r.readResult(ctx, id)
		switch {
		case err != nil:
			rep.Lost++
			rep.Violations = append(rep.Violations, fmt.Sprintf("lost: job %s succeeded but its result cannot be read: %v", id, err))
		case !bytes.Equal(got, want):
			rep.Corrupt++
			sum := sha256.Sum256(got)
			rep.Violations = append(rep.Violations, fmt.Sprintf("corrupt: job %s result (%d bytes, sha256 %s, record says %s) differs from the engine's (%d bytes)",
				id, len(got), hex.EncodeToString(sum[:]), j.Result.SHA256, len(want)))
		default:
			rep.Completed++
		}
	}
	return nil
}

// readResult reads a job's result through each agent in turn until one
// answers.
func (r *chaosRun) readResult(ctx context.Context, id string) ([]byte, error) {
	var errs []error
	for _, a := range r.agents {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		data, _, err := r.client(a).Result(rctx, id)
		cancel()
		if err == nil {
			return data, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", a.ID(), err))
	}
	return nil, errors.Join(errs...)
}

// checkHistory counts duplicate commits in every job's history (see
// duplicateCommits), and result records written by anything but the
// commit that finished their job.
func (r *chaosRun) checkHistory(ctx context.Context, snap etcdSnapshot, rep *ChaosReport) error {
	r.logf("reading the history of %d jobs", len(snap.Jobs))
	for id, j := range snap.Jobs {
		h, err := jobHistory(ctx, r.cli, r.prefix+"/jobs/"+id)
		if err != nil {
			return fmt.Errorf("testbed: chaos: %w", err)
		}
		dups := duplicateCommits(h)
		if j.State == jobs.Succeeded && j.Result != nil {
			done := succeededAt(h)
			if created, ok := snap.ObjectCreated[j.Result.Object]; ok && created != done {
				dups = append(dups, fmt.Sprintf("job %s: result record %s created at revision %d, the job succeeded at %d",
					id, j.Result.Object, created, done))
			}
		}
		rep.DuplicateCommits += len(dups)
		for _, d := range dups {
			rep.Violations = append(rep.Violations, "duplicate commit: "+d)
		}
	}
	return nil
}

// checkLeaks waits, up to cfg.Settle, until no record belongs to a
// finished job but its result and no agent holds more than records name
// (the collector, a holder's reconciliation and a killed putter's staged
// copies each take up to a period to clear), then counts what is left.
func (r *chaosRun) checkLeaks(ctx context.Context, rep *ChaosReport) error {
	deadline := time.Now().Add(r.cfg.Settle)
	said := time.Time{}
	for {
		n, evidence, err := r.leaks(ctx)
		if err == nil && n == 0 {
			r.logf("no leaks: %s", evidence[0])
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("testbed: chaos: leak check: %w", err)
			}
			rep.LeakedPayloads = n
			for _, e := range evidence {
				rep.Violations = append(rep.Violations, "leaked: "+e)
			}
			return nil
		}
		if time.Since(said) > 5*time.Second {
			if err != nil {
				r.logf("leak check: %v", err)
			} else {
				r.logf("leak check: %d left (%s)", n, evidence[0])
			}
			said = time.Now()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// leaks takes one look: records and agents' holdings.
func (r *chaosRun) leaks(ctx context.Context) (int, []string, error) {
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// Records first, then holdings: nothing is created once every job is
	// finished, so a copy freed in between shows as one fewer held, never
	// as a leak.
	snap, err := readSnapshot(lctx, r.cli, r.prefix)
	if err != nil {
		return 0, nil, err
	}
	var hs []holdings
	for _, a := range r.agents {
		st, err := a.Status(lctx)
		if err != nil {
			return 0, nil, fmt.Errorf("%s: %w", a.ID(), err)
		}
		hs = append(hs, holdings{Node: a.ID(), Payloads: st.Data.HeldPayloads, Copies: st.Store.Copies, Staged: st.Store.Staged,
			CacheUsed: st.Store.CacheUsed, CacheCapacity: st.Store.CacheCapacity})
	}
	recs := leakedRecords(snap)
	n, held := leakedHoldings(snap, hs)
	if len(recs)+n == 0 {
		// Say what was compared, for the log.
		p, c := 0, 0
		for _, h := range hs {
			p, c = p+h.Payloads, c+h.Copies
		}
		return 0, []string{fmt.Sprintf("%d payload and %d object records; agents hold %d payloads, %d of them Store copies",
			len(snap.Payloads), len(snap.Objects), p, c)}, nil
	}
	return len(recs) + n, append(recs, held...), nil
}
