package agent

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// Liveness is whether the goroutines an agent cannot work without are
// still turning: its pull loops (one per role, worker) and its etcd
// session (the lease keepalive and re-registration, gossip's lease loop).
// A service manager's watchdog reads it (Alive): `latentmesh agent` pings
// systemd's WATCHDOG=1 only while it is nil, so a wedged agent is killed
// and restarted instead of holding its claims and credits forever.
//
// Each watched loop holds a heartbeat. It beats each time round its loop
// and says wait as it blocks on a channel, a timer or an etcd call. A loop
// that waits is alive however long it waits: an idle pull loop, or one
// riding out an etcd outage on its lease and queue channels, or in a claim
// etcd has yet to answer. A loop that is not waiting and has not beaten
// for stuckAfter is stuck in a call that does not return (a deadlock, a
// spin): wedged.

// heartbeat is one loop's sign of life. It implements gossip.Heartbeat.
type heartbeat struct {
	name string
	now  func() time.Time
	// busy is when the loop last beat (unix ns); 0 while it waits, and
	// before it first beats (a loop not started yet is not wedged).
	busy atomic.Int64
}

// Beat says the loop made progress: it came round, or back from a wait.
func (h *heartbeat) Beat() {
	h.busy.Store(h.now().UnixNano())
	wedgePoint(h.name)
}

// Wait says the loop is about to block on something that may take long
// and that is not its own to end: a channel, a timer, etcd.
func (h *heartbeat) Wait() { h.busy.Store(0) }

// stuckFor is how long the loop has been out of a wait without beating
// (0 while it waits).
func (h *heartbeat) stuckFor() time.Duration {
	busy := h.busy.Load()
	if busy == 0 {
		return 0
	}
	return h.now().Sub(time.Unix(0, busy))
}

// liveness holds the heartbeats of the watched loops.
type liveness struct {
	stuck   time.Duration
	pull    map[jobs.Stage]*heartbeat // read-only after newLiveness
	order   []jobs.Stage
	session *heartbeat
}

func newLiveness(roles []jobs.Stage, stuck time.Duration, now func() time.Time) *liveness {
	l := &liveness{
		stuck:   stuck,
		pull:    make(map[jobs.Stage]*heartbeat, len(roles)),
		order:   roles,
		session: &heartbeat{name: "etcd session", now: now},
	}
	for _, st := range roles {
		l.pull[st] = &heartbeat{name: "pull " + string(st), now: now}
	}
	return l
}

// stuckAfter is how long a watched loop may go between beats outside a
// wait. One turn of a pull loop, or of the session, makes a few etcd calls
// that each give up after EtcdTimeout or gossip's RequestTimeout (a
// re-registration: a grant, a transaction, a revoke on failure; a return of
// pushed claims: one requeue each), so four of the longer bound is past
// anything a live loop does: 20 s with the defaults.
func stuckAfter(cfg Config) time.Duration {
	return 4 * max(cfg.EtcdTimeout, cfg.Gossip.RequestTimeout)
}

// check is nil while every watched loop is alive, else an error naming
// the first wedged one. pulling says the pull loops still run: once a
// drain has stopped them they are not watched.
func (l *liveness) check(pulling bool) error {
	if d := l.session.stuckFor(); d > l.stuck {
		return fmt.Errorf("agent: %s wedged: no progress for %v", l.session.name, d.Round(time.Millisecond))
	}
	if !pulling {
		return nil
	}
	for _, st := range l.order {
		if d := l.pull[st].stuckFor(); d > l.stuck {
			return fmt.Errorf("agent: %s loop wedged: no progress for %v", l.pull[st].name, d.Round(time.Millisecond))
		}
	}
	return nil
}

// Alive is nil while the agent's pull loops and its etcd session goroutine
// are alive (waiting on a channel, a timer or etcd, or beating within
// stuckAfter), through an etcd outage too; else an error naming the wedged
// loop. It reads atomics only: no etcd call, no lock.
func (a *Agent) Alive() error { return a.live.check(a.pullCtx.Err() == nil) }
