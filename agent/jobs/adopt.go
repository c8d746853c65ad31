package jobs

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Orphans and adoption. A waiting task is followed by its dispatcher
// alone (Fed), so when that node leaves the mesh (it died, or drained)
// its tasks have nobody to hand them to a worker. Another node adopts
// them: it reads the stage's tasks (a range, once per departure and in a
// slow sweep, not per job), and rewrites each whose dispatcher is gone
// with itself as dispatcher, which ends the old dispatcher's part should
// it come back (its ledger sees the rewrite).

// Orphans reads the waiting tasks of stage (held by no claim that held
// says stands) whose dispatcher (for a task from before Task.Dispatcher,
// its producer) alive does not show, except those of node itself. A task
// held by a standing claim needs no dispatcher: its holder commits it, or
// gives it back, and a later sweep finds it then.
func (s *Store) Orphans(ctx context.Context, stage Stage, node string, alive func(node string) bool, held func(node string, lease int64) bool) ([]Task, error) {
	tasks, _, err := s.readQueue(ctx, stage)
	if err != nil {
		return nil, err
	}
	out := tasks[:0]
	for _, t := range tasks {
		d := t.Dispatcher
		if d == "" {
			d = t.Producer()
		}
		if d != node && !alive(d) && (t.Holder == "" || !held(t.Holder, t.HolderLease)) {
			out = append(out, t)
		}
	}
	return out, nil
}

// Adopt makes node the dispatcher of waiting task t, as read at t.Rev:
// one transaction, refused (ErrTaken) when the task changed since
// (another node adopted it, or it was claimed or is gone) or its last
// holder's claim is still there. It returns the task as written.
func (s *Store) Adopt(ctx context.Context, t Task, node string) (Task, error) {
	cmps := s.unheld(&t)
	t.Dispatcher = node
	resp, err := s.cli.Txn(ctx).If(cmps...).
		Then(clientv3.OpPut(t.Key, mustJSON(t))).Commit()
	if err != nil {
		return Task{}, fmt.Errorf("jobs: adopt %s: %w", t.ID, err)
	}
	if !resp.Succeeded {
		return Task{}, ErrTaken
	}
	t.Rev = resp.Header.Revision
	return t, nil
}
