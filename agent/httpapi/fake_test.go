package httpapi

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// fakeJobs is an in-memory Jobs. With auto set, a job succeeds as soon as
// it is submitted; otherwise the test drives it with advance/finish/fail.
type fakeJobs struct {
	auto      bool
	submitErr error
	// stepOnGet moves a job one step along queued, encode, denoise 1..n,
	// decode, succeeded on every Get, so a poller sees every stage; with
	// failWith set the job fails at decode instead.
	stepOnGet bool
	failWith  *jobs.Error

	mu      sync.Mutex // guards the fields below
	next    int
	jobs    map[string]*jobs.Job
	data    map[string][]byte
	changed chan struct{} // closed and replaced on every change
	// images are the reference images submitted, by job.
	images map[string]*jobs.ImageUpload
}

func newFakeJobs(auto bool) *fakeJobs {
	return &fakeJobs{auto: auto, jobs: map[string]*jobs.Job{}, data: map[string][]byte{}, changed: make(chan struct{}), images: map[string]*jobs.ImageUpload{}}
}

// fakeOutput is what every fake job produces: it depends on the seed, so
// tests can tell images apart.
func fakeOutput(spec engine.Spec) []byte {
	return fmt.Appendf(nil, "PNG seed=%d prompt=%s", spec.Seed, spec.Prompt)
}

func (f *fakeJobs) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeJobs) Submit(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error) {
	if f.submitErr != nil {
		return jobs.Job{}, f.submitErr
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	now := time.Unix(1700000000, 0).UTC()
	j := &jobs.Job{ID: fmt.Sprintf("job-%d", f.next), Spec: spec, Class: opts.Class, Transfer: opts.Transfer, State: jobs.Queued, Stage: jobs.Encode, CreatedAt: now, UpdatedAt: now, Owner: opts.Owner,
		Checkpointing: opts.Checkpointing, Fork: opts.Fork}
	f.jobs[j.ID] = j
	if opts.Image != nil {
		f.images[j.ID] = opts.Image
	}
	if f.auto {
		f.succeedLocked(j)
	}
	f.notifyLocked()
	return *j, nil
}

func (f *fakeJobs) succeedLocked(j *jobs.Job) {
	out := fakeOutput(j.Spec)
	f.data[j.ID] = out
	j.State, j.Stage, j.Progress = jobs.Succeeded, "", nil
	j.Result = &jobs.Result{ContentType: "image/png", Bytes: int64(len(out)), Object: jobs.ResultID(j.ID)}
}

func (f *fakeJobs) update(id string, fn func(j *jobs.Job)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j := f.jobs[id]
	fn(j)
	if j.State == jobs.Succeeded {
		f.succeedLocked(j)
	}
	f.notifyLocked()
}

func (f *fakeJobs) Get(ctx context.Context, id string) (jobs.Job, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	if !ok {
		return jobs.Job{}, jobs.ErrNotFound
	}
	if f.stepOnGet {
		f.stepLocked(j)
	}
	return *j, nil
}

func (f *fakeJobs) stepLocked(j *jobs.Job) {
	switch {
	case j.State.Terminal():
		return
	case j.State == jobs.Queued:
		j.State, j.Stage = jobs.Running, jobs.Encode
	case j.Stage == jobs.Encode:
		j.Stage = jobs.Denoise
		j.Progress = &jobs.Progress{Stage: jobs.Denoise, Step: 1, Total: j.Spec.Steps, Node: "n1"}
	case j.Stage == jobs.Denoise && j.Progress.Step < j.Progress.Total:
		p := *j.Progress // replace, never mutate: callers hold copies of the pointer
		p.Step++
		j.Progress = &p
	case j.Stage == jobs.Denoise:
		j.Stage, j.Progress = jobs.Decode, nil
	case f.failWith != nil:
		j.State, j.Stage, j.Error = jobs.Failed, "", f.failWith
	default:
		f.succeedLocked(j)
	}
	f.notifyLocked()
}

func (f *fakeJobs) Wait(ctx context.Context, id string) (jobs.Job, error) {
	for {
		f.mu.Lock()
		j, ok := f.jobs[id]
		ch := f.changed
		var cp jobs.Job
		if ok {
			cp = *j
		}
		f.mu.Unlock()
		if !ok {
			return jobs.Job{}, jobs.ErrNotFound
		}
		if cp.State.Terminal() {
			return cp, nil
		}
		select {
		case <-ctx.Done():
			return jobs.Job{}, ctx.Err()
		case <-ch:
		}
	}
}

func (f *fakeJobs) Result(ctx context.Context, id string) ([]byte, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	if !ok {
		return nil, "", jobs.ErrNotFound
	}
	if j.State != jobs.Succeeded {
		return nil, "", jobs.ErrNotReady
	}
	return f.data[id], j.Result.ContentType, nil
}

func (f *fakeJobs) Cancel(ctx context.Context, id string) (jobs.Job, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	if !ok {
		return jobs.Job{}, jobs.ErrNotFound
	}
	if j.State.Terminal() {
		return *j, jobs.ErrFinished
	}
	j.State, j.Stage, j.Progress = jobs.Cancelled, "", nil
	f.notifyLocked()
	return *j, nil
}

func (f *fakeJobs) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	if !ok {
		return jobs.ErrNotFound
	}
	if !j.State.Terminal() {
		return jobs.ErrNotFinished
	}
	delete(f.jobs, id)
	delete(f.data, id)
	f.notifyLocked()
	return nil
}

var errFakeStore = errors.New("fake: store down")

// ForkPoint finds a checkpoint where a real mesh would have kept one: the
// job asked to keep them, and its checkpoint_every divides the step.
func (f *fakeJobs) ForkPoint(ctx context.Context, id string, step int) (jobs.Job, jobs.ForkFrom, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	j, ok := f.jobs[id]
	if !ok {
		return jobs.Job{}, jobs.ForkFrom{}, jobs.ErrNotFound
	}
	k := j.Checkpointing
	if k == nil || k.Keep == 0 || k.Every == nil || *k.Every == 0 || step%*k.Every != 0 || step >= j.Spec.Steps {
		return *j, jobs.ForkFrom{}, jobs.ErrNoCheckpoint
	}
	return *j, jobs.ForkFrom{Job: id, Step: step, Object: jobs.CheckpointID(id, step)}, nil
}
