package httpapi

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// Metrics are the agent's Prometheus series. The agent calls the methods;
// Handler serves them. All methods are safe for concurrent use.
type Metrics struct {
	reg           *prometheus.Registry
	jobsSubmitted *prometheus.CounterVec
	jobsFinished  *prometheus.CounterVec
	stageSeconds  *prometheus.HistogramVec
	queueDepth    *prometheus.GaugeVec
	freeCredits   *prometheus.GaugeVec
	httpRequests  *prometheus.CounterVec
	jobsRefused   prometheus.Counter
	preempted     prometheus.Counter
	pushedClaims  *prometheus.CounterVec
}

// NewMetrics registers the series on reg (a fresh registry when nil).
func NewMetrics(reg *prometheus.Registry) (*Metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &Metrics{
		reg: reg,
		jobsSubmitted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_jobs_submitted_total",
			Help: "Jobs accepted by this agent's API, by priority class.",
		}, []string{"class"}),
		jobsFinished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_jobs_finished_total",
			Help: "Jobs that reached a terminal state, by state.",
		}, []string{"state"}),
		stageSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "latentmesh_stage_duration_seconds",
			Help: "Time to run one pipeline stage on this agent, by stage.",
			// 10ms (a cached encode) to about 4 minutes (a long CPU denoise).
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 12),
		}, []string{"stage"}),
		queueDepth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "latentmesh_queue_depth",
			Help: "Tasks waiting in this agent's queue, by stage.",
		}, []string{"stage"}),
		freeCredits: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "latentmesh_free_credits",
			Help: "Credits this agent can still grant, by stage.",
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
	}
	for _, c := range []prometheus.Collector{m.jobsSubmitted, m.jobsFinished, m.stageSeconds, m.queueDepth, m.freeCredits, m.httpRequests, m.jobsRefused, m.preempted, m.pushedClaims} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	return m, nil
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
	outcome := "started"
	if given {
		outcome = "given_back"
	}
	m.pushedClaims.WithLabelValues(string(s), outcome).Inc()
}

// JobFinished counts one job reaching state s.
func (m *Metrics) JobFinished(s jobs.State) { m.jobsFinished.WithLabelValues(string(s)).Inc() }

// ObserveStage records how long one run of a stage took.
func (m *Metrics) ObserveStage(s jobs.Stage, d time.Duration) {
	m.stageSeconds.WithLabelValues(string(s)).Observe(d.Seconds())
}

// SetQueueDepth sets the number of tasks waiting for stage s.
func (m *Metrics) SetQueueDepth(s jobs.Stage, n int) {
	m.queueDepth.WithLabelValues(string(s)).Set(float64(n))
}

// SetFreeCredits sets the credits this agent can still grant for stage s.
func (m *Metrics) SetFreeCredits(s jobs.Stage, n int) {
	m.freeCredits.WithLabelValues(string(s)).Set(float64(n))
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
