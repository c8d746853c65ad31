package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// APIBenchConfig configures RunAPIBench: tiny jobs through the client HTTP
// API, to measure what the control plane adds to the stages' own time.
type APIBenchConfig struct {
	// Server is the client API to load ("http://host:port"); "" starts an
	// in-process mesh as `latentmesh-dev dev` does (embedded etcd, one agent
	// per stage) and loads its first agent.
	Server  string
	Clients int // concurrent clients, each submitting then long-polling one job at a time
	Jobs    int // jobs in all
	// Width, Height and Steps make the job: tiny, so that the stages' time
	// is small next to the control plane's.
	Width, Height, Steps int
	// DenoiseSlots, when positive, replaces the in-process denoise agent's
	// slots (one by default: one job owns the GPU). More slots show what
	// the control plane sustains when the one-slot denoise chain, a
	// claim, pull, run and commit in series, is not the limit.
	DenoiseSlots int
	// Slack, when not negative, replaces the agents' backpressure slack
	// (agent.Config.Admission.Slack: outputs that may wait for the next
	// stage beyond its credits). Tiny jobs spend about as long in etcd
	// writes as on the stages, so a stage's next input needs more than
	// one in flight to be ready when its slot frees.
	Slack int
	// EtcdGRPC has the in-process mesh's agents reach its embedded etcd
	// over loopback gRPC, as agents on other machines reach theirs,
	// instead of by function calls (`latentmesh-dev dev`'s default).
	EtcdGRPC bool
	// EtcdFsync keeps the embedded etcd's fsync of its (temporary) log,
	// as an etcd whose data must survive a crash does
	// (etcdembed.Config.Fsync).
	EtcdFsync bool
	// NoPush turns pushed claims off (routing.QueuePolicy.Push): every
	// worker claims its own tasks, a baseline.
	NoPush bool
	// NoOffers turns offered claims off (routing.QueuePolicy.Offer): a
	// pushed task starts once its write's event arrives, a baseline.
	NoOffers bool
	// EtcdWriteDelay, in-process mesh: every etcd write the agents send
	// waits this long first (DelayEtcdWrites), as on a loaded etcd.
	EtcdWriteDelay time.Duration
	Logger         *zap.Logger
}

// DefaultAPIBenchConfig is one client, 200 jobs of 64x64 in two steps.
func DefaultAPIBenchConfig() APIBenchConfig {
	return APIBenchConfig{Clients: 1, Jobs: 200, Width: 64, Height: 64, Steps: 2, Slack: -1, Logger: zap.NewNop()}
}

// APIBenchReport is what RunAPIBench measured. Durations are medians (P50)
// and 90th percentiles over the jobs, in milliseconds.
type APIBenchReport struct {
	Clients    int     `json:"clients"`
	Jobs       int     `json:"jobs"`
	Seconds    float64 `json:"seconds"`
	JobsPerSec float64 `json:"jobs_per_s"`
	// Latency is POST to the long poll's answer, as the client sees it.
	Latency Quantiles `json:"latency_ms"`
	// Stages is the stage timeline: the sum of the stages' work (pull and
	// run) as the job record has it.
	Stages Quantiles `json:"stages_ms"`
	// Overhead is Latency minus Stages: what the control plane adds.
	Overhead Quantiles `json:"overhead_ms"`
	// Breakdown splits a job's latency (P50 of each part, summed over stages):
	// submit (POST round trip), queue (the previous stage's commit, or the
	// submit, to the claim being sent: commit transaction, watch
	// notification, admission, scan), claim (the claim transaction), pull,
	// run (work less pull), commit (work done to the commit's record
	// written: the read of the job record), notify (the last commit to the
	// client's answer: commit transaction, watch, HTTP).
	Breakdown map[string]Quantiles `json:"breakdown_ms"`
	// Etcd is what a job cost etcd, per job, counted on the in-process
	// mesh's client (nil with Server set): every agent's requests, the
	// client API's included, during the measured jobs.
	Etcd *APIBenchEtcd `json:"etcd_per_job,omitempty"`
}

// APIBenchEtcd is what one job cost etcd, on average.
type APIBenchEtcd struct {
	Requests float64 `json:"requests"` // txns + reads + writes + watches
	Txns     float64 `json:"txns"`
	Reads    float64 `json:"reads"`
	Writes   float64 `json:"writes"` // plain puts and deletes
	Watches  float64 `json:"watches"`
	KeysRead float64 `json:"keys_read"`
	// RaftProposals is what the embedded etcd committed through raft
	// (its committed index's rise, etcdembed.Server.RaftIndex): its
	// writes, lease grants and revocations.
	RaftProposals float64 `json:"raft_proposals"`
}

// committed is srv's committed raft index (0 for none): its rise over a
// run counts the run's raft proposals.
func committed(srv *etcdembed.Server) float64 {
	if srv == nil {
		return 0
	}
	c, _ := srv.RaftIndex()
	return float64(c)
}

// Quantiles are a P50 and a P90 in milliseconds.
type Quantiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
}

func quantiles(xs []float64) Quantiles {
	if len(xs) == 0 {
		return Quantiles{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	at := func(q float64) float64 { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return Quantiles{P50: at(0.5), P90: at(0.9)}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// RunAPIBench runs cfg.Jobs jobs through the API from cfg.Clients clients.
func RunAPIBench(ctx context.Context, cfg APIBenchConfig) (APIBenchReport, error) {
	if cfg.Clients <= 0 || cfg.Jobs <= 0 {
		return APIBenchReport{}, errors.New("testbed: api bench needs clients and jobs")
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	server := cfg.Server
	var (
		ops  *EtcdOps          // the in-process mesh's etcd requests
		etcd *etcdembed.Server // and its etcd, whose raft entries are counted
	)
	if server == "" {
		cc := DefaultClusterConfig()
		cc.Logger = cfg.Logger
		cc.Topology = "" // agents added below, once their client is counted
		cc.EtcdInProcess = !cfg.EtcdGRPC
		cc.Etcd.Fsync = cfg.EtcdFsync
		cc.Agent.Queue.Push = !cfg.NoPush
		cc.Agent.Queue.Offer = !cfg.NoOffers
		if cfg.Slack >= 0 {
			cc.Agent.Admission.Slack = cfg.Slack
		}
		if cfg.DenoiseSlots > 0 {
			cc.Agent.Slots = maps.Clone(cc.Agent.Slots)
			cc.Agent.Slots[jobs.Denoise] = cfg.DenoiseSlots
		}
		cl, err := StartCluster(ctx, cc)
		if err != nil {
			return APIBenchReport{}, err
		}
		defer cl.Close()
		DelayEtcdWrites(cl.Client, cfg.EtcdWriteDelay)
		ops, etcd = CountEtcdOps(cl.Client), cl.Etcd
		for _, st := range jobs.Stages() {
			if _, err := cl.AddAgent(ctx, string(st)+"-1", st); err != nil {
				return APIBenchReport{}, err
			}
		}
		server = "http://" + cl.Agents[0].HTTPAddr()
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Clients + 1}}
	defer hc.CloseIdleConnections()
	cli := &httpapi.Client{BaseURL: server, HTTP: hc}
	req := func() httpapi.JobRequest {
		w, h, st := cfg.Width, cfg.Height, cfg.Steps
		return httpapi.JobRequest{Prompt: "api bench", Width: &w, Height: &h, Steps: &st, Priority: "interactive"}
	}
	// Warm up: connections, the agents' first job.
	if _, err := benchJob(ctx, cli, req()); err != nil {
		return APIBenchReport{}, fmt.Errorf("testbed: api bench warm-up: %w", err)
	}

	var (
		mu      sync.Mutex
		samples []benchSample
		left    atomic.Int64
		errs    = make(chan error, cfg.Clients)
		wg      sync.WaitGroup
	)
	left.Store(int64(cfg.Jobs))
	var before EtcdOpCounts
	if ops != nil {
		before = ops.Snap()
	}
	proposals := committed(etcd)
	start := time.Now()
	for range cfg.Clients {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				s, err := benchJob(ctx, cli, req())
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				samples = append(samples, s)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	proposals = committed(etcd) - proposals
	close(errs)
	if err := <-errs; err != nil {
		return APIBenchReport{}, err
	}
	rep := APIBenchReport{Clients: cfg.Clients, Jobs: len(samples), Seconds: elapsed.Seconds(),
		JobsPerSec: float64(len(samples)) / elapsed.Seconds(), Breakdown: map[string]Quantiles{}}
	parts := map[string][]float64{}
	var lat, stages, over []float64
	for _, s := range samples {
		lat = append(lat, s.latency)
		stages = append(stages, s.stages)
		over = append(over, s.latency-s.stages)
		for k, v := range s.parts {
			parts[k] = append(parts[k], v)
		}
	}
	rep.Latency, rep.Stages, rep.Overhead = quantiles(lat), quantiles(stages), quantiles(over)
	if ops != nil {
		d, n := ops.Snap().Minus(before), float64(len(samples))
		rep.Etcd = &APIBenchEtcd{
			Requests: float64(d.Requests()) / n, Txns: float64(d.Txns) / n, Reads: float64(d.Reads) / n,
			Writes: float64(d.Writes) / n, Watches: float64(d.Watches) / n, KeysRead: float64(d.KeysRead) / n,
			RaftProposals: proposals / n,
		}
	}
	for k, v := range parts {
		rep.Breakdown[k] = quantiles(v)
	}
	return rep, nil
}

type benchSample struct {
	latency, stages float64
	parts           map[string]float64
}

// benchJob submits one job and long-polls it to the end.
func benchJob(ctx context.Context, cli *httpapi.Client, req httpapi.JobRequest) (benchSample, error) {
	t0 := time.Now()
	j, err := cli.Submit(ctx, req)
	if err != nil {
		return benchSample{}, err
	}
	t1 := time.Now()
	for !j.State.Terminal() {
		if j, err = cli.Wait(ctx, j.ID, 30*time.Second); err != nil {
			return benchSample{}, err
		}
	}
	t2 := time.Now()
	if j.State != jobs.Succeeded {
		return benchSample{}, fmt.Errorf("testbed: api bench job %s %s: %+v", j.ID, j.State, j.Error)
	}
	s := benchSample{latency: ms(t2.Sub(t0)), parts: map[string]float64{"submit": ms(t1.Sub(t0))}}
	prev := j.CreatedAt
	for _, st := range jobs.Stages() {
		r := j.Stages[st]
		if r == nil {
			return benchSample{}, fmt.Errorf("testbed: api bench job %s has no %s record", j.ID, st)
		}
		s.stages += r.Millis
		s.parts["queue"] += ms(r.StartedAt.Sub(prev))
		s.parts["queue "+string(st)] = ms(r.StartedAt.Sub(prev))
		s.parts["claim"] += r.ClaimMillis
		s.parts["pull"] += r.PullMillis
		s.parts["run"] += r.Millis - r.PullMillis
		s.parts["commit"] += ms(r.FinishedAt.Sub(r.StartedAt)) - r.ClaimMillis - r.Millis
		s.parts["stage "+string(st)] = ms(r.FinishedAt.Sub(r.StartedAt))
		s.parts["pull "+string(st)] = r.PullMillis
		s.parts["run "+string(st)] = r.Millis - r.PullMillis
		prev = r.FinishedAt
	}
	s.parts["notify"] = ms(t2.Sub(prev))
	return s, nil
}

// WriteTable prints rep for people.
func (rep APIBenchReport) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "%d jobs, %d clients: %.1f jobs/s\n", rep.Jobs, rep.Clients, rep.JobsPerSec)
	fmt.Fprintf(w, "%-10s %8s %8s\n", "ms", "P50", "P90")
	row := func(name string, q Quantiles) { fmt.Fprintf(w, "%-10s %8.2f %8.2f\n", name, q.P50, q.P90) }
	row("latency", rep.Latency)
	row("stages", rep.Stages)
	row("overhead", rep.Overhead)
	for _, st := range jobs.Stages() {
		row(" claimed "+string(st), rep.Breakdown["stage "+string(st)])
	}
	for _, k := range []string{"submit", "queue", "claim", "pull", "run", "commit", "notify"} {
		row(" "+k, rep.Breakdown[k])
		if k == "queue" || k == "pull" || k == "run" {
			for _, st := range jobs.Stages() {
				row("  "+string(st), rep.Breakdown[k+" "+string(st)])
			}
		}
	}
	if e := rep.Etcd; e != nil {
		fmt.Fprintf(w, "etcd per job: %.1f requests (%.1f txns, %.1f reads, %.1f writes, %.1f watches opened), %.1f keys read, %.1f raft proposals\n",
			e.Requests, e.Txns, e.Reads, e.Writes, e.Watches, e.KeysRead, e.RaftProposals)
	}
	return nil
}
