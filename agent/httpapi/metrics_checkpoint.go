package httpapi

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// checkpointMetrics are the series of step checkpoints and of the
// denoiser's tensor cache (the unconditional branch's attention keys and
// values, reused across requests).
type checkpointMetrics struct {
	written prometheus.Counter
	resumed prometheus.Counter
}

func (m *Metrics) initCheckpoints() error {
	m.ckpt = checkpointMetrics{
		written: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "latentmesh_checkpoints_written_total",
			Help: "Denoise step checkpoints this agent wrote to the Store (periodic, and where a preemption or drain stopped a task).",
		}),
		resumed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "latentmesh_checkpoint_resumes_total",
			Help: "Denoise tasks this agent started from a checkpoint (a retry, a requeue, a rewound job or a fork) rather than from noise.",
		}),
	}
	for _, c := range []prometheus.Collector{m.ckpt.written, m.ckpt.resumed} {
		if err := m.reg.Register(c); err != nil {
			return fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	return nil
}

// Checkpointed counts one checkpoint written.
func (m *Metrics) Checkpointed() { m.ckpt.written.Inc() }

// Resumed counts one denoise started from a checkpoint.
func (m *Metrics) Resumed() { m.ckpt.resumed.Inc() }

// KVStats is a tensor cache's counters, as WatchKV reads them.
type KVStats struct {
	Hits, Misses, Evictions, Bytes int64
}

// WatchKV exports the denoiser's tensor cache: hits, misses, evictions
// and bytes held, read from stats at each scrape.
func (m *Metrics) WatchKV(stats func() KVStats) error {
	for _, c := range []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "latentmesh_kv_cache_hits_total",
			Help: "Denoise calls that found the unconditional branch's attention keys and values in this agent's tensor cache.",
		}, func() float64 { return float64(stats().Hits) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "latentmesh_kv_cache_misses_total",
			Help: "Denoise calls that computed the unconditional branch's attention keys and values and cached them.",
		}, func() float64 { return float64(stats().Misses) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "latentmesh_kv_cache_evictions_total",
			Help: "Tensor cache entries dropped to stay within --kv-cache-bytes, least recently used first.",
		}, func() float64 { return float64(stats().Evictions) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "latentmesh_kv_cache_bytes",
			Help: "Bytes held by this agent's tensor cache.",
		}, func() float64 { return float64(stats().Bytes) }),
	} {
		if err := m.reg.Register(c); err != nil {
			return fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	return nil
}
