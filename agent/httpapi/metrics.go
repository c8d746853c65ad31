package httpapi

import (
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// Metrics are the agent's Prometheus series (docs/metrics.md lists them).
// The agent calls the methods; Handler serves them. All methods are safe
// for concurrent use. Every series is this agent's own share, so a sum over
// agents is the mesh's figure.
type Metrics struct {
	reg           *prometheus.Registry
	jobsSubmitted *prometheus.CounterVec
	jobsFinished  *prometheus.CounterVec
	stageSeconds  *prometheus.HistogramVec
	queueWait     *prometheus.HistogramVec
	jobSeconds    *prometheus.HistogramVec
	firstFrame    *prometheus.HistogramVec
	queueDepth    *prometheus.GaugeVec
	freeCredits   *prometheus.GaugeVec
	usedCredits   *prometheus.GaugeVec
	httpRequests  *prometheus.CounterVec
	jobsRefused   prometheus.Counter
	preempted     prometheus.Counter
	pushedClaims  *prometheus.CounterVec
	offeredClaims *prometheus.CounterVec
	claimTxns     *prometheus.CounterVec
	conflicts     *prometheus.CounterVec
	requeues      *prometheus.CounterVec
	rewinds       *prometheus.CounterVec
	refused       *prometheus.CounterVec
	etcdSeconds   *prometheus.HistogramVec
	etcdErrors    *prometheus.CounterVec
	engineBeat    atomic.Int64 // unix ns of the external engine's last frame; 0: none
	ckpt          checkpointMetrics
	cond          condMetrics
}

// Requeue and rewind reasons, commit refusals: the values of the reason
// labels (a fixed set, so the series stay few).
const (
	ReasonPreempted    = "preempted"     // given back for waiting interactive work
	ReasonDrained      = "drained"       // given back by a draining agent
	ReasonRetry        = "retry"         // a transient failure, retried after a backoff
	ReasonPayloadGone  = "payload_gone"  // the producer no longer has the input
	ReasonProducerLeft = "producer_left" // the input's producer left the mesh
	ReasonInvalidInput = "invalid_input" // the input's description could not be used
	ReasonFenced       = "fenced"        // the claim's lease expired: another agent may hold it
	ReasonFinished     = "finished"      // the job was cancelled or ended meanwhile
)

// NewMetrics registers the series on reg (a fresh registry when nil), with
// the Go runtime, process and build-info collectors.
func NewMetrics(reg *prometheus.Registry) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	// Latencies from a millisecond (a queued task taken at once) to about
	// 17 minutes (a batch job behind a long queue).
	latency := prometheus.ExponentialBuckets(0.001, 4, 11)
	m := &Metrics{
		reg: reg,
		jobsSubmitted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_jobs_submitted_total",
			Help: "Jobs accepted by this agent's API, by priority class.",
		}, []string{"class"}),
		jobsFinished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_jobs_finished_total",
			Help: "Jobs that reached a terminal state on this agent (it ran their last stage, or failed them), by state.",
		}, []string{"state"}),
		stageSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "latentmesh_stage_duration_seconds",
			Help: "Time to run one pipeline stage on this agent (input pull included, commit excluded), by stage and class.",
			// 10ms (a cached encode) to about 4 minutes (a long CPU denoise).
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 12),
		}, []string{"stage", "class"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "latentmesh_queue_wait_seconds",
			Help:    "Time from a task's enqueue (or requeue) to this agent starting it, by stage and class.",
			Buckets: latency,
		}, []string{"stage", "class"}),
		jobSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "latentmesh_job_duration_seconds",
			Help:    "End-to-end latency of succeeded jobs, submission to the result committed, observed by the agent that ran the decode, by class.",
			Buckets: latency,
		}, []string{"class"}),
		firstFrame: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "latentmesh_time_to_first_frame_seconds",
			Help:    "Submission to the first output a client can read (a video's first preview frame, an image's result), for succeeded jobs, by class.",
			Buckets: latency,
		}, []string{"class"}),
		queueDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "latentmesh_queue_depth",
			Help: "Tasks waiting for a worker that this agent dispatches (its ledger), by stage and class; every task has one dispatcher, so sum() over agents is the mesh's depth.",
		}, []string{"stage", "class"}),
		freeCredits: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "latentmesh_free_credits",
			Help: "Credits this agent can still grant, by stage.",
		}, []string{"stage"}),
		usedCredits: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "latentmesh_credits_in_use",
			Help: "Credits held by tasks running on this agent, by stage.",
		}, []string{"stage"}),
		httpRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_http_requests_total",
			Help: "Client API requests, by route pattern and status code.",
		}, []string{"route", "code"}),
		jobsRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "latentmesh_jobs_refused_total",
			Help: "Submissions refused with 503 because the mesh could not take them (Store full, etcd NOSPACE).",
		}),
		preempted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "latentmesh_tasks_preempted_total",
			Help: "Batch tasks this agent requeued for waiting interactive work.",
		}),
		pushedClaims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_pushed_claims_total",
			Help: "Claims pushed to this agent with their task, by stage and outcome: started, or given back to the queue.",
		}, []string{"stage", "outcome"}),
		offeredClaims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_offered_claims_total",
			Help: "Pushed claims this agent started from their writer's offer, before the write answered, by stage and outcome: started, or withdrawn (no write confirmed it; the work was dropped).",
		}, []string{"stage", "outcome"}),
		claimTxns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_claim_txns_total",
			Help: "Hand-ons this agent sent as the dispatcher of waiting tasks (a claim for a worker with a slot, in one transaction), won or lost, by stage; a task pushed as it is created takes none.",
		}, []string{"stage"}),
		conflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_claim_conflicts_total",
			Help: "Hand-ons etcd refused because the task changed first (claimed, adopted or gone) or its last holder's claim was still there, by stage.",
		}, []string{"stage"}),
		requeues: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_task_requeues_total",
			Help: "Tasks this agent gave back to their queue, by stage and reason (preempted, drained, retry).",
		}, []string{"stage", "reason"}),
		rewinds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_job_rewinds_total",
			Help: "Jobs this agent restarted from encode because an input was lost, by stage and reason (payload_gone, producer_left, invalid_input).",
		}, []string{"stage", "reason"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_commits_rejected_total",
			Help: "Stage commits etcd refused, output discarded, by stage and reason (fenced: the claim was lost; finished: the job ended meanwhile).",
		}, []string{"stage", "reason"}),
		etcdSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "latentmesh_etcd_request_duration_seconds",
			Help: "Latency of this agent's unary etcd requests (failed ones included), by operation.",
			// 250us (an in-process get) to about 8 s (past the 5 s request deadline).
			Buckets: prometheus.ExponentialBuckets(0.00025, 2, 16),
		}, []string{"op"}),
		etcdErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_etcd_request_errors_total",
			Help: "This agent's etcd requests that failed, by operation and gRPC code (Unavailable, DeadlineExceeded, ResourceExhausted, ...).",
		}, []string{"op", "code"}),
	}
	for _, c := range []prometheus.Collector{
		m.jobsSubmitted, m.jobsFinished, m.stageSeconds, m.queueWait, m.jobSeconds, m.firstFrame,
		m.queueDepth, m.freeCredits, m.usedCredits, m.httpRequests, m.jobsRefused, m.preempted,
		m.pushedClaims, m.offeredClaims, m.claimTxns, m.conflicts, m.requeues, m.rewinds, m.refused, m.etcdSeconds, m.etcdErrors,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewBuildInfoCollector(),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	if err := m.initCondCache(); err != nil {
		return nil, err
	}
	if err := m.initCheckpoints(); err != nil {
		return nil, err
	}
	return m, nil
}

// InitStage starts the counters of a stage this agent serves at zero, so
// that rate() and increase() see their first event (Prometheus loses the
// first increment of a series that appears with it).
func (m *Metrics) InitStage(s jobs.Stage) {
	m.claimTxns.WithLabelValues(string(s))
	m.conflicts.WithLabelValues(string(s))
	for _, o := range []string{outcomeStarted, outcomeGivenBack, outcomeHandedOver} {
		m.pushedClaims.WithLabelValues(string(s), o)
	}
	for _, o := range []string{outcomeStarted, outcomeWithdrawn} {
		m.offeredClaims.WithLabelValues(string(s), o)
	}
	for _, r := range []string{ReasonPreempted, ReasonDrained, ReasonRetry} {
		m.requeues.WithLabelValues(string(s), r)
	}
	for _, r := range []string{ReasonPayloadGone, ReasonProducerLeft, ReasonInvalidInput} {
		m.rewinds.WithLabelValues(string(s), r)
	}
	for _, r := range []string{ReasonFenced, ReasonFinished} {
		m.refused.WithLabelValues(string(s), r)
	}
}

// JobSubmitted counts one accepted job.
func (m *Metrics) JobSubmitted(c routing.Class) { m.jobsSubmitted.WithLabelValues(c.String()).Inc() }

// JobRefused counts one submission refused for lack of room.
func (m *Metrics) JobRefused() { m.jobsRefused.Inc() }

// Preempted counts one task requeued for more urgent work.
func (m *Metrics) Preempted() { m.preempted.Inc() }

// PushedClaim counts one claim pushed to this agent that it started
// (given false) or gave back to the queue (given true).
func (m *Metrics) PushedClaim(s jobs.Stage, given bool) {
	outcome := outcomeStarted
	if given {
		outcome = outcomeGivenBack
	}
	m.pushedClaims.WithLabelValues(string(s), outcome).Inc()
}

// Offered counts one pushed claim this agent started from its offer
// (withdrawn false), or whose offer it started was withdrawn (true).
func (m *Metrics) Offered(s jobs.Stage, withdrawn bool) {
	outcome := outcomeStarted
	if withdrawn {
		outcome = outcomeWithdrawn
	}
	m.offeredClaims.WithLabelValues(string(s), outcome).Inc()
}

// HandedOver counts one claim pushed to this agent that it handed over to
// another worker of the stage (jobs.Store.HandOver).
func (m *Metrics) HandedOver(s jobs.Stage) {
	m.pushedClaims.WithLabelValues(string(s), outcomeHandedOver).Inc()
}

// The outcome label of latentmesh_pushed_claims_total.
const (
	outcomeStarted    = "started"
	outcomeGivenBack  = "given_back"
	outcomeHandedOver = "handed_over"
	outcomeWithdrawn  = "withdrawn" // of latentmesh_offered_claims_total
)

// JobFinished counts one job reaching state s.
func (m *Metrics) JobFinished(s jobs.State) { m.jobsFinished.WithLabelValues(string(s)).Inc() }

// ObserveStage records how long one run of a stage took.
func (m *Metrics) ObserveStage(s jobs.Stage, c routing.Class, d time.Duration) {
	m.stageSeconds.WithLabelValues(string(s), c.String()).Observe(d.Seconds())
}

// ObserveQueueWait records how long a task waited before this agent
// started it.
func (m *Metrics) ObserveQueueWait(s jobs.Stage, c routing.Class, d time.Duration) {
	m.queueWait.WithLabelValues(string(s), c.String()).Observe(max(d, 0).Seconds())
}

// ObserveJob records a succeeded job's end-to-end latency and its time to
// first frame (both from submission).
func (m *Metrics) ObserveJob(c routing.Class, latency, firstFrame time.Duration) {
	m.jobSeconds.WithLabelValues(c.String()).Observe(max(latency, 0).Seconds())
	m.firstFrame.WithLabelValues(c.String()).Observe(max(firstFrame, 0).Seconds())
}

// ClaimTxn counts one hand-on transaction sent, as its dispatcher, for a
// waiting task of stage s, whatever its answer.
func (m *Metrics) ClaimTxn(s jobs.Stage) { m.claimTxns.WithLabelValues(string(s)).Inc() }

// ClaimConflict counts one hand-on etcd refused (the task changed first).
func (m *Metrics) ClaimConflict(s jobs.Stage) { m.conflicts.WithLabelValues(string(s)).Inc() }

// ClaimCounts are the counters of how one agent's tasks of a stage were
// claimed: the values of its latentmesh_claim_txns_total,
// latentmesh_claim_conflicts_total and latentmesh_pushed_claims_total
// series, for a caller in the same process that has no scraper (a bench
// reads them before and after its window, and sums them over agents).
type ClaimCounts struct {
	Txns          int64 `json:"txns"`           // hand-ons sent as a dispatcher, won or lost
	Conflicts     int64 `json:"conflicts"`      // of those, refused: the task changed first
	PushedStarted int64 `json:"pushed_started"` // pushed claims started (with the task, or handed on)
	GivenBack     int64 `json:"given_back"`     // pushed claims given back to the queue
	HandedOver    int64 `json:"handed_over"`    // pushed claims handed over to another worker
	Offered       int64 `json:"offered"`        // pushed claims started from their offer, before the write answered
	Withdrawn     int64 `json:"withdrawn"`      // of those, withdrawn: no write confirmed them
}

// Add is c plus d, field by field.
func (c ClaimCounts) Add(d ClaimCounts) ClaimCounts {
	return ClaimCounts{c.Txns + d.Txns, c.Conflicts + d.Conflicts, c.PushedStarted + d.PushedStarted, c.GivenBack + d.GivenBack, c.HandedOver + d.HandedOver,
		c.Offered + d.Offered, c.Withdrawn + d.Withdrawn}
}

// Sub is c less d, field by field: what was counted since d was read.
func (c ClaimCounts) Sub(d ClaimCounts) ClaimCounts {
	return ClaimCounts{c.Txns - d.Txns, c.Conflicts - d.Conflicts, c.PushedStarted - d.PushedStarted, c.GivenBack - d.GivenBack, c.HandedOver - d.HandedOver,
		c.Offered - d.Offered, c.Withdrawn - d.Withdrawn}
}

// Claims reads stage s's claim counters.
func (m *Metrics) Claims(s jobs.Stage) ClaimCounts {
	st := string(s)
	return ClaimCounts{
		Txns:          counterValue(m.claimTxns.WithLabelValues(st)),
		Conflicts:     counterValue(m.conflicts.WithLabelValues(st)),
		PushedStarted: counterValue(m.pushedClaims.WithLabelValues(st, outcomeStarted)),
		GivenBack:     counterValue(m.pushedClaims.WithLabelValues(st, outcomeGivenBack)),
		HandedOver:    counterValue(m.pushedClaims.WithLabelValues(st, outcomeHandedOver)),
		Offered:       counterValue(m.offeredClaims.WithLabelValues(st, outcomeStarted)),
		Withdrawn:     counterValue(m.offeredClaims.WithLabelValues(st, outcomeWithdrawn)),
	}
}

// counterValue is c's count; the counters read here only ever Inc.
func counterValue(c prometheus.Counter) int64 {
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		return 0 // a plain counter's Write does not fail
	}
	return int64(d.GetCounter().GetValue())
}

// Requeued counts one task given back to its queue for reason (one of
// ReasonPreempted, ReasonDrained, ReasonRetry).
func (m *Metrics) Requeued(s jobs.Stage, reason string) {
	m.requeues.WithLabelValues(string(s), reason).Inc()
}

// Rewound counts one job restarted from encode for reason
// (ReasonPayloadGone, ReasonProducerLeft).
func (m *Metrics) Rewound(s jobs.Stage, reason string) {
	m.rewinds.WithLabelValues(string(s), reason).Inc()
}

// CommitRejected counts one commit etcd refused for reason (ReasonFenced,
// ReasonFinished).
func (m *Metrics) CommitRejected(s jobs.Stage, reason string) {
	m.refused.WithLabelValues(string(s), reason).Inc()
}

// ObserveEtcd records one unary etcd request: op names it ("get", "txn",
// "lease_grant", ...), code is "" on success, else the failure's gRPC code.
func (m *Metrics) ObserveEtcd(op string, d time.Duration, code string) {
	m.etcdSeconds.WithLabelValues(op).Observe(d.Seconds())
	if code != "" {
		m.etcdErrors.WithLabelValues(op, code).Inc()
	}
}

// SetQueueDepth sets the tasks of stage s waiting in this agent's ledger,
// by class.
func (m *Metrics) SetQueueDepth(s jobs.Stage, byClass map[routing.Class]int) {
	for _, c := range routing.Classes() {
		m.queueDepth.WithLabelValues(string(s), c.String()).Set(float64(byClass[c]))
	}
}

// SetCredits sets the credits this agent can still grant for stage s, and
// those its running tasks hold.
func (m *Metrics) SetCredits(s jobs.Stage, free, inUse int) {
	m.freeCredits.WithLabelValues(string(s)).Set(float64(free))
	m.usedCredits.WithLabelValues(string(s)).Set(float64(inUse))
}

func (m *Metrics) observeRequest(route string, code int) {
	m.httpRequests.WithLabelValues(route, strconv.Itoa(code)).Inc()
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// WatchStore exports this node's part of the Store, read from stats at
// every scrape: bytes used and lent per tier, copies held per lease mode
// and tier, and its cumulative counters. Summed over agents, the series
// describe the whole Store.
func (m *Metrics) WatchStore(stats func() cache.LocalStats) error {
	if err := m.reg.Register(condCollector{stats: stats}); err != nil {
		return err
	}
	return m.reg.Register(storeCollector{stats: stats})
}

var (
	storeBytesDesc = prometheus.NewDesc("latentmesh_store_bytes",
		"Bytes this agent holds for the Store, by tier (memory, disk).", []string{"tier"}, nil)
	storeCapacityDesc = prometheus.NewDesc("latentmesh_store_capacity_bytes",
		"Bytes this agent lends to the Store, by tier.", []string{"tier"}, nil)
	storeCopiesDesc = prometheus.NewDesc("latentmesh_store_copies",
		"Object copies this agent holds, by lease mode and tier.", []string{"mode", "tier"}, nil)
	storeCopyBytesDesc = prometheus.NewDesc("latentmesh_store_copy_bytes",
		"Bytes of the object copies this agent holds, by lease mode and tier.", []string{"mode", "tier"}, nil)
	storeStagedDesc = prometheus.NewDesc("latentmesh_store_staged_copies",
		"Copies whose put has not committed yet.", nil, nil)
	storeEventsDesc = prometheus.NewDesc("latentmesh_store_events_total",
		"Store events on this agent: puts, gets, spills to disk, evictions, re-replications, collected records, lost objects.", []string{"event"}, nil)
)

// storeCollector reads the Store's figures at scrape time.
type storeCollector struct{ stats func() cache.LocalStats }

func (c storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{storeBytesDesc, storeCapacityDesc, storeCopiesDesc, storeCopyBytesDesc, storeStagedDesc, storeEventsDesc} {
		ch <- d
	}
}

func (c storeCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(storeBytesDesc, float64(st.MemoryUsed), "memory")
	gauge(storeBytesDesc, float64(st.DiskUsed), "disk")
	gauge(storeCapacityDesc, float64(st.MemoryCapacity), "memory")
	gauge(storeCapacityDesc, float64(st.DiskCapacity), "disk")
	gauge(storeStagedDesc, float64(st.Staged))
	for mode, t := range st.ByMode {
		gauge(storeCopiesDesc, float64(t.MemoryCopies), string(mode), "memory")
		gauge(storeCopiesDesc, float64(t.DiskCopies), string(mode), "disk")
		gauge(storeCopyBytesDesc, float64(t.MemoryBytes), string(mode), "memory")
		gauge(storeCopyBytesDesc, float64(t.DiskBytes), string(mode), "disk")
	}
	for event, v := range map[string]int64{
		"put": st.Puts, "get": st.Gets, "spill": st.Spills, "evict": st.Evictions,
		"repair": st.Repairs, "collect": st.Collected, "lost": st.Lost, "overflow": st.Overflows,
	} {
		ch <- prometheus.MustNewConstMetric(storeEventsDesc, prometheus.CounterValue, float64(v), event)
	}
}
