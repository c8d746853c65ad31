package jobs

// This file holds how a claim ends a stage: Commit, Fail and Rewind, each
// one fenced read-modify-write of the job record (update) that also deletes
// the task and its claim, and renews retention leases etcd forgot.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
)

// Output is what a stage commits.
type Output struct {
	// Payloads are the stage's outputs, inputs of the next stage. Each
	// peer-to-peer payload is recorded under payloads/ until the next stage
	// commits; a Store payload's record is among Records.
	Payloads []Input
	// Hint names the preferred worker for the next stage ("" = anyone).
	Hint string
	// Push, if set, claims the next stage's task for Push.Node in the
	// commit (Push); its Node is then the Hint.
	Push *Push
	// Result describes the finished file (last stage only); its Store
	// object's record is among Records.
	Result *Result
	// Records are written in the commit's transaction: the records of the
	// Store objects the stage staged (a *cache.Staged), so they become
	// visible exactly when the stage commits.
	Records []StagedRecord
	// Work is how long the stage's work took on the worker; Pull is the
	// part of it spent pulling the input.
	Work, Pull time.Duration
	// Transport names what carried the input (StageRecord.Transport).
	Transport string
	// ResumedFrom, Checkpoints and CacheHits are StageRecord's.
	ResumedFrom, Checkpoints int
	CacheHits                []string
	// Next, when set (Store.NextTask), is the next stage's task's
	// identity, fixed before the commit so that every attempt writes the
	// one key (an attempt with no answer may have written it: its
	// producer's ledger counts it once its watch sees it). Unset, each
	// attempt makes one up; Claim.Next says which key the commit wrote.
	Next NextTask
}

// NextTask is the id, enqueue time and key of the task a commit creates in
// the next stage.
type NextTask struct {
	ID         string
	EnqueuedAt time.Time
	Key        string
}

// NextTask fixes the identity of the task c's commit will create in the
// next stage (zero after the last stage).
func (s *Store) NextTask(c *Claim) NextTask {
	next, last := c.Task.Stage.Next()
	if last {
		return NextTask{}
	}
	t := Task{ID: newID(), Stage: next, Class: c.Task.Class, EnqueuedAt: s.cfg.Now(), Dispatcher: c.Node}
	return NextTask{ID: t.ID, EnqueuedAt: t.EnqueuedAt, Key: s.taskKey(&t)}
}

// StagedRecord is a record a commit writes in its transaction. A record
// may live on a retention lease; when etcd no longer knows that lease (an
// etcd replaced or restored), Renew takes a fresh one and Op is asked again.
// *cache.Staged is one.
type StagedRecord interface {
	Op() clientv3.Op
	Renew(ctx context.Context) error
}

// leaseRenewals bounds how often one update renews leases etcd forgot: a
// lease granted a moment ago cannot be gone again unless etcd keeps
// losing them, and then the caller's retry (with backoff) is the place
// to wait, not a loop here.
const leaseRenewals = 3

// renewLeases forgets the job record's retention leases (the next
// recordOps grants fresh ones) and renews those of the staged records.
func (s *Store) renewLeases(ctx context.Context, leases []clientv3.LeaseID, records []StagedRecord) error {
	for _, l := range leases {
		s.ret.Forget(l)
	}
	for _, r := range records {
		if err := r.Renew(ctx); err != nil {
			return err
		}
	}
	return nil
}

// finishOps delete the task, its claim and its progress. A committed
// decode's frame previews outlive it a moment (DropPreviews): a client
// streaming them reads the last one after the commit that ends the job.
func (s *Store) finishOps(c *Claim) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpDelete(c.Task.Key),
		clientv3.OpDelete(s.ownKey(c)),
		clientv3.OpDelete(s.progressKey(c.Task.JobID)),
	}
}

// dropPreviews is the op deleting job id's frame previews (their records;
// each holder frees its copy).
func (s *Store) dropPreviews(id string) clientv3.Op {
	return clientv3.OpDelete(s.previewPrefix(id), clientv3.WithPrefix())
}

// DropPreviews deletes job id's frame previews, which its decode's commit
// left for the streams still reading them; their TTL deletes them if this
// never runs.
func (s *Store) DropPreviews(ctx context.Context, id string) error {
	if _, err := s.cli.Txn(ctx).Then(s.dropPreviews(id)).Commit(); err != nil {
		return fmt.Errorf("jobs: drop previews of %s: %w", id, err)
	}
	return nil
}

// update runs a fenced read-modify-write of the claim's job record: mutate
// edits the record and returns the extra ops of the transaction. It retries
// when only the job record changed under it (another writer, e.g. Cancel
// racing a commit), returns ErrFenced when the claim is gone, and ErrFinished
// (after dropping the claim) when the job was cancelled meanwhile.
//
// leaseGone, if not nil, is asked first when etcd refuses the transaction
// for a lease it does not know: true means it dropped what named that lease
// (a push to a worker whose lease ended), and the update goes again.
// carry, if not nil, returns more ops of the transaction that carry the
// record as written (raw): a push's claim (claimRecord.Record).
func (s *Store) update(ctx context.Context, c *Claim, what string, records []StagedRecord, leaseGone func() bool, mutate func(*record) ([]clientv3.Op, error), carry func(raw string) []clientv3.Op) error {
	fence, err := s.fenced(ctx, c) // first: an offered claim's job record is its write's
	if err != nil {
		return err
	}
	renewals := 0
	known, knownRev := c.jobRecord() // the record as last seen, if any
	for {
		var rec record
		var rev int64
		if known == nil || json.Unmarshal(known, &rec) != nil {
			var err error
			rec, rev, err = s.getRecord(ctx, c.Task.JobID)
			if errors.Is(err, ErrNotFound) {
				return s.dropFinished(ctx, c)
			}
			if err != nil {
				return err
			}
		} else {
			rev = knownRev
		}
		known = nil
		if rec.State.Terminal() {
			return s.dropFinished(ctx, c)
		}
		extra, err := mutate(&rec)
		if err != nil {
			return err
		}
		rec.UpdatedAt = s.cfg.Now()
		put, leases, raw, err := s.recordOps(ctx, rec)
		if err != nil {
			return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, err)
		}
		ops := append(s.finishOps(c), put...)
		ops = append(ops, extra...)
		if carry != nil {
			ops = append(ops, carry(raw)...)
		}
		for _, r := range records {
			ops = append(ops, r.Op())
		}
		ops = putsReplaceDeletes(ops)
		cmps := append(slices.Clip(fence), clientv3.Compare(clientv3.ModRevision(s.jobKey(rec.ID)), "=", rev))
		resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).
			Else(clientv3.OpGet(s.ownKey(c)), clientv3.OpGet(s.jobKey(rec.ID))).Commit()
		if cache.LeaseGone(err) && leaseGone != nil && leaseGone() {
			continue // (rare) the record is read again, since mutate edited this copy
		}
		if cache.LeaseGone(err) && renewals < leaseRenewals {
			// The error does not say whose lease is gone: renew them all.
			renewals++
			if rerr := s.renewLeases(ctx, leases, records); rerr != nil {
				return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, rerr)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, err)
		}
		if resp.Succeeded {
			c.CommitRev, c.JobCreatedAt = resp.Header.Revision, rec.CreatedAt
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 || kvs[0].ModRevision != c.Revision() || kvs[0].Lease != int64(c.Lease) {
			// A cancel deletes the claim with the task: say so, rather
			// than that the claim was lost.
			var now record
			if jk := resp.Responses[1].GetResponseRange().Kvs; len(jk) == 1 && json.Unmarshal(jk[0].Value, &now) == nil && now.State.Terminal() {
				return ErrFinished
			}
			return ErrFenced
		}
		// Claim intact: only the job record moved (or the claim's copy was
		// stale). Go again on the record the answer carries.
		if jk := resp.Responses[1].GetResponseRange().Kvs; len(jk) == 1 {
			known, knownRev = jk[0].Value, jk[0].ModRevision
		}
	}
}

// putsReplaceDeletes drops the deletes of single keys that ops also put,
// at the top or in a nested transaction (a commit's push writes the
// progress key that finishing a stage deletes): etcd refuses a
// transaction that names one key twice.
func putsReplaceDeletes(ops []clientv3.Op) []clientv3.Op {
	put := map[string]bool{}
	var note func(ops []clientv3.Op)
	note = func(ops []clientv3.Op) {
		for _, op := range ops {
			switch {
			case op.IsPut():
				put[string(op.KeyBytes())] = true
			case op.IsTxn(): // a staged record writes its holders' markers with it
				_, then, _ := op.Txn()
				note(then)
			}
		}
	}
	note(ops)
	out := ops[:0]
	for _, op := range ops {
		if op.IsDelete() && len(op.RangeBytes()) == 0 && put[string(op.KeyBytes())] {
			continue
		}
		out = append(out, op)
	}
	return out
}

// dropFinished ends a claim on a task of a finished (or vanished) job: the
// claim and the task itself go, so an orphan task left by a race with
// Cancel cannot be claimed again. It returns ErrFinished.
func (s *Store) dropFinished(ctx context.Context, c *Claim) error {
	fence, err := s.fenced(ctx, c)
	if err != nil {
		return err
	}
	ops := append(s.finishOps(c), s.dropPreviews(c.Task.JobID))
	if _, err := s.cli.Txn(ctx).If(fence...).Then(ops...).Commit(); err != nil {
		return fmt.Errorf("jobs: drop claim: %w", err)
	}
	return ErrFinished
}

// Commit finishes the claimed stage with out, atomically: the stage record, the
// next task or the result, the output payload records, and the release of the
// consumed inputs. ErrFenced means the claim was lost (lease expired): nothing
// was written and the caller must discard its output. ErrFinished means the job
// was cancelled meanwhile: the claim was dropped; discard the output too.
func (s *Store) Commit(ctx context.Context, c *Claim, out Output) (err error) {
	next, last := c.Task.Stage.Next()
	if last && (out.Result == nil || out.Result.Object == "") {
		return errors.New("jobs: commit of the last stage without a result object")
	}
	if !last && len(out.Payloads) == 0 {
		return fmt.Errorf("jobs: commit of %s without output payloads", c.Task.Stage)
	}
	push := out.Push
	dropPush := func() bool {
		if push == nil {
			return false
		}
		push = nil // the worker's lease ended: queue the task for anyone
		return true
	}
	var nextTask Task // made by the record's change, written by carry
	var pushAt time.Time
	defer func() {
		if err == nil && nextTask.Key != "" {
			c.Next = nextTask
			c.Next.Rev = c.CommitRev
		}
	}()
	return s.update(ctx, c, "commit", out.Records, dropPush, func(rec *record) ([]clientv3.Op, error) {
		nextTask = Task{}
		now := s.cfg.Now()
		nextTask = Task{}
		if rec.Stages == nil {
			rec.Stages = map[Stage]*StageRecord{}
		}
		rec.Stages[c.Task.Stage] = &StageRecord{
			Node: c.Node, Attempt: c.Task.Attempt, StartedAt: c.StartedAt, FinishedAt: now,
			Millis:      millis(out.Work),
			ClaimMillis: millis(c.ClaimedAt.Sub(c.StartedAt)),
			PullMillis:  millis(out.Pull),
			Transport:   out.Transport,
			ResumedFrom: out.ResumedFrom,
			Checkpoints: out.Checkpoints,
			CacheHits:   out.CacheHits,
		}
		ops := s.releaseOps(c.Task.Inputs)
		if c.Task.Stage == Denoise {
			ops = append(ops, s.releaseCheckpointsOps(rec)...)
		}
		if last {
			ops = append(ops, s.releaseInputsOps(rec)...)
			rec.State, rec.Stage, rec.TaskKey = Succeeded, "", ""
			res := *out.Result
			rec.Result = &res
			return ops, nil
		}
		t := Task{
			ID: newID(), JobID: rec.ID, Stage: next, Class: rec.Class, Transfer: rec.Transfer, Deadline: rec.Deadline, Spec: rec.Spec,
			Inputs: out.Payloads, Hint: out.Hint, EnqueuedAt: now,
			Checkpointing: rec.Checkpointing, Fork: rec.Fork, Rewinds: rec.Rewinds, Dispatcher: c.Node,
		}
		if out.Next.ID != "" {
			t.ID, t.EnqueuedAt = out.Next.ID, out.Next.EnqueuedAt
		}
		t.Key = s.taskKey(&t)
		for _, p := range out.Payloads {
			if !p.Store {
				ops = append(ops, clientv3.OpPut(s.payloadKey(p.Node, p.Payload), mustJSON(PayloadRecord{Input: p, Job: rec.ID, Stage: c.Task.Stage})))
			}
		}
		rec.State, rec.Stage, rec.TaskKey = Running, next, t.Key
		nextTask, pushAt = t, now
		return ops, nil
	}, func(raw string) []clientv3.Op {
		// The next task, pushed with the record, or written to wait.
		switch {
		case nextTask.Key == "":
			return nil // the last stage: no next task
		case push != nil:
			return s.pushOps(&nextTask, push, pushAt, raw)
		default:
			return []clientv3.Op{clientv3.OpPut(nextTask.Key, mustJSON(nextTask))}
		}
	})
}

// Fail ends the job with an error (a deterministic failure: retrying would
// fail the same way). Inputs are released.
func (s *Store) Fail(ctx context.Context, c *Claim, code, msg string) error {
	return s.update(ctx, c, "fail", nil, nil, func(rec *record) ([]clientv3.Op, error) {
		rec.State, rec.Stage, rec.TaskKey = Failed, "", ""
		rec.Error = &Error{Code: code, Message: msg}
		ops := append(s.releaseOps(c.Task.Inputs), s.releaseCheckpointsOps(rec)...)
		return append(ops, s.releaseInputsOps(rec)...), nil
	}, nil)
}

// Rewind restarts the job from its first stage because an input payload was
// lost with its producer. The engine is deterministic, so the output is the
// same. After MaxRewinds the job fails instead.
// The new encode task is c.Next: its dispatcher is c's node.
func (s *Store) Rewind(ctx context.Context, c *Claim, reason string) error {
	var next Task
	err := s.update(ctx, c, "rewind", nil, nil, func(rec *record) ([]clientv3.Op, error) {
		next = Task{}
		ops := s.releaseOps(c.Task.Inputs)
		if rec.Rewinds >= s.cfg.MaxRewinds {
			ops = append(ops, s.releaseCheckpointsOps(rec)...)
			ops = append(ops, s.releaseInputsOps(rec)...)
			rec.State, rec.Stage, rec.TaskKey = Failed, "", ""
			rec.Error = &Error{Code: "payload_lost", Message: fmt.Sprintf("input lost %d times; last: %s", rec.Rewinds+1, reason)}
			return ops, nil
		}
		rec.Rewinds++
		// Checkpoints stay: the same conditioning is encoded again (the
		// engine is deterministic), so the denoise resumes from them.
		t := Task{ID: newID(), JobID: rec.ID, Stage: Encode, Class: rec.Class, Transfer: rec.Transfer, Deadline: rec.Deadline, Spec: rec.Spec, EnqueuedAt: s.cfg.Now(),
			Checkpointing: rec.Checkpointing, Fork: rec.Fork, Rewinds: rec.Rewinds, Dispatcher: c.Node}
		t.Key = s.taskKey(&t)
		rec.Stage, rec.TaskKey = Encode, t.Key
		next = t
		return append(ops, clientv3.OpPut(t.Key, mustJSON(t))), nil
	}, nil)
	if err == nil && next.Key != "" {
		c.Next = next
		c.Next.Rev = c.CommitRev
	}
	return err
}

func millis(d time.Duration) float64 { return float64(max(d, 0).Microseconds()) / 1000 }
