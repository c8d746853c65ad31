package agent

import (
	"context"
	"slices"
	"sync"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// recentCap is how many job ids an agent remembers for its status page:
// a screenful, and one bounded etcd transaction to read (jobs.MaxGetMany).
const recentCap = jobs.MaxGetMany

// recentJobs remembers the ids of the last jobs this agent saw: submitted
// through it, or a stage of which it claimed. It holds ids only; their
// records are read from etcd when asked (RecentJobs), so they are current.
type recentJobs struct {
	mu  sync.Mutex // guards the fields below
	ids []string   // oldest first, at most recentCap, no repeats
}

// note moves id to the newest place.
func (r *recentJobs) note(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if i := slices.Index(r.ids, id); i >= 0 {
		r.ids = slices.Delete(r.ids, i, i+1)
	}
	r.ids = append(r.ids, id)
	if len(r.ids) > recentCap {
		r.ids = slices.Delete(r.ids, 0, len(r.ids)-recentCap)
	}
}

// newest returns up to n ids, newest first.
func (r *recentJobs) newest(n int) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	n = min(n, len(r.ids))
	out := slices.Clone(r.ids[len(r.ids)-n:])
	slices.Reverse(out)
	return out
}

// RecentJobs is the admin view of the last jobs this agent saw.
type RecentJobs struct {
	Node string     `json:"node"`
	Jobs []jobs.Job `json:"jobs"` // newest first; records as etcd holds them now
}

// RecentJobs reads the records of the last limit jobs this agent saw
// (submitted through it or worked on by it; at most recentCap), newest
// first, in one etcd transaction. Jobs whose records are gone are left out.
func (a *Agent) RecentJobs(ctx context.Context, limit int) (RecentJobs, error) {
	ids := a.recent.newest(max(0, min(limit, recentCap)))
	var js []jobs.Job
	err := a.onEtcd(ctx, func(ctx context.Context) (err error) {
		js, err = a.store.GetMany(ctx, ids)
		return err
	})
	if err != nil {
		return RecentJobs{}, err
	}
	for i := range js {
		js[i].Owner = "" // a hash of the submitter's token: not for a page
	}
	if js == nil {
		js = []jobs.Job{}
	}
	return RecentJobs{Node: a.id, Jobs: js}, nil
}
