package httpapi

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// AgentStats are the figures of an agent that Metrics reads at every
// scrape (WatchAgent): counters kept by the layers below, which know
// nothing of Prometheus, and the membership and engine views.
type AgentStats struct {
	// Transfers are the completed pulls, by purpose and transport.
	Transfers []TransferStats
	// HeapPublishes counts payloads published on the heap because the
	// arena was full; HeapPulls pulls landed on the heap for the same
	// reason.
	HeapPublishes, HeapPulls int64
	// Members counts the registered nodes this agent sees, by gossip
	// state: "alive", "suspect", "dead" (memberlist declared it dead, or
	// it left, while its etcd registration lives on).
	Members map[string]int
	// ExternalEngine: the agent runs stages on an external engine
	// (--engine-socket); EngineRegistered says one is registered now.
	// Its frames are noted with EngineFrame.
	ExternalEngine   bool
	EngineRegistered bool
}

// TransferStats are the completed pulls of one purpose ("stage": a
// handoff between stages; "store": copies onto Store holders and reads of
// stored objects) over one transport ("local", "shm", "rdma", "tcp").
type TransferStats struct {
	Purpose, Transport string
	Pulls, Bytes       int64
	Time               time.Duration
}

// WatchAgent exports the agent's figures that stats reads at scrape time.
func (m *Metrics) WatchAgent(stats func() AgentStats) error {
	return m.reg.Register(agentCollector{stats: stats, m: m})
}

// EngineFrame notes a frame from the external engine (a heartbeat or a
// report): it proves the engine alive.
func (m *Metrics) EngineFrame() { m.engineBeat.Store(time.Now().UnixNano()) }

var (
	transfersDesc = prometheus.NewDesc("latentmesh_transfers_total",
		"Completed payload pulls by this agent, by purpose (stage, store) and transport (local, shm, rdma, tcp).", []string{"purpose", "transport"}, nil)
	transferBytesDesc = prometheus.NewDesc("latentmesh_transfer_bytes_total",
		"Bytes moved by this agent's completed pulls, by purpose and transport.", []string{"purpose", "transport"}, nil)
	transferSecondsDesc = prometheus.NewDesc("latentmesh_transfer_seconds_total",
		"Time this agent's completed pulls took, start to last byte, by purpose and transport; bytes over seconds is the throughput.", []string{"purpose", "transport"}, nil)
	heapDesc = prometheus.NewDesc("latentmesh_heap_fallbacks_total",
		"Buffers taken from the heap because the arena was full, by side (publish: an output payload; pull: an input landing here).", []string{"side"}, nil)
	membersDesc = prometheus.NewDesc("latentmesh_gossip_members",
		"Registered nodes this agent sees, by gossip state (alive, suspect, dead); the same on every agent: use max() or one agent's.", []string{"state"}, nil)
	engineDesc = prometheus.NewDesc("latentmesh_engine_registered",
		"1 while a stage engine is ready to run tasks here (the built-in engine always is; an external one once registered), else 0.", []string{"engine"}, nil)
	engineBeatDesc = prometheus.NewDesc("latentmesh_engine_last_heartbeat_timestamp_seconds",
		"Unix time of the external engine's last frame (heartbeat or report); time() minus it is its silence.", nil, nil)
)

// agentCollector reads AgentStats at scrape time.
type agentCollector struct {
	stats func() AgentStats
	m     *Metrics
}

func (c agentCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{transfersDesc, transferBytesDesc, transferSecondsDesc, heapDesc, membersDesc, engineDesc, engineBeatDesc} {
		ch <- d
	}
}

func (c agentCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.stats()
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, t := range st.Transfers {
		counter(transfersDesc, float64(t.Pulls), t.Purpose, t.Transport)
		counter(transferBytesDesc, float64(t.Bytes), t.Purpose, t.Transport)
		counter(transferSecondsDesc, t.Time.Seconds(), t.Purpose, t.Transport)
	}
	counter(heapDesc, float64(st.HeapPublishes), "publish")
	counter(heapDesc, float64(st.HeapPulls), "pull")
	for _, s := range []string{"alive", "suspect", "dead"} {
		gauge(membersDesc, float64(st.Members[s]), s)
	}
	engine, registered := "builtin", 1.0
	if st.ExternalEngine {
		engine, registered = "external", 0
		if st.EngineRegistered {
			registered = 1
		}
		if ns := c.m.engineBeat.Load(); ns != 0 {
			gauge(engineBeatDesc, float64(ns)/1e9)
		}
	}
	gauge(engineDesc, registered, engine)
}
