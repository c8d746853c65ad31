package httpapi

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/latentmesh/latentmesh/cache"
)

// condMetrics are the conditioning cache's series (agent/condcache.go).
type condMetrics struct {
	lookups *prometheus.CounterVec // by part and result
	dropped prometheus.Counter
}

func (m *Metrics) initCondCache() error {
	m.cond = condMetrics{
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "latentmesh_cond_cache_lookups_total",
			Help: "Conditioning cache lookups by this agent, by part (prompt, negative, or conditioning: both texts as one tensor) and result (hit: not encoded here; miss: encoded here and published).",
		}, []string{"part", "result"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "latentmesh_cond_cache_invalidated_total",
			Help: "Conditioning cache entries this agent dropped because its encoder's version changed.",
		}),
	}
	for _, part := range []string{"prompt", "negative", "conditioning"} {
		for _, result := range []string{"hit", "miss"} {
			m.cond.lookups.WithLabelValues(part, result) // zero from the start
		}
	}
	for _, c := range []prometheus.Collector{m.cond.lookups, m.cond.dropped} {
		if err := m.reg.Register(c); err != nil {
			return fmt.Errorf("httpapi: registering metrics: %w", err)
		}
	}
	return nil
}

// CondLookup counts one conditioning cache lookup of part.
func (m *Metrics) CondLookup(part string, hit bool) {
	result := "miss"
	if hit {
		result = "hit"
	}
	m.cond.lookups.WithLabelValues(part, result).Inc()
}

// CondDropped counts entries invalidated by an encoder version change.
func (m *Metrics) CondDropped(n int) { m.cond.dropped.Add(float64(n)) }

var (
	condBytesDesc = prometheus.NewDesc("latentmesh_cond_cache_bytes",
		"Bytes of conditioning cache entries (the Store's cache-mode copies) this agent holds.", nil, nil)
	condCapacityDesc = prometheus.NewDesc("latentmesh_cond_cache_capacity_bytes",
		"This agent's room for conditioning cache entries (--cond-cache-bytes, at most a quarter of its Store memory).", nil, nil)
	condEvictionsDesc = prometheus.NewDesc("latentmesh_cond_cache_evictions_total",
		"Conditioning cache entries this agent evicted, least recently used first, to stay within its room.", nil, nil)
)

// condCollector reads the cache room from the Store's figures at scrape
// time.
type condCollector struct{ stats func() cache.LocalStats }

func (c condCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{condBytesDesc, condCapacityDesc, condEvictionsDesc} {
		ch <- d
	}
}

func (c condCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	ch <- prometheus.MustNewConstMetric(condBytesDesc, prometheus.GaugeValue, float64(st.CacheUsed))
	ch <- prometheus.MustNewConstMetric(condCapacityDesc, prometheus.GaugeValue, float64(st.CacheCapacity))
	ch <- prometheus.MustNewConstMetric(condEvictionsDesc, prometheus.CounterValue, float64(st.Evictions))
}
