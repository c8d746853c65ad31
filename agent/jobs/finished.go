package jobs

import "sync"

// Finished keeps the finished job records an agent read last, so that it
// can still answer for them when no etcd member answers at all (all down,
// frozen, or cut off from this agent). A finished record never changes; it
// can only be deleted. Forget applies the deletes made through this agent;
// one made through another agent while etcd is unreachable shows here until
// etcd answers again, which is when the copy stops being read.
type Finished struct {
	max int

	mu    sync.Mutex // guards the fields below
	jobs  map[string]Job
	order []string // ids in the order they were noted, oldest first; may name forgotten ones
}

// NewFinished keeps up to n records (at least one).
func NewFinished(n int) *Finished {
	return &Finished{max: max(n, 1), jobs: map[string]Job{}}
}

// Note keeps j if it is finished, dropping the oldest record beyond max.
func (f *Finished) Note(j Job) {
	if !j.State.Terminal() || j.ID == "" {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.jobs[j.ID]; !ok {
		f.order = append(f.order, j.ID)
	}
	f.jobs[j.ID] = j
	for len(f.order) > f.max {
		delete(f.jobs, f.order[0])
		f.order = f.order[1:]
	}
}

// Get returns the record of job id, if kept.
func (f *Finished) Get(id string) (Job, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	return j, ok
}

// Forget drops job id's record: it was deleted.
func (f *Finished) Forget(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.jobs, id)
}
