package sim

import "time"

// etcdModel counts the operations a run sends to etcd and turns its recent
// load into latency: an op's latency is its idle latency over (1 - load),
// load being the share of etcd's measured capacity the last window used
// (an M/M/1 queue's stretch), capped at 20x. Every mode's load is
// summed the same way: each kind's ops over that kind's capacity.
type etcdModel struct {
	costs EtcdCosts

	writes, reads, watches, events, keepalives uint64

	window      time.Duration
	windowStart time.Duration
	windowLoad  float64 // capacity-seconds used in the current window
	lastLoad    float64 // load of the last full window
	peakLoad    float64 // highest window load seen
	totalLoad   float64 // capacity-seconds used in the whole run
}

const (
	loadWindow = time.Second
	maxStretch = 20.0
)

func newEtcdModel(c EtcdCosts) *etcdModel { return &etcdModel{costs: c, window: loadWindow} }

func (e *etcdModel) roll(now time.Duration) {
	if now-e.windowStart < e.window {
		return
	}
	e.lastLoad = e.windowLoad / e.window.Seconds()
	if e.lastLoad > e.peakLoad {
		e.peakLoad = e.lastLoad
	}
	e.windowLoad = 0
	// A window with no ops in it between is a window of zero load.
	if now-e.windowStart >= 2*e.window {
		e.lastLoad = 0
	}
	e.windowStart = now - (now-e.windowStart)%e.window
}

func (e *etcdModel) add(now time.Duration, load float64) {
	e.roll(now)
	e.windowLoad += load
	e.totalLoad += load
}

func (e *etcdModel) write(now time.Duration, n int) {
	e.writes += uint64(n)
	e.add(now, float64(n)/e.costs.WriteCap)
}

func (e *etcdModel) read(now time.Duration, n int) {
	e.reads += uint64(n)
	e.add(now, float64(n)/e.costs.ReadCap)
}

func (e *etcdModel) watch(now time.Duration, n int) {
	e.watches += uint64(n)
	e.add(now, float64(n)/e.costs.WatchCreateCap)
}

func (e *etcdModel) event(now time.Duration, n int) {
	e.events += uint64(n)
	e.add(now, float64(n)/e.costs.EventCap)
}

// keepAlive is n lease renewals (LeaseKeepAlive), against their own
// capacity: they are no read and no raft proposal.
func (e *etcdModel) keepAlive(now time.Duration, n int) {
	e.keepalives += uint64(n)
	e.add(now, float64(n)/e.costs.KeepAliveCap)
}

func (e *etcdModel) stretch(now time.Duration) float64 {
	e.roll(now)
	u := e.lastLoad
	if s := 1 / (1 - u); u < 1 && s < maxStretch {
		return s
	}
	return maxStretch
}

func (e *etcdModel) lat(now, base time.Duration) time.Duration {
	return time.Duration(float64(base) * e.stretch(now))
}

func (e *etcdModel) writeLat(now time.Duration) time.Duration {
	return e.lat(now, e.costs.WriteLatency)
}
func (e *etcdModel) readLat(now time.Duration) time.Duration { return e.lat(now, e.costs.ReadLatency) }
func (e *etcdModel) watchLat(now time.Duration) time.Duration {
	return e.lat(now, e.costs.WatchDelay)
}
