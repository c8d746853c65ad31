package agent

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// The client's operations on this agent (the HTTP API's, and the
// testbed's): submit, read, wait for, cancel and delete jobs, and stream a
// job's frames, each bounded by etcd's availability (onEtcd).

// The httpapi.Jobs interface: the job store, counted in metrics. Each etcd
// call made for a client request is bounded by EtcdTimeout, and refused at
// once while etcd is down (etcdDown), so a client learns that etcd is
// unreachable (503, jobs.ErrUnavailable) instead of waiting on gRPC; reads
// are answered without quorum meanwhile (outage.go).

// onEtcd runs f, etcd calls for a client request, with ctx bounded by
// EtcdTimeout and needing a leader (a member without one refuses at once
// instead of holding the call to its deadline). Health tracks the call: it
// is cancelled as soon as etcd is found down. An unanswered call is named
// jobs.ErrUnavailable.
func (a *Agent) onEtcd(ctx context.Context, f func(context.Context) error) error {
	if err := a.etcdDown(); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), a.cfg.EtcdTimeout)
	defer cancel()
	tctx, done := a.health.Track(cctx)
	err := a.etcdErr(ctx, tctx, f(tctx))
	if ctx.Err() != nil {
		done(ctx.Err()) // the caller gave up, whatever error the call made of it: no news of etcd
	} else {
		done(err)
	}
	return err
}

// etcdErr turns an error of a call made under ctx (tracked as tctx) into
// jobs.ErrUnavailable when etcd, not the caller, ran out of time, could not
// be reached or refused for want of a leader, or was found down meanwhile.
func (a *Agent) etcdErr(ctx, tctx context.Context, err error) error {
	switch {
	case err == nil, ctx.Err() != nil, errors.Is(err, jobs.ErrUnavailable):
		return err
	case errors.Is(context.Cause(tctx), jobs.ErrUnavailable):
		return context.Cause(tctx)
	case jobs.IsUnavailable(err):
		return fmt.Errorf("%w: %v", jobs.ErrUnavailable, err)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("%w: no answer within %v: %v", jobs.ErrUnavailable, a.cfg.EtcdTimeout, err)
	}
	return err
}

// Submit stores a new job, unless the mesh cannot take it (checkSubmit).
func (a *Agent) Submit(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error) {
	if err := a.checkSubmit(spec, opts); err != nil {
		a.metrics.JobRefused()
		return jobs.Job{}, err
	}
	abort, err := a.submitInputs(ctx, &spec, &opts)
	if err != nil {
		a.metrics.JobRefused()
		return jobs.Job{}, err
	}
	opts.Dispatcher = a.id // a first task with no worker free waits in this agent's ledger
	var j jobs.Job
	var task jobs.Task
	err = a.onEtcd(ctx, func(ctx context.Context) (err error) {
		// The conditioning cache's lookup may read etcd (an entry held
		// elsewhere): under the submit's deadline, so that an outage
		// refuses the job within one EtcdTimeout.
		if opts.Cond == nil {
			opts.Cond = a.cachedCond(ctx, spec)
		}
		first := jobs.Encode
		if len(opts.Cond) > 0 {
			first = jobs.Denoise // the conditioning is in the cache: no encode
		}
		if opts.Push == nil {
			// The first task goes, claimed, to a worker with a free slot.
			_, opts.Push = a.pushTarget(first, spec)
		}
		if opts.Push != nil && opts.Cond != nil {
			opts.Cond = a.issueTickets(opts.Cond, opts.Push.Node) // for the entries held here
		}
		j, task, err = a.store.SubmitTask(ctx, spec, opts)
		return err
	})
	if err != nil {
		abort() // the job's staged objects (its image) are no one's (a submit with no answer that landed is counted by its ledger's watch)
	}
	if jobs.IsNoSpace(err) {
		a.alarms.Observe(err)
		return jobs.Job{}, a.alarms.NoSpace() // ErrNoSpace with what to do: a 503
	}
	if err == nil {
		a.fed[task.Stage].Created(task) // its push's worker has its credit back when it is gone
		a.metrics.JobSubmitted(opts.Class)
		a.recent.note(j.ID)
	} else if errors.Is(err, jobs.ErrUnavailable) {
		a.metrics.JobRefused()
	}
	return j, err
}

// Get reads a job, with a running denoise's step from the node running
// it (withLiveStep).
func (a *Agent) Get(ctx context.Context, id string) (jobs.Job, error) {
	j, err := a.getRecord(ctx, id)
	if err != nil {
		return j, err
	}
	return a.withLiveStep(ctx, j), nil
}

// getRecord reads a job from etcd; while etcd cannot answer with quorum,
// without it (getWithoutQuorum).
func (a *Agent) getRecord(ctx context.Context, id string) (j jobs.Job, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) error {
		j, err = a.store.Get(ctx, id)
		return err
	})
	if errors.Is(err, jobs.ErrUnavailable) {
		return a.getWithoutQuorum(ctx, id, err)
	}
	if err == nil {
		a.finished.Note(j)
	}
	return j, err
}

// Wait blocks until the job finishes or ctx ends; ctx, not EtcdTimeout,
// bounds it (it is a long poll), and its end is ctx.Err() itself. While
// etcd is down a finished job is answered without quorum at once, and one
// not finished is waited for until etcd is back: nothing commits without
// quorum.
func (a *Agent) Wait(ctx context.Context, id string) (jobs.Job, error) {
	for {
		if why := a.etcdDown(); why != nil {
			if j, err := a.getWithoutQuorum(ctx, id, why); err == nil && j.State.Terminal() {
				return j, nil
			}
			if err := a.awaitEtcd(ctx); err != nil {
				return jobs.Job{}, err
			}
			continue
		}
		tctx, done := a.health.TrackWait(ctx)
		j, err := a.store.Wait(tctx, id)
		switch {
		case err == nil:
			done(nil)
			a.finished.Note(j)
			return j, nil
		case ctx.Err() != nil:
			done(ctx.Err()) // the wait ran out: the caller answers with the job as it stands
			return jobs.Job{}, ctx.Err()
		}
		err = a.etcdErr(ctx, tctx, err)
		done(err)
		if !errors.Is(err, jobs.ErrUnavailable) {
			return jobs.Job{}, err
		}
		// etcd went down during the wait: wait on without it.
	}
}

// Cancel stops a job.
func (a *Agent) Cancel(ctx context.Context, id string) (j jobs.Job, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) error {
		j, err = a.store.Cancel(ctx, id)
		return err
	})
	return j, err
}

// Delete removes a finished job and its Store objects.
func (a *Agent) Delete(ctx context.Context, id string) error {
	a.finished.Forget(id) // first: a delete that goes unanswered may still land
	return a.onEtcd(ctx, func(ctx context.Context) error { return a.store.Delete(ctx, id) })
}

// StreamFrames streams a video's frame previews as they decode (httpapi.FrameStreamer).
func (a *Agent) StreamFrames(ctx context.Context, id string, emit func(jobs.Frame) error) (jobs.Job, error) {
	return a.store.StreamFrames(ctx, id, a.fetchObject, emit)
}
