package testbed

import (
	"fmt"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// leaseGrants reads this process's embedded etcds' count of leases
// granted: each is a raft proposal, made once per retention bucket, not
// per job.
func leaseGrants() float64 { return etcdMetric("etcd_debugging_lease_granted_total") }

// leaseRevokes reads this process's embedded etcds' count of leases
// revoked (by a client or at expiry): each is a raft proposal.
func leaseRevokes() float64 { return etcdMetric("etcd_debugging_lease_revoked_total") }

// raftTally is what an embedded etcd committed through raft: its
// proposals, and the lease grants and revocations among them.
type raftTally struct{ proposals, grants, revokes float64 }

// Minus is t less an earlier tally.
func (t raftTally) Minus(u raftTally) raftTally {
	return raftTally{t.proposals - u.proposals, t.grants - u.grants, t.revokes - u.revokes}
}

// raftCount tallies srv's raft entries once every committed one is
// applied, so that the lease counters (process-wide, counted as an entry
// is applied) and the committed index (srv.RaftIndex) cover the same
// entries.
func raftCount(srv *etcdembed.Server) (raftTally, error) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		committed, applied := srv.RaftIndex()
		if applied >= committed {
			t := raftTally{float64(committed), leaseGrants(), leaseRevokes()}
			if again, _ := srv.RaftIndex(); again == committed {
				return t, nil // no entry after committed was applied before the counters were read
			}
		}
		time.Sleep(time.Millisecond)
	}
	return raftTally{}, fmt.Errorf("testbed: etcd did not apply its committed raft entries within 10s")
}

// settled is raftCount, failing t when etcd does not settle.
func settled(t *testing.T, srv *etcdembed.Server) raftTally {
	t.Helper()
	tally, err := raftCount(srv)
	if err != nil {
		t.Fatal(err)
	}
	return tally
}
