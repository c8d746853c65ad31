package agent

import (
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
)

// A waiting task goes back by gossip to the worker that gave it back only
// once that worker has gossiped since: what it said before is what it
// turned down.
func TestSaidSince(t *testing.T) {
	seen := time.Now()
	peer := func(id string, at time.Time) gossip.Peer {
		return gossip.Peer{Record: gossip.NodeRecord{ID: id}, MetaAt: at}
	}
	task := jobs.Task{Back: "w1", Seen: seen}
	for _, c := range []struct {
		name string
		p    gossip.Peer
		t    jobs.Task
		want bool
	}{
		{"the giver, gossip from before", peer("w1", seen.Add(-time.Millisecond)), task, false},
		{"the giver, gossip from the same instant", peer("w1", seen), task, false},
		{"the giver, gossip since", peer("w1", seen.Add(time.Millisecond)), task, true},
		{"another worker, gossip from before", peer("w2", seen.Add(-time.Second)), task, true},
		{"a task nobody gave back", peer("w1", seen.Add(-time.Second)), jobs.Task{Seen: seen}, true},
	} {
		if got := saidSince(c.p, c.t); got != c.want {
			t.Errorf("%s: saidSince = %v, want %v", c.name, got, c.want)
		}
	}
}
