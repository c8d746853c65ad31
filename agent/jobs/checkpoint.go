package jobs

// This file holds the durable side of step checkpoints: a denoise's
// sampler state as a Store object of its job, written one transaction per
// checkpoint and released with the stage that made it, and the fork of a
// job from one of them.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
)

// Checkpointing is a request's choice of step checkpoints.
type Checkpointing struct {
	// Every is the steps between checkpoints; nil means the model's
	// registered default, else the agent's (--checkpoint-every), and 0
	// none. Preemption and drain checkpoint where they stop regardless.
	Every *int `json:"every,omitempty"`
	// Keep keeps the job's checkpoints this long after they were written
	// (for forks: POST /v1/jobs/{id}/fork); 0 releases them when the
	// denoise stage commits.
	Keep time.Duration `json:"keep,omitempty"`
}

// MaxCheckpointKeep bounds Checkpointing.Keep.
const MaxCheckpointKeep = 7 * 24 * time.Hour

// Check validates a request's checkpointing for a job of steps steps.
func (c *Checkpointing) Check(steps int) error {
	switch {
	case c == nil:
		return nil
	case c.Every != nil && (*c.Every < 0 || *c.Every >= max(steps, 1) && *c.Every != 0):
		return fmt.Errorf("checkpoint_every %d: want 0 (none) or 1 to %d (fewer than the steps)", *c.Every, steps-1)
	case c.Keep < 0 || c.Keep > MaxCheckpointKeep:
		return fmt.Errorf("keep_checkpoints %s: want 0 to %s", c.Keep, MaxCheckpointKeep)
	}
	return nil
}

// ForkFrom names the checkpoint a forked job's denoise starts from: the
// sampler state after Step of job Job's denoise, in Store object Object.
type ForkFrom struct {
	Job    string `json:"job"`
	Step   int    `json:"step"`
	Object string `json:"object"`
}

// CheckpointID names the Store object of job's denoise checkpoint after
// step. The steps are zero-padded so that the ids sort by step.
func CheckpointID(job string, step int) string {
	return cache.JobObjectID(job, fmt.Sprintf("%s%06d", checkpointTag, step))
}

const checkpointTag = "ckpt."

// CheckpointsOf is the id prefix of job's checkpoint objects.
func CheckpointsOf(job string) string { return cache.JobObjectID(job, checkpointTag) }

// CheckpointStep is the step a checkpoint object id of job names.
func CheckpointStep(job, id string) (int, bool) {
	rest, ok := strings.CutPrefix(id, CheckpointsOf(job))
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil && n > 0
}

// checkpointPrefix is the key prefix of job id's checkpoint records.
func (s *Store) checkpointPrefix(id string) string {
	return cache.ObjectKey(s.cfg.Prefix, CheckpointsOf(id))
}

// releaseCheckpointsOps delete the job's checkpoint records (their holders
// then free the copies), unless rec keeps them for forks.
func (s *Store) releaseCheckpointsOps(rec *record) []clientv3.Op {
	if rec.Checkpointing != nil && rec.Checkpointing.Keep > 0 {
		return nil
	}
	return []clientv3.Op{clientv3.OpDelete(s.checkpointPrefix(rec.ID), clientv3.WithPrefix())}
}

// SaveCheckpoint makes a staged checkpoint object visible and deletes the
// record of the one it replaces (prev, "" for none), in one transaction
// fenced by c's claim: a worker that lost its claim writes nothing, and
// the task's next worker finds the newest checkpoint of the current one.
// ErrFenced means the claim is gone; the caller aborts the staged copies.
func (s *Store) SaveCheckpoint(ctx context.Context, c *Claim, st StagedRecord, prev string) error {
	fence, err := s.fenced(ctx, c)
	if err != nil {
		return err
	}
	ops := []clientv3.Op{st.Op()}
	if prev != "" {
		ops = append(ops, clientv3.OpDelete(cache.ObjectKey(s.cfg.Prefix, prev)))
	}
	for renewals := 0; ; renewals++ {
		resp, err := s.cli.Txn(ctx).If(fence...).Then(ops...).Commit()
		if cache.LeaseGone(err) && renewals < leaseRenewals {
			if rerr := st.Renew(ctx); rerr != nil {
				return fmt.Errorf("jobs: checkpoint of %s: %w", c.Task.JobID, rerr)
			}
			ops[0] = st.Op()
			continue
		}
		if err != nil {
			return fmt.Errorf("jobs: checkpoint of %s: %w", c.Task.JobID, err)
		}
		if !resp.Succeeded {
			return ErrFenced
		}
		return nil
	}
}

// ErrNoCheckpoint means a fork asked for a step its job has no checkpoint
// of: the job did not keep its checkpoints (keep_checkpoints), its
// checkpoint_every does not divide the step, or their retention passed.
var ErrNoCheckpoint = errors.New("jobs: no checkpoint at that step")

// ForkPoint reads job id and the checkpoint of its denoise after step, in
// one read: what a fork of it from that step starts from.
func (s *Store) ForkPoint(ctx context.Context, id string, step int) (Job, ForkFrom, error) {
	if !validID(id) {
		return Job{}, ForkFrom{}, ErrNotFound
	}
	obj := CheckpointID(id, step)
	resp, err := s.cli.Txn(ctx).Then(clientv3.OpGet(s.jobKey(id)), clientv3.OpGet(cache.ObjectKey(s.cfg.Prefix, obj))).Commit()
	if err != nil {
		return Job{}, ForkFrom{}, fmt.Errorf("jobs: fork point of %s: %w", id, err)
	}
	jk, ok := resp.Responses[0].GetResponseRange().Kvs, false
	if len(jk) == 0 {
		return Job{}, ForkFrom{}, ErrNotFound
	}
	var rec record
	if err := json.Unmarshal(jk[0].Value, &rec); err != nil {
		return Job{}, ForkFrom{}, fmt.Errorf("jobs: job %s: %w", id, err)
	}
	ok = len(resp.Responses[1].GetResponseRange().Kvs) == 1
	if !ok {
		return rec.Job, ForkFrom{}, ErrNoCheckpoint
	}
	return rec.Job, ForkFrom{Job: id, Step: step, Object: obj}, nil
}
