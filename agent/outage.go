package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// While etcd cannot serve the agent with quorum (its members lost their
// leader, or none answers), the client API refuses writes at once (503)
// and answers reads from what is still true without quorum: a live
// member's own data (a serializable read), or the agent's copy of a
// finished job's record.

const (
	// staleReadTimeout bounds one read without quorum: a member answers
	// one from its own data in milliseconds, so one that has not answered
	// in half a second is frozen or cut off.
	staleReadTimeout = 500 * time.Millisecond
	// finishedRecords is how many finished job records an agent keeps to
	// answer for without etcd: the jobs its clients read last (a few MB).
	finishedRecords = 1024
	// awaitEtcdEvery is how often a long poll waiting out an outage looks
	// again whether etcd is back, besides each change of the health.
	awaitEtcdEvery = time.Second
)

// etcdDown is nil while etcd can serve, else why not (jobs.ErrUnavailable):
// the health says etcd is down, or etcd has not renewed this node's lease
// for longer than it should (leaseSilent).
func (a *Agent) etcdDown() error {
	if err := a.health.Err(); err != nil {
		return err
	}
	return a.leaseSilent()
}

// An agent that calls etcd for nothing else (an idle one) learns of an
// outage from its lease keepalives, which it sends anyway: they are
// answered by etcd's leader every third of the lease TTL while etcd
// serves. Nothing else is sent for it (an alarm poll used to be, a raft
// proposal every 5 s per agent).

// leaseSilentAfter is how long the lease may go unrenewed before etcd is
// taken to be down: one renewal missed, and the next one late by at least
// two seconds (so a busy etcd is not taken for a gone one).
func (a *Agent) leaseSilentAfter() time.Duration {
	every := a.cfg.Gossip.LeaseTTL / 3
	return every + max(every, 2*time.Second)
}

// leaseSilent is nil while etcd renewed this node's lease within
// leaseSilentAfter (or the node has not registered yet), else an error
// wrapping jobs.ErrUnavailable.
func (a *Agent) leaseSilent() error {
	last := a.member.LeaseContact()
	if last.IsZero() {
		return nil
	}
	if age := time.Since(last); age > a.leaseSilentAfter() {
		return fmt.Errorf("%w: etcd has not renewed this node's lease for %v", jobs.ErrUnavailable, age.Round(100*time.Millisecond))
	}
	return nil
}

// watchLeaseContact tells the health when the lease falls silent, so that
// the client API refuses at once and the health probes until etcd is
// back. It reads a clock and sends nothing.
func (a *Agent) watchLeaseContact() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		}
		if err := a.leaseSilent(); err != nil && a.health.Err() == nil {
			a.health.Observe(err)
		}
	}
}

// awaitEtcd waits until etcd may serve again (the health changed, or a
// while passed) or ctx ends (ctx.Err()).
func (a *Agent) awaitEtcd(ctx context.Context) error {
	t := time.NewTimer(awaitEtcdEvery)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-a.health.Changed():
	case <-t.C:
	}
	return nil
}

// getWithoutQuorum answers for job id while etcd cannot with quorum (why):
// from a live member's own data, else from this agent's copy of the
// finished record. A job neither knows of is why, not jobs.ErrNotFound: a
// member without quorum may not have seen it yet.
func (a *Agent) getWithoutQuorum(ctx context.Context, id string, why error) (jobs.Job, error) {
	rctx, cancel := context.WithTimeout(ctx, staleReadTimeout)
	j, err := a.store.GetSerializable(rctx, id)
	cancel()
	if err == nil {
		a.finished.Note(j)
		return j, nil
	}
	if j, ok := a.finished.Get(id); ok {
		return j, nil
	}
	return jobs.Job{}, why
}

// lookupWithoutQuorum is cache.Store.Lookup from a live member's own data
// (cache.Store.LookupStale), while etcd cannot answer with quorum (why).
// An object's record changes as holders come and go; the holders one
// names are tried in turn anyway, and a gone one is skipped.
func (a *Agent) lookupWithoutQuorum(ctx context.Context, id string, why error) (cache.Record, error) {
	rctx, cancel := context.WithTimeout(ctx, staleReadTimeout)
	defer cancel()
	rec, err := a.cstore.LookupStale(rctx, id)
	if err != nil {
		return cache.Record{}, why // absent here may be not yet seen: not "lost"
	}
	return rec, nil
}
