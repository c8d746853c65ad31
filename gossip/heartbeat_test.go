package gossip

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
)

// recordedBeats is a Heartbeat that remembers what it heard.
type recordedBeats struct {
	mu      sync.Mutex // guards the fields below
	beats   int
	waiting bool
}

func (r *recordedBeats) Beat() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.beats++
	r.waiting = false
}

func (r *recordedBeats) Wait() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waiting = true
}

func (r *recordedBeats) state() (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.beats, r.waiting
}

// The etcd session goroutine beats as it goes round and waits on etcd's
// renewals while its lease is held; losing the lease, it beats through the
// re-registration and waits again under the new lease.
func TestSessionHeartbeat(t *testing.T) {
	cli := startEtcd(t)
	hb := &recordedBeats{}
	a := startNode(t, cli, testPrefix(t), "a", []string{RoleEncode}, func(c *Config) { c.SessionHeartbeat = hb })
	waitingAfter := func(beats int) int {
		t.Helper()
		var got int
		eventually(t, 5*time.Second, func() error {
			n, waiting := hb.state()
			if n <= beats || !waiting {
				return fmt.Errorf("%d beats (want more than %d), waiting %v", n, beats, waiting)
			}
			got = n
			return nil
		})
		return got
	}
	held := waitingAfter(0)

	old := a.Lease()
	changed := a.LeaseChanged()
	if _, err := cli.Revoke(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(5 * time.Second):
		t.Fatal(errors.New("LeaseChanged did not fire after the lease was revoked"))
	}
	eventually(t, 5*time.Second, func() error {
		if l := a.Lease(); l == 0 || l == old {
			return fmt.Errorf("lease %x (old %x)", l, old)
		}
		return nil
	})
	waitingAfter(held)
}
