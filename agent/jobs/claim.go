package jobs

// This file holds how a worker takes and gives back a task: the claim (made
// by the worker, or pushed to it by the task's creator), its fencing, a
// reclaim under a new lease, and the give-backs (Drop, Abandon, Requeue,
// Yield). Commit and its siblings, which end a claim, are in commit.go.

import (
	"context"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Claim is a worker's hold on a task.
type Claim struct {
	Task      Task
	Node      string
	Lease     clientv3.LeaseID
	Rev       int64 // the claim key's ModRevision: the fencing token (see fenced)
	StartedAt time.Time
	ClaimedAt time.Time // when the claim transaction answered
	// CommitRev is the etcd revision of the claim's successful commit (or
	// fail, or rewind): the next stage's task exists from there on.
	CommitRev int64
	// NextKey is the key of the next stage's task that commit created
	// ("" after any other end): its producer counts it until it goes (Fed).
	NextKey string
	// JobCreatedAt is the job's submission time as that commit read the
	// job record (zero before one): end-to-end latency for metrics.
	JobCreatedAt time.Time

	// job is the job record as the claim read it, and jobRev its
	// ModRevision: the first commit attempt writes on it without reading
	// the record again (a stale copy fails the commit's comparison, whose
	// answer carries the fresh record). nil: read it.
	job    []byte
	jobRev int64

	// Pushed: the claim was made for this node when its task was created
	// (Push), not by the node itself; the node has not started it yet.
	Pushed bool
}

// claimRecord is what a claim key holds, for operators and status pages.
type claimRecord struct {
	Task      string    `json:"task"`
	Job       string    `json:"job"`
	Node      string    `json:"node"`
	StartedAt time.Time `json:"started_at"`
	// Pushed marks a claim made for Node by the task's creator (Push).
	Pushed bool `json:"pushed,omitempty"`
}

// Push names the worker a task is claimed for as it is created, in the
// same transaction: the producer's hint, a worker with a free slot, and
// the etcd lease its claims live on. The claim is that worker's as if it
// had made it (fenced by its revision, gone with the lease), so nobody
// races for the task and the worker starts it without a claim
// transaction of its own: a handoff costs one etcd write (the
// producer's commit) instead of two. The worker finds it in its Queue view
// (Queue.Pushed), starts it when it has a slot and it comes first in its
// queue's order, and gives it back (Requeue) when it cannot start it soon
// while another worker could.
type Push struct {
	Node  string
	Lease clientv3.LeaseID
}

// pushOps are a push's writes for new task t (Attempt and Hint already
// set): its claim and progress key on the worker's lease.
func (s *Store) pushOps(t *Task, p *Push, now time.Time) []clientv3.Op {
	cr := claimRecord{Task: t.ID, Job: t.JobID, Node: p.Node, StartedAt: now, Pushed: true}
	return []clientv3.Op{
		clientv3.OpPut(s.claimKey(t), mustJSON(cr), clientv3.WithLease(p.Lease)),
		clientv3.OpPut(s.progressKey(t.JobID), mustJSON(Progress{Stage: t.Stage, Node: p.Node}), clientv3.WithLease(p.Lease)),
	}
}

// TryClaim claims t for node on lease. It fails with ErrTaken when another
// worker got there first or the task changed since it was read. It is one
// transaction whatever the queue's length: the claim key (the fencing
// token), the task rewritten with its attempt counted (so a stale view's
// next try fails on its ModRevision), and the job's progress key (who runs
// it), both on the worker's lease.
func (s *Store) TryClaim(ctx context.Context, t Task, node string, lease clientv3.LeaseID) (*Claim, error) {
	now := s.cfg.Now()
	ck := s.claimKey(&t)
	cr := claimRecord{Task: t.ID, Job: t.JobID, Node: node, StartedAt: now}
	claimed := t
	claimed.Attempt++
	p := Progress{Stage: t.Stage, Node: node}
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(t.Key), "=", t.Rev),
			clientv3.Compare(clientv3.CreateRevision(ck), "=", 0)).
		Then(clientv3.OpPut(ck, mustJSON(cr), clientv3.WithLease(lease)),
			clientv3.OpPut(t.Key, mustJSON(claimed)),
			// Progress is advisory and lives on the worker's lease.
			clientv3.OpPut(s.progressKey(t.JobID), mustJSON(p), clientv3.WithLease(lease)),
			// The job record, for the commit (Claim.job).
			clientv3.OpGet(s.jobKey(t.JobID))).
		Commit()
	if err != nil {
		// The transaction may have committed even though we got an error:
		// remove a claim of ours so the task does not sit claimed by nobody.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, cerr := s.cli.Txn(cctx).If(clientv3.Compare(clientv3.LeaseValue(ck), "=", int64(lease))).
			Then(clientv3.OpDelete(ck)).Commit(); cerr != nil {
			s.log.Warn("claim may be left until the lease ends", zap.String("task", t.ID), zap.Error(cerr))
		}
		return nil, fmt.Errorf("jobs: claim %s: %w", t.ID, err)
	}
	if !resp.Succeeded {
		return nil, ErrTaken
	}
	claimed.Rev = resp.Header.Revision
	c := &Claim{Task: claimed, Node: node, Lease: lease, Rev: resp.Header.Revision, StartedAt: now, ClaimedAt: s.cfg.Now()}
	if kvs := resp.Responses[3].GetResponseRange().GetKvs(); len(kvs) == 1 {
		c.job, c.jobRev = kvs[0].Value, kvs[0].ModRevision
	}
	return c, nil
}

// Reclaim claims c's task again, for c's node under lease: the node's
// lease after the one c was made under expired, with the task's output
// finished but not committed. It succeeds only if nobody has claimed the
// task since c (every claim rewrites the task key, so its ModRevision is
// still c's; Abandon, Commit and Cancel change or delete it too) and
// nobody holds a claim on it now: the output is still wanted, and no other
// worker ran or runs the task. The claim continues c's attempt (Attempt is
// not counted up), since the work was done once. It fails with ErrTaken
// otherwise. A retry after an attempt that got no answer finds that
// attempt's claim, on lease, and returns it.
func (s *Store) Reclaim(ctx context.Context, c *Claim, lease clientv3.LeaseID) (*Claim, error) {
	ck := s.claimKey(&c.Task)
	cr := claimRecord{Task: c.Task.ID, Job: c.Task.JobID, Node: c.Node, StartedAt: c.StartedAt}
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(c.Task.Key), "=", c.Task.Rev),
			clientv3.Compare(clientv3.CreateRevision(ck), "=", 0)).
		Then(clientv3.OpPut(ck, mustJSON(cr), clientv3.WithLease(lease))).
		Else(clientv3.OpGet(ck), clientv3.OpGet(c.Task.Key, clientv3.WithKeysOnly())).
		Commit()
	if err != nil {
		return nil, fmt.Errorf("jobs: reclaim %s: %w", c.Task.ID, err)
	}
	n := *c
	n.Lease = lease
	if resp.Succeeded {
		n.Rev = resp.Header.Revision
		return &n, nil
	}
	claims, tasks := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(claims) == 1 && claims[0].Lease == int64(lease) && len(tasks) == 1 && tasks[0].ModRevision == c.Task.Rev {
		n.Rev = claims[0].ModRevision // ours, from an attempt whose answer was lost
		return &n, nil
	}
	return nil, ErrTaken
}

// fenced are the conditions every write by a claim holder carries: the
// claim key is as the claim wrote it (its ModRevision) and on its lease.
// A claim key is written once, when the claim is made, except by a
// hand-over (HandOver), which rewrites it for another worker in place
// (etcd refuses a transaction that deletes and puts one key) and so gives
// that worker a token of its own.
func (s *Store) fenced(c *Claim) []clientv3.Cmp {
	ck := s.claimKey(&c.Task)
	return []clientv3.Cmp{
		clientv3.Compare(clientv3.ModRevision(ck), "=", c.Rev),
		clientv3.Compare(clientv3.LeaseValue(ck), "=", int64(c.Lease)),
	}
}

// Drop gives up a claim, if it is still ours, without touching the task or
// the job: the task becomes claimable again (or stays deleted, when a
// cancel deleted it). For a worker that stopped because the job was
// cancelled or its lease changed.
func (s *Store) Drop(ctx context.Context, c *Claim) error {
	_, err := s.cli.Txn(ctx).If(s.fenced(c)...).Then(
		clientv3.OpDelete(s.claimKey(&c.Task)),
		clientv3.OpDelete(s.progressKey(c.Task.JobID)),
		clientv3.OpDelete(s.previewPrefix(c.Task.JobID), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return fmt.Errorf("jobs: drop claim: %w", err)
	}
	return nil
}

// Abandon gives the task back to the queue after a transient failure; it
// becomes claimable again after backoff.
func (s *Store) Abandon(ctx context.Context, c *Claim, backoff time.Duration) error {
	t := c.Task
	t.NotBefore = s.cfg.Now().Add(backoff)
	return s.giveBack(ctx, c, t)
}

// Requeue gives a running task back to the queue at once, without a
// failure: it was preempted for more urgent work, or its agent is
// draining. The stage starts over on its next claim (there are no step
// checkpoints); the task keeps its key, so its place in the queue (enqueue
// time, and so its aging) is kept, and the give-back does not count
// against its transient retries. Fenced like Abandon: ErrFenced when the
// claim is no longer ours, so a task is never both requeued and committed.
func (s *Store) Requeue(ctx context.Context, c *Claim) error {
	return s.requeue(ctx, c, time.Time{})
}

// Yield requeues a task preempted for interactive work (Requeue), dated,
// so that the stage's other workers count the slot it frees as on its way
// to the work it was freed for, and do not give way again for the same
// (routing.QueuePolicy.Preempt).
func (s *Store) Yield(ctx context.Context, c *Claim) error {
	return s.requeue(ctx, c, s.cfg.Now())
}

// requeue is Requeue, marking the task preempted at preempted unless zero.
func (s *Store) requeue(ctx context.Context, c *Claim, preempted time.Time) error {
	t := c.Task
	t.Requeues++
	t.NotBefore = time.Time{}
	if !preempted.IsZero() {
		t.PreemptedAt = preempted
	}
	return s.giveBack(ctx, c, t)
}

// giveBack writes t back unclaimed in place of c's task.
func (s *Store) giveBack(ctx context.Context, c *Claim, t Task) error {
	// The task must be the one we claimed: a Cancel that deleted it must not
	// be undone by writing it back.
	cmps := append(s.fenced(c), clientv3.Compare(clientv3.ModRevision(t.Key), "=", c.Task.Rev))
	resp, err := s.cli.Txn(ctx).If(cmps...).
		Then(clientv3.OpPut(t.Key, mustJSON(t)), clientv3.OpDelete(s.claimKey(&c.Task)), clientv3.OpDelete(s.progressKey(t.JobID))).
		Commit()
	if err != nil {
		return fmt.Errorf("jobs: abandon %s: %w", t.ID, err)
	}
	if !resp.Succeeded {
		return ErrFenced
	}
	return nil
}

// HandOver passes pushed claim c, which its worker has not started, to
// worker to: one fenced transaction rewrites the claim key for to, on its
// lease (a token of its own, see fenced), with the task hinted to it and
// the job's progress key on its lease. It is a give-back that skips the
// queue: a task requeued after its steal grace is raced for by every idle
// worker of the stage, and on a large pool all but one of those claims
// lose. The task keeps its attempt and requeue counts: it has not run.
// The tickets its producer issued with the push are dropped: they name
// the worker it was pushed to, and the new one asks for its own.
// ErrFenced means the claim is no longer c's or the task changed (a
// cancel deleted it); an error for which cache.LeaseGone holds means to's
// lease ended: requeue instead.
func (s *Store) HandOver(ctx context.Context, c *Claim, to *Push) error {
	t := c.Task
	t.Hint = to.Node
	t.Inputs = slices.Clone(t.Inputs)
	for i := range t.Inputs {
		t.Inputs[i].Ticket = nil
	}
	cmps := append(s.fenced(c), clientv3.Compare(clientv3.ModRevision(t.Key), "=", c.Task.Rev))
	ops := append([]clientv3.Op{clientv3.OpPut(t.Key, mustJSON(t))}, s.pushOps(&t, to, s.cfg.Now())...)
	resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return fmt.Errorf("jobs: hand %s over to %s: %w", t.ID, to.Node, err)
	}
	if !resp.Succeeded {
		return ErrFenced
	}
	return nil
}
