package cache

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Retention hands out etcd leases that end at the end of a retention
// bucket, so that keys meant to expire together share one lease: one lease
// grant per bucket instead of one per key, and etcd deletes the keys itself
// when it expires (no collector scan). A key lives between its retention
// and its retention plus one bucket (a sixteenth of it, at least a second).
//
// etcd restarts every lease's countdown on a leader change, so a key can
// outlive its retention by one more retention; callers that must bound it
// compare the expiry they recorded (the Store's collector does).
type Retention struct {
	cli *clientv3.Client
	now func() time.Time

	mu sync.Mutex
	// mu guards leases: bucket end (unix seconds) -> lease.
	leases map[int64]clientv3.LeaseID
}

// NewRetention returns a lease allocator on cli; now may be nil (time.Now).
func NewRetention(cli *clientv3.Client, now func() time.Time) *Retention {
	if now == nil {
		now = time.Now
	}
	return &Retention{cli: cli, now: now, leases: map[int64]clientv3.LeaseID{}}
}

// Lease returns a lease that expires at the end of the bucket holding
// now+ttl, and that end.
func (r *Retention) Lease(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, time.Time, error) {
	if ttl <= 0 {
		return 0, time.Time{}, fmt.Errorf("cache: retention %v must be positive", ttl)
	}
	g := max(ttl/16, time.Second).Truncate(time.Second)
	now := r.now()
	end := now.Add(ttl).Truncate(g).Add(g) // round up to the bucket's end
	key := end.Unix()
	r.mu.Lock()
	id, ok := r.leases[key]
	// Forget buckets that have ended; their leases are gone.
	for k := range r.leases {
		if k <= now.Unix() {
			delete(r.leases, k)
		}
	}
	r.mu.Unlock()
	if ok {
		return id, end, nil
	}
	secs := int64(end.Sub(now)/time.Second) + 1
	resp, err := r.cli.Grant(ctx, secs)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("cache: grant retention lease: %w", err)
	}
	r.mu.Lock()
	if prev, ok := r.leases[key]; ok {
		id = prev // another caller won; its lease serves both
	} else {
		r.leases[key] = resp.ID
		id = resp.ID
	}
	r.mu.Unlock()
	if id != resp.ID {
		r.cli.Revoke(context.WithoutCancel(ctx), resp.ID)
	}
	return id, end, nil
}

// Forget drops a lease etcd no longer knows (an etcd replaced or restored
// from a snapshot), so the next Lease grants a fresh one.
func (r *Retention) Forget(id clientv3.LeaseID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, v := range r.leases {
		if v == id {
			delete(r.leases, k)
		}
	}
}

// LeaseGone reports whether err is etcd refusing a write on a lease it does
// not know; the caller forgets the lease and tries once more.
func LeaseGone(err error) bool {
	return errors.Is(err, rpctypes.ErrLeaseNotFound) || (err != nil && errors.Is(rpctypes.Error(err), rpctypes.ErrLeaseNotFound))
}
