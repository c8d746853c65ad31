package httpapi

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/latentmesh/latentmesh/agent/jobs"
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
	}
	for _, c := range []prometheus.Collector{m.jobsSubmitted, m.jobsFinished, m.stageSeconds, m.queueDepth, m.freeCredits, m.httpRequests} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	return m, nil
}

// JobSubmitted counts one accepted job.
func (m *Metrics) JobSubmitted(c routing.Class) { m.jobsSubmitted.WithLabelValues(c.String()).Inc() }

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
