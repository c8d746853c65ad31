package jobs

// This file holds the client side of the store: submitting a job, reading,
// waiting on and following it, cancelling and deleting it, streaming its
// frame previews, and the queue reads of status pages.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/cache"
)

// Submit stores a new job and its first task in one transaction: its
// encode, or its denoise when Options.Cond brings the conditioning from the
// cache. The job is durable once Submit returns.
func (s *Store) Submit(ctx context.Context, spec engine.Spec, opt Options) (Job, error) {
	j, _, err := s.SubmitTask(ctx, spec, opt)
	return j, err
}

// SubmitTask is Submit, returning the first task as written too: its
// dispatcher (Options.Dispatcher) follows it (Fed.Add). After a
// transaction that got no answer it returns the task's key and stage with
// the error: the task may exist.
func (s *Store) SubmitTask(ctx context.Context, spec engine.Spec, opt Options) (Job, Task, error) {
	class := opt.Class
	if !class.Valid() {
		return Job{}, Task{}, fmt.Errorf("jobs: invalid class %d", class)
	}
	if _, err := ParseTransferMode(string(opt.Transfer)); err != nil {
		return Job{}, Task{}, err
	}
	now := s.cfg.Now()
	if err := opt.Checkpointing.Check(spec.Steps); err != nil {
		return Job{}, Task{}, fmt.Errorf("jobs: %w", err)
	}
	first, stages := Encode, map[Stage]*StageRecord{}
	if len(opt.Cond) > 0 {
		// The conditioning is in the cache: no encode task, and a stage
		// record that says where it came from.
		for _, in := range opt.Cond {
			if !in.Cached || !in.Store || in.Payload == "" {
				return Job{}, Task{}, fmt.Errorf("jobs: conditioning input %q is not a cache entry", in.Payload)
			}
		}
		first = Denoise
		stages[Encode] = &StageRecord{Node: opt.Cond[0].Node, StartedAt: now, FinishedAt: now, Cached: true}
	}
	jobID := opt.JobID
	if jobID == "" {
		jobID = newID()
	} else if err := validJobID(jobID); err != nil {
		return Job{}, Task{}, err
	}
	t := Task{ID: newID(), JobID: jobID, Stage: first, Class: class, Transfer: opt.Transfer, Deadline: opt.Deadline, Spec: spec, EnqueuedAt: now,
		Inputs: opt.Cond, Checkpointing: opt.Checkpointing, Fork: opt.Fork, Dispatcher: opt.Dispatcher}
	t.Key = s.taskKey(&t)
	push := opt.Push
	rec := record{
		Job: Job{
			ID: t.JobID, Spec: spec, Class: class, Transfer: opt.Transfer, Deadline: opt.Deadline, State: Queued, Stage: first,
			Stages: stages, CreatedAt: now, UpdatedAt: now, Owner: opt.Owner,
			Checkpointing: opt.Checkpointing, Fork: opt.Fork, LatentFrames: opt.LatentFrames,
		},
		TaskKey: t.Key,
	}
	var written Task
	for renewals := 0; ; renewals++ {
		raw := mustJSON(rec)
		task, ops := t, []clientv3.Op{clientv3.OpPut(s.jobKey(t.JobID), raw)}
		for _, r := range opt.Records {
			ops = append(ops, r.Op())
		}
		if push != nil {
			ops = append(ops, s.pushOps(&task, push, now, raw)...)
		} else {
			ops = append(ops, clientv3.OpPut(t.Key, mustJSON(task)))
		}
		resp, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(s.jobKey(t.JobID)), "=", 0)).
			Then(ops...).
			Commit()
		if push != nil && cache.LeaseGone(err) {
			push = nil // the worker's lease ended: queue the task for anyone
			continue
		}
		if len(opt.Records) > 0 && cache.LeaseGone(err) && renewals < leaseRenewals {
			if rerr := s.renewLeases(ctx, nil, opt.Records); rerr != nil {
				return Job{}, Task{}, fmt.Errorf("jobs: submit: %w", rerr)
			}
			continue
		}
		if err != nil {
			// It may have been written all the same: its dispatcher's
			// ledger counts it once its watch sees it.
			return Job{}, Task{}, fmt.Errorf("jobs: submit: %w", err)
		}
		if !resp.Succeeded {
			return Job{}, Task{}, fmt.Errorf("jobs: submit: job id %s collided", t.JobID)
		}
		written = task
		written.Rev = resp.Header.Revision
		break
	}
	s.log.Debug("submitted", zap.String("job", t.JobID), zap.Stringer("class", class))
	return rec.Job, written, nil
}

// Get returns a job with the running stage's progress.
func (s *Store) Get(ctx context.Context, id string) (Job, error) { return s.get(ctx, id) }

// GetSerializable is Get answered by the member the client reaches, from
// its own data, without quorum (clientv3.WithSerializable): it works while
// etcd has no leader, and may lag the cluster. A finished job's record
// never changes but by its deletion, so read this way it is as good as
// Get's; a running job's is as that member last knew it. ErrNotFound from
// it may only mean the member has not seen the job yet.
func (s *Store) GetSerializable(ctx context.Context, id string) (Job, error) {
	return s.get(ctx, id, clientv3.WithSerializable())
}

func (s *Store) get(ctx context.Context, id string, opts ...clientv3.OpOption) (Job, error) {
	rec, _, _, err := s.readRecord(ctx, id, opts...)
	if err != nil {
		return Job{}, err
	}
	job := rec.Job
	if !job.State.Terminal() {
		resp, err := s.cli.Get(ctx, s.progressKey(id), opts...)
		if err != nil {
			return Job{}, fmt.Errorf("jobs: progress %s: %w", id, err)
		}
		if len(resp.Kvs) == 1 {
			var p Progress
			if json.Unmarshal(resp.Kvs[0].Value, &p) == nil {
				job.Progress = &p
				job.State = Running
			}
		}
	}
	return job, nil
}

// Wait blocks until the job is in a terminal state or ctx is done. It opens
// one watch of the job's ended key (keys.go), waits until etcd has created
// it, then reads the record, and returns at the record that key's event
// carries: the transaction that finishes a job writes it, so a waiter sees
// one event a job, not one a stage. The order matters: a watch asked to
// start at a revision etcd has already passed (the read's) is served by
// etcd's unsynced-watcher loop, up to 100 ms later, which was most of a
// tiny job's latency; a watch from now never is, and the read after it
// misses nothing. A broken watch starts over.
func (s *Store) Wait(ctx context.Context, id string) (Job, error) {
	if !validID(id) {
		return Job{}, ErrNotFound
	}
	for {
		wctx, cancel := context.WithCancel(ctx)
		job, done, err := s.waitOnce(wctx, id)
		cancel()
		if done || err != nil {
			return job, err
		}
		if err := ctx.Err(); err != nil {
			return Job{}, err
		}
	}
}

// Changes signals, until ctx ends, each time the job's record or its
// progress key (which node runs which stage) may have changed: a read of
// Get after a signal sees the change. It signals once when its watches are
// in place, and again whenever they had to start over (a broken or
// compacted watch), since a change may have been missed then. One signal
// may stand for several changes. The job's event stream follows it.
func (s *Store) Changes(ctx context.Context, id string) <-chan struct{} {
	ch := make(chan struct{}, 1)
	signal := func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	follow := func(key string) {
		for ctx.Err() == nil {
			wctx, cancel := context.WithCancel(ctx)
			for wr := range s.cli.Watch(wctx, key, clientv3.WithCreatedNotify()) {
				if wr.Canceled || wr.Err() != nil {
					break
				}
				signal() // created (the read after it misses nothing) or an event
			}
			cancel()
			select { // a watch that ends at once is not tried in a loop
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	go follow(s.jobKey(id))
	go follow(s.progressKey(id))
	return ch
}

// waitOnce is one watch of Wait: done when the job is terminal; neither
// done nor an error when the watch ended first.
func (s *Store) waitOnce(ctx context.Context, id string) (job Job, done bool, err error) {
	wch := s.cli.Watch(ctx, s.endedKey(id), clientv3.WithCreatedNotify())
	select {
	case wr, ok := <-wch:
		if !ok || wr.Canceled || wr.Err() != nil {
			return Job{}, false, ctx.Err()
		}
	case <-ctx.Done():
		return Job{}, false, ctx.Err()
	}
	rec, _, err := s.getRecord(ctx, id)
	if err != nil {
		return Job{}, false, err
	}
	if rec.State.Terminal() {
		return rec.Job, true, nil
	}
	for wr := range wch {
		if wr.Canceled || wr.Err() != nil {
			return Job{}, false, nil
		}
		for _, ev := range wr.Events {
			// A put is the finishing transaction's copy of the record (its
			// lease ending deletes it, long after).
			var rec record
			if ev.Type == clientv3.EventTypePut && json.Unmarshal(ev.Kv.Value, &rec) == nil && rec.State.Terminal() {
				return rec.Job, true, nil
			}
		}
	}
	return Job{}, false, ctx.Err()
}

// Cancel stops a job: its queued task, the task's claim and its unconsumed
// inputs are deleted, a marker beside the claim tells its holder's inbox
// (which sees no deletions), and a worker running it will find its claim
// gone when it tries to commit.
func (s *Store) Cancel(ctx context.Context, id string) (Job, error) {
	mark := true // tell the task's holder, on its lease (gone: no marker)
	for {
		marked := false // this try puts a marker
		rec, rev, err := s.getRecord(ctx, id)
		if err != nil {
			return Job{}, err
		}
		if rec.State.Terminal() {
			return rec.Job, ErrFinished
		}
		ops := []clientv3.Op{
			clientv3.OpDelete(s.progressKey(id)),
			s.dropPreviews(id),
		}
		if rec.TaskKey != "" {
			ops = append(ops, clientv3.OpDelete(rec.TaskKey))
			t, err := s.readTask(ctx, rec.TaskKey)
			switch {
			case err == nil:
				// The claim goes too: a worker running the task is fenced
				// off, and one it was pushed to that had not started it
				// would otherwise keep the claim as long as its lease.
				if k := s.heldKey(&t); k != "" {
					ops = append(ops, clientv3.OpDelete(k))
					if mark && t.HolderLease != 0 {
						marked = true
						// The holder's inbox takes puts only: a marker
						// beside the claim tells it (Inbox).
						ops = append(ops, clientv3.OpPut(k+cancelSuffix, "", clientv3.WithLease(clientv3.LeaseID(t.HolderLease))))
					}
				}
				ops = append(ops, s.releaseOps(t.Inputs)...)
			case !errors.Is(err, ErrNotFound):
				// Without the task we cannot release its inputs: do not cancel half-way.
				return Job{}, fmt.Errorf("jobs: cancel %s: read task: %w", id, err)
			}
		}
		ops = append(ops, s.releaseCheckpointsOps(&rec)...)
		ops = append(ops, s.releaseInputsOps(&rec)...)
		rec.State, rec.Stage, rec.TaskKey = Cancelled, "", ""
		rec.UpdatedAt = s.cfg.Now()
		rec.Error = &Error{Code: "cancelled", Message: "cancelled by request"}
		put, leases, _, err := s.recordOps(ctx, rec)
		if err != nil {
			return Job{}, fmt.Errorf("jobs: cancel %s: %w", id, err)
		}
		ops = append(ops, put...)
		resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(s.jobKey(id)), "=", rev)).Then(ops...).Commit()
		if cache.LeaseGone(err) && marked {
			mark = false // the holder's lease, maybe: its claim went with it; the next try says
			continue
		}
		if s.leaseGone(err, leases) {
			continue
		}
		if err != nil {
			return Job{}, fmt.Errorf("jobs: cancel %s: %w", id, err)
		}
		if resp.Succeeded {
			return rec.Job, nil
		}
		// The job moved on (a stage committed) between read and write: retry.
	}
}

func (s *Store) readTask(ctx context.Context, key string) (Task, error) {
	resp, err := s.cli.Get(ctx, key)
	if err != nil {
		return Task{}, err
	}
	if len(resp.Kvs) == 0 {
		return Task{}, ErrNotFound
	}
	var t Task
	if err := json.Unmarshal(resp.Kvs[0].Value, &t); err != nil {
		return Task{}, err
	}
	t.Key, t.Rev = key, resp.Kvs[0].ModRevision
	return t, nil
}

// Pending reads the waiting tasks of a stage, every one of them (those no
// live claim guards), and the etcd revision they were read at. Workers do
// not call it: tasks come to them (Inbox); tools and tests do.
func (s *Store) Pending(ctx context.Context, stage Stage) ([]Task, int64, error) {
	tasks, rev, err := s.readQueue(ctx, stage)
	if err != nil {
		return nil, 0, err
	}
	resp, err := s.cli.Get(ctx, s.claimPrefix(stage), clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithRev(rev))
	if err != nil {
		return nil, 0, fmt.Errorf("jobs: read %s claims: %w", stage, err)
	}
	claimed := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		claimed[string(kv.Key)] = true
	}
	out := tasks[:0]
	for _, t := range tasks {
		if k := s.heldKey(&t); k == "" || !claimed[k] {
			out = append(out, t)
		}
	}
	return out, rev, nil
}

// Depth counts a stage's tasks, queued (unclaimed) and running (claimed), at
// etcd revision rev: a count and a keys-only range, for a status page and
// tools (nobody follows a whole stage).
func (s *Store) Depth(ctx context.Context, stage Stage) (queued, running, rev int64, err error) {
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(s.taskPrefix(stage), clientv3.WithPrefix(), clientv3.WithCountOnly()),
		s.claimKeys(stage),
	).Commit()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("jobs: depth %s: %w", stage, err)
	}
	total := resp.Responses[0].GetResponseRange().Count
	running = countClaims(resp.Responses[1].GetResponseRange().Kvs)
	return total - running, running, resp.Header.Revision, nil
}

// claimKeys reads the names of stage's claim keys (cancel markers among
// them: countClaims leaves those out).
func (s *Store) claimKeys(stage Stage) clientv3.Op {
	return clientv3.OpGet(s.claimPrefix(stage), clientv3.WithPrefix(), clientv3.WithKeysOnly())
}

// countClaims counts the claim keys among kvs, leaving out cancel markers.
func countClaims(kvs []*mvccpb.KeyValue) int64 {
	n := int64(0)
	for _, kv := range kvs {
		if !strings.HasSuffix(string(kv.Key), cancelSuffix) {
			n++
		}
	}
	return n
}

// Frame is one decoded frame preview.
type Frame struct {
	Index int
	PNG   []byte
}

// StreamFrames calls emit with each frame preview of the job as it is
// decoded, in the order they appear, until the job is terminal (returned) or
// ctx ends. Previews are Store objects (PreviewID); fetch reads one's bytes,
// and a preview freed before it could be read is skipped. A frame decoded
// twice (a retried decode) is emitted once.
func (s *Store) StreamFrames(ctx context.Context, id string, fetch func(context.Context, cache.Record) ([]byte, error), emit func(Frame) error) (Job, error) {
	rec, _, err := s.getRecord(ctx, id)
	if err != nil {
		return Job{}, err
	}
	sent := map[int]bool{}
	send := func(val []byte) error {
		var obj cache.Record
		if json.Unmarshal(val, &obj) != nil {
			return nil
		}
		var f int
		if _, err := fmt.Sscanf(strings.TrimPrefix(obj.ID, previewsOf(id)), "%d", &f); err != nil || sent[f] {
			return nil
		}
		png, err := fetch(ctx, obj)
		if err != nil {
			s.log.Debug("preview unreadable; skipped", zap.String("job", id), zap.Int("frame", f), zap.Error(err))
			return nil
		}
		sent[f] = true
		return emit(Frame{Index: f, PNG: png})
	}
	if rec.State.Terminal() {
		return rec.Job, nil
	}
	// Read what is there, then watch previews and the job from that revision.
	resp, err := s.cli.Get(ctx, s.previewPrefix(id), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return Job{}, fmt.Errorf("jobs: frames %s: %w", id, err)
	}
	for _, kv := range resp.Kvs {
		if err := send(kv.Value); err != nil {
			return Job{}, err
		}
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	frames := s.cli.Watch(wctx, s.previewPrefix(id), clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1), clientv3.WithFilterDelete())
	jobs := s.cli.Watch(wctx, s.jobKey(id), clientv3.WithRev(resp.Header.Revision+1))
	for {
		select {
		case <-ctx.Done():
			return Job{}, ctx.Err()
		case wr, ok := <-frames:
			if !ok {
				return Job{}, fmt.Errorf("jobs: frame watch of %s ended", id)
			}
			for _, ev := range wr.Events {
				if err := send(ev.Kv.Value); err != nil {
					return Job{}, err
				}
			}
		case wr, ok := <-jobs:
			if !ok {
				return Job{}, fmt.Errorf("jobs: job watch of %s ended", id)
			}
			job, err := s.Get(ctx, id)
			if err != nil {
				return Job{}, err
			}
			if job.State.Terminal() {
				// The two watches deliver apart: a preview put before the
				// write that ended the job may not have reached the frame
				// watch yet. Send what it has up to that write first.
				return job, s.framesUpTo(wctx, frames, wr.Header.Revision, send)
			}
		}
	}
}

// framesUpTo sends, from frames (a watch of a job's previews), every event
// up to revision rev: it asks etcd for the watches' progress, which etcd
// reports after every event below the revision it names, and waits for
// it at most framesDrain.
func (s *Store) framesUpTo(ctx context.Context, frames clientv3.WatchChan, rev int64, send func([]byte) error) error {
	ctx, cancel := context.WithTimeout(ctx, framesDrain)
	defer cancel()
	if err := s.cli.RequestProgress(ctx); err != nil {
		return nil // no progress to wait for: what was sent stands
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case wr, ok := <-frames:
			if !ok {
				return nil
			}
			for _, ev := range wr.Events {
				if err := send(ev.Kv.Value); err != nil {
					return err
				}
			}
			// Only a progress report vouches for every event below its
			// revision: an events response's may run ahead of them.
			if wr.IsProgressNotify() && wr.Header.Revision >= rev {
				return nil
			}
		}
	}
}

// framesDrain bounds how long a finished job's frame stream waits for the
// previews put before its end (a watch's progress comes in milliseconds).
const framesDrain = 2 * time.Second

// States reads the states of jobs ids, a hundred per transaction; a job
// that does not exist (deleted, or its record expired) is absent from the
// map.
func (s *Store) States(ctx context.Context, ids []string) (map[string]State, error) {
	out := make(map[string]State, len(ids))
	for len(ids) > 0 {
		batch := ids[:min(len(ids), 100)] // etcd allows 128 operations per transaction
		ids = ids[len(batch):]
		ops := make([]clientv3.Op, 0, len(batch))
		for _, id := range batch {
			if validID(id) {
				ops = append(ops, clientv3.OpGet(s.jobKey(id)))
			}
		}
		resp, err := s.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, fmt.Errorf("jobs: read states: %w", err)
		}
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				var rec record
				if json.Unmarshal(kv.Value, &rec) == nil {
					out[rec.ID] = rec.State
				}
			}
		}
	}
	return out, nil
}

// Delete removes a finished job: its record and every Store object it owns
// (result, previews), whose holders then free their copies. A job still
// queued or running is ErrNotFinished's to cancel first.
func (s *Store) Delete(ctx context.Context, id string) error {
	for range 3 {
		done, err := s.deleteOnce(ctx, id)
		if done || err != nil {
			return err
		}
	}
	return fmt.Errorf("jobs: delete %s: the job or its result kept changing; try again", id)
}

// deleteOnce is one try of Delete: done is false when the job's record
// or its result's changed between the read and the write.
func (s *Store) deleteOnce(ctx context.Context, id string) (done bool, err error) {
	rec, rev, err := s.getRecord(ctx, id)
	if err != nil {
		return false, err
	}
	if !rec.State.Terminal() {
		return false, fmt.Errorf("%w: job %s is %s", ErrNotFinished, id, rec.State)
	}
	// The result's holders follow its record by their markers alone
	// (cache.byMarkerOnly): its markers go with it. The job's other
	// objects' holders watch their records.
	resultKey := cache.ObjectKey(s.cfg.Prefix, ResultID(id))
	res, err := s.cli.Get(ctx, resultKey)
	if err != nil {
		return false, fmt.Errorf("jobs: delete %s: %w", id, err)
	}
	var resultRev int64
	ops := []clientv3.Op{
		clientv3.OpDelete(s.jobKey(id)),
		clientv3.OpDelete(s.endedKey(id)),
		clientv3.OpDelete(s.objectsOf(id), clientv3.WithPrefix()),
	}
	if len(res.Kvs) == 1 {
		resultRev = res.Kvs[0].ModRevision
		ops = append(ops, cache.MarkerDeletes(s.cfg.Prefix, res.Kvs[0])...)
	}
	resp, err := s.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.ModRevision(s.jobKey(id)), "=", rev),
		clientv3.Compare(clientv3.ModRevision(resultKey), "=", resultRev),
	).Then(ops...).Commit()
	if err != nil {
		return false, fmt.Errorf("jobs: delete %s: %w", id, err)
	}
	return resp.Succeeded, nil
}
