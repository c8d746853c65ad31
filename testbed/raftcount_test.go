package testbed

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// leaseGrants reads this process's embedded etcds' count of leases
// granted: each is a raft proposal, made once per retention bucket, not
// per job.
func leaseGrants() float64 { return leaseCounter("etcd_debugging_lease_granted_total") }

// leaseRevokes reads this process's embedded etcds' count of leases
// revoked (by a client or at expiry): each is a raft proposal.
func leaseRevokes() float64 { return leaseCounter("etcd_debugging_lease_revoked_total") }

// raftTally is what an embedded etcd committed through raft: its
// proposals, and the lease grants and revocations among them.
type raftTally struct{ proposals, grants, revokes float64 }

// Minus is t less an earlier tally.
func (t raftTally) Minus(u raftTally) raftTally {
	return raftTally{t.proposals - u.proposals, t.grants - u.grants, t.revokes - u.revokes}
}

// settled tallies srv's raft entries once every committed one is
// applied, so that the lease counters (process-wide, counted as an entry
// is applied) and the committed index (srv.RaftIndex) cover the same
// entries; it fails t when etcd does not settle within 10 s.
func settled(t *testing.T, srv *etcdembed.Server) raftTally {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		committed, applied := srv.RaftIndex()
		if applied < committed {
			continue
		}
		tally := raftTally{float64(committed), leaseGrants(), leaseRevokes()}
		if again, _ := srv.RaftIndex(); again == committed {
			return tally // no entry after committed was applied before the counters were read
		}
	}
	t.Fatal("etcd did not apply its committed raft entries within 10 s")
	return raftTally{}
}

// leaseCounter reads one of this process's embedded etcds' counters from
// the Prometheus registry (0 without one).
func leaseCounter(name string) float64 {
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}
