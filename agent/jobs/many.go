package jobs

// This file holds the reads of status pages that cover several jobs or
// classes at once, each bounded: GetMany (at most MaxGetMany records in one
// transaction) and the per-class counts of a queue.

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/routing"
)

// MaxGetMany is the most ids GetMany reads at once: one transaction, well
// under etcd's default limit of 128 operations in a transaction.
const MaxGetMany = 64

// GetMany reads the records of ids in one transaction, in the order given,
// leaving out the ids etcd no longer holds (deleted, or past their
// retention). Progress is not filled in (Get does that, with one more read
// per job). More than MaxGetMany ids is an error.
func (s *Store) GetMany(ctx context.Context, ids []string) ([]Job, error) {
	if len(ids) > MaxGetMany {
		return nil, fmt.Errorf("jobs: get many: %d ids, at most %d", len(ids), MaxGetMany)
	}
	ops := make([]clientv3.Op, 0, len(ids))
	for _, id := range ids {
		if validID(id) {
			ops = append(ops, clientv3.OpGet(s.jobKey(id)))
		}
	}
	if len(ops) == 0 {
		return nil, nil
	}
	resp, err := s.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, fmt.Errorf("jobs: get many: %w", err)
	}
	out := make([]Job, 0, len(ops))
	for _, r := range resp.Responses {
		kvs := r.GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			continue
		}
		var rec record
		if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
			return nil, fmt.Errorf("jobs: decode job %s: %w", kvs[0].Key, err)
		}
		out = append(out, rec.Job)
	}
	return out, nil
}

// ClassDepth counts a stage's tasks by class (queued or running) and how
// many of them run, in one transaction of counts and a keys-only range:
// what a status page shows of a stage.
func (s *Store) ClassDepth(ctx context.Context, stage Stage) (byClass map[routing.Class]int64, running int64, err error) {
	classes := routing.Classes()
	ops := make([]clientv3.Op, 0, len(classes)+1)
	for _, c := range classes {
		// Task keys are <taskPrefix><class number>/<ns>-<task> (taskKey).
		ops = append(ops, clientv3.OpGet(s.taskPrefix(stage)+strconv.Itoa(int(c))+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()))
	}
	ops = append(ops, s.claimKeys(stage))
	resp, err := s.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, 0, fmt.Errorf("jobs: class depth %s: %w", stage, err)
	}
	byClass = make(map[routing.Class]int64, len(classes))
	for i, c := range classes {
		byClass[c] = resp.Responses[i].GetResponseRange().Count
	}
	return byClass, countClaims(resp.Responses[len(classes)].GetResponseRange().Kvs), nil
}
