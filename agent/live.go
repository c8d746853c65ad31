package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/agent/progress"
)

// Live progress: a denoise step costs etcd nothing. The worker puts each
// step on its progress.Board; etcd's progress key, written with the claim,
// says only which node runs the stage, and whoever answers a client asks
// that node (agent/progress, over libp2p) how far it is.

// liveAsk bounds one question to the running node, so that a GET of a
// running job answers within it whatever that node does.
const liveAsk = 250 * time.Millisecond

// withLiveStep fills a running denoise's step from the node that runs it.
// The job comes back unchanged when that node cannot say (it just finished,
// died or is out of reach): the step is advisory, the record is the truth.
func (a *Agent) withLiveStep(ctx context.Context, j jobs.Job) jobs.Job {
	p := j.Progress
	if p == nil || p.Stage != jobs.Denoise {
		return j
	}
	ctx, cancel := context.WithTimeout(ctx, liveAsk)
	defer cancel()
	st, ok, err := a.askStep(ctx, p.Node, j.ID, progress.Cursor{}, 0)
	if err != nil {
		a.log.Debug("live progress", zap.String("job", j.ID), zap.String("node", p.Node), zap.Error(err))
	}
	if ok && st.Stage == string(p.Stage) {
		cp := *p
		cp.Step, cp.Total = st.Step, st.Total
		j.Progress = &cp
	}
	return j
}

// askStep asks node, this one included, for job's step once it passes
// after, waiting at most wait for that.
func (a *Agent) askStep(ctx context.Context, node, job string, after progress.Cursor, wait time.Duration) (progress.Step, bool, error) {
	if node == a.id {
		wctx, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		st, ok := a.board.Next(wctx, job, after)
		return st, ok, nil
	}
	m := a.members.Load()
	if m == nil {
		return progress.Step{}, false, fmt.Errorf("agent: membership not started")
	}
	rec, ok := m.Peer(node)
	if !ok || !rec.Registered {
		return progress.Step{}, false, fmt.Errorf("agent: %s is not a registered member", node)
	}
	pid, err := peer.Decode(rec.Record.PeerID)
	if err != nil {
		return progress.Step{}, false, fmt.Errorf("agent: %s's peer id: %w", node, err)
	}
	return progress.Ask(ctx, a.host, progress.Peer{ID: pid, Addrs: rec.Record.P2PAddrs}, job, after, wait)
}

// followWait is how long one question of a step stream is held open at
// the running node; the follower asks again when it runs out. finishWait
// bounds how long a stream waits, once the stage has moved on, for its
// follower to deliver the last steps.
const (
	followWait = time.Second
	finishWait = time.Second
)

// StreamEvents calls onJob with the job as it stands and again at each
// change of its state or running stage, and onStep with each denoise step
// as the node running it reaches it, until the job is terminal; it returns
// the finished job (httpapi.EventStreamer). The job's changes come from a
// watch of its record and progress key (jobs.Store.Changes), the steps
// from the running node (askStep), held open as a long poll per step.
func (a *Agent) StreamEvents(ctx context.Context, id string, onJob func(jobs.Job) error, onStep func(jobs.Step) error) (jobs.Job, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	changes := a.store.Changes(ctx, id)
	steps := make(chan followed)
	var (
		last       jobs.Job
		following  string // the node followed now, "" for none
		stopFollow = func() {}
		ended      = make(chan string, 1) // a follower whose node stopped running the job
		// seen is, per node, the last step sent: a follower started again
		// for a node (its stage's record changed) goes on from there, and
		// a retry there, a new run, from its start.
		seen = map[string]progress.Cursor{}
	)
	send := func(f followed) error {
		seen[f.step.Node] = f.cur
		return onStep(f.step)
	}
	defer func() { stopFollow() }()
	// pump forwards the follower's steps until the record may have changed
	// or, draining a stage that moved on, until its follower ends or
	// finishWait passes: the last step often lands with the commit.
	pump := func(drain bool) error {
		recordChanged, timeout := changes, (<-chan time.Time)(nil)
		if drain {
			if following == "" {
				return nil
			}
			t := time.NewTimer(finishWait)
			defer t.Stop()
			recordChanged, timeout = nil, t.C
		}
		for {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-recordChanged:
				return nil
			case <-timeout:
				return nil
			case node := <-ended:
				if node == following {
					following = "" // followed again if the record still names it
					if drain {
						return nil
					}
				}
			case f := <-steps:
				if err := send(f); err != nil {
					return err
				}
			}
		}
	}
	for first := true; ; first = false {
		j, err := a.getRecord(ctx, id)
		if err != nil {
			return jobs.Job{}, err
		}
		node := runningDenoise(j)
		if node != following || j.State.Terminal() {
			err := pump(true)
			stopFollow()
			if err != nil {
				return jobs.Job{}, err
			}
			following, stopFollow = "", func() {}
		}
		if first || jobChanged(last, j) {
			if err := onJob(j); err != nil {
				return jobs.Job{}, err
			}
		}
		last = j
		if j.State.Terminal() {
			return j, nil
		}
		if node != "" && node != following {
			following = node
			fctx, fcancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() {
				defer close(done)
				a.followSteps(fctx, node, id, seen[node], steps, ended)
			}()
			stopFollow = func() { fcancel(); <-done }
		}
		if err := pump(false); err != nil {
			return jobs.Job{}, err
		}
	}
}

// followed is one step a follower found, and the cursor it reached.
type followed struct {
	step jobs.Step
	cur  progress.Cursor
}

// followSteps sends each step of job that node reaches past from to steps,
// until ctx ends or node says nothing more will come (then it sends node
// to ended). A node that cannot be asked is asked again a little later:
// the job's record, not this follower, says when the stage moved. So is a
// node that runs nothing of the job yet, until it has shown a step: its
// claim, and the progress key that names it, come before it starts (a
// task its dispatcher handed on is claimed for it, then pulled), and a
// stream that gave up then saw no step of the stage (TestProgressOffRaft).
func (a *Agent) followSteps(ctx context.Context, node, job string, from progress.Cursor, steps chan<- followed, ended chan<- string) {
	cur := from
	for ctx.Err() == nil {
		st, ok, err := a.askStep(ctx, node, job, cur, followWait)
		switch {
		case err != nil || (!ok && cur == from):
			if err != nil {
				a.log.Debug("following progress", zap.String("job", job), zap.String("node", node), zap.Error(err))
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		case !ok:
			select {
			case ended <- node:
			case <-ctx.Done():
			}
			return
		}
		next := progress.Cursor{Run: st.Run, Step: st.Step}
		if next == cur || st.Step == 0 {
			cur = next // the wait ran out with nothing new, or a new run not yet at its first step
			continue
		}
		cur = next
		select {
		case steps <- followed{step: jobs.Step{Stage: jobs.Stage(st.Stage), Step: st.Step, Total: st.Total, Node: node, At: st.At}, cur: cur}:
		case <-ctx.Done():
		}
	}
}

// runningDenoise is the node running the job's denoise, or "".
func runningDenoise(j jobs.Job) string {
	if p := j.Progress; p != nil && p.Stage == jobs.Denoise {
		return p.Node
	}
	return ""
}

// jobChanged reports whether a client following the job would see a
// change from a to b: its state, running stage or node, or stages done.
func jobChanged(a, b jobs.Job) bool {
	if a.State != b.State || len(a.Stages) != len(b.Stages) || (a.Progress == nil) != (b.Progress == nil) {
		return true
	}
	return a.Progress != nil && (a.Progress.Stage != b.Progress.Stage || a.Progress.Node != b.Progress.Node)
}
