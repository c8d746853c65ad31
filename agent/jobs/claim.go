package jobs

// This file holds how a worker takes and gives back a task: the claim (made
// by the worker, or pushed to it by the task's creator), its fencing, a
// reclaim under a new lease, and the give-backs (Drop, Abandon, Requeue,
// Yield). Commit and its siblings, which end a claim, are in commit.go.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/cache"
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
	// Next is the next stage's task that commit created, as written at
	// CommitRev (zero after any other end): its producer counts and
	// dispatches it until it goes (Fed).
	Next Task
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
	// offer is set on a claim the worker took from an offer, before the
	// write confirms it (offer.go): Rev is 0 and the fenced writes wait
	// for it to settle.
	offer *offer
}

// claimRecord is what a claim key holds. A claim made for a worker by
// someone else (a push, an assignment, a hand-over) carries its task, so
// that the worker's Inbox has all it needs from the one event.
type claimRecord struct {
	Task      string    `json:"task"`
	Job       string    `json:"job"`
	Node      string    `json:"node"`
	StartedAt time.Time `json:"started_at"`
	// Pushed marks a claim made for Node by another node.
	Pushed bool `json:"pushed,omitempty"`
	// Of is the task as the claim's transaction wrote it, at TaskKey, for
	// a pushed claim.
	Of      *Task  `json:"of,omitempty"`
	TaskKey string `json:"task_key,omitempty"`
	// Record is the job record as the claim's own transaction wrote it (a
	// push made by a submit or a commit; a dispatcher's later hand-on has
	// none): its revision is the claim's, so the worker's commit is fenced
	// on it without reading it first.
	Record json.RawMessage `json:"record,omitempty"`
}

// Push names the worker a task is claimed for by someone else: its creator
// as it creates it (the producer's hint, a worker with a free slot), its
// dispatcher when it waited (Assign), or its holder when it cannot start
// it (HandOver), with the etcd lease the worker's claims live on. The
// claim is that worker's as if it had made it (fenced by its revision,
// gone with the lease), so nobody races for the task and the worker starts
// it without a claim transaction of its own: a handoff costs one etcd
// write (the producer's commit) instead of two. The worker finds it in
// its Inbox (Inbox.Pushed), starts it when it has a slot and it comes
// first in its order, and gives it back when it cannot start it soon.
type Push struct {
	Node  string
	Lease clientv3.LeaseID
}

// claimOps are the writes that claim t (whose fields the claim sets are
// set: Holder, HolderLease, Attempt, Hint) for t.Holder: its claim key and
// the job's progress key on the holder's lease, and the task itself.
func (s *Store) claimOps(t *Task, pushed bool, now time.Time, job string) []clientv3.Op {
	cr := claimRecord{Task: t.ID, Job: t.JobID, Node: t.Holder, StartedAt: now, Pushed: pushed}
	if job != "" {
		cr.Record = json.RawMessage(job)
	}
	if pushed {
		cr.Of, cr.TaskKey = t, t.Key
	}
	value := mustJSON(cr)
	if pushed {
		s.offerOf(t, value)
	}
	lease := clientv3.WithLease(clientv3.LeaseID(t.HolderLease))
	return []clientv3.Op{
		clientv3.OpPut(s.heldKey(t), value, lease),
		// Progress is advisory and lives on the worker's lease.
		clientv3.OpPut(s.progressKey(t.JobID), mustJSON(Progress{Stage: t.Stage, Node: t.Holder}), lease),
		clientv3.OpPut(t.Key, mustJSON(t)),
	}
}

// pushOps are a push's writes for new task t: the task claimed for p on
// its first attempt, with job, the job record the same transaction writes.
func (s *Store) pushOps(t *Task, p *Push, now time.Time, job string) []clientv3.Op {
	t.Attempt, t.Hint, t.Holder, t.HolderLease = 1, p.Node, p.Node, int64(p.Lease)
	return s.claimOps(t, true, now, job)
}

// unheld compares that t, as read, is the task etcd has and that its last
// holder's claim, if any, is gone: t waits.
func (s *Store) unheld(t *Task) []clientv3.Cmp {
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(t.Key), "=", t.Rev)}
	if k := s.heldKey(t); k != "" {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(k), "=", 0))
	}
	return cmps
}

// TryClaim claims waiting task t for node on lease. It fails with ErrTaken
// when another claim got there first or the task changed since it was
// read. It is one transaction whatever the queue's length: the claim key
// (the fencing token), the task rewritten with its attempt counted and
// its holder (so a stale copy's next try fails on its ModRevision), and
// the job's progress key.
func (s *Store) TryClaim(ctx context.Context, t Task, node string, lease clientv3.LeaseID) (*Claim, error) {
	return s.claim(ctx, t, &Push{Node: node, Lease: lease}, false)
}

// Assign claims waiting task t for worker to, as its dispatcher does: a
// pushed claim (Push) made after the task was created. ErrTaken as for
// TryClaim; an error for which cache.LeaseGone holds means to's lease
// ended.
func (s *Store) Assign(ctx context.Context, t Task, to *Push) (*Claim, error) {
	c, err := s.claim(ctx, t, to, true)
	if err == nil {
		c.Pushed = true
	}
	return c, err
}

// claim claims t for to (pushed: made by another node).
func (s *Store) claim(ctx context.Context, t Task, to *Push, pushed bool) (*Claim, error) {
	now := s.cfg.Now()
	claimed := t
	claimed.Attempt++
	claimed.Holder, claimed.HolderLease, claimed.Back = to.Node, int64(to.Lease), ""
	if pushed {
		claimed.Hint = to.Node
	}
	ck := s.heldKey(&claimed)
	cmps := append(s.unheld(&t), clientv3.Compare(clientv3.CreateRevision(ck), "=", 0))
	ops := s.claimOps(&claimed, pushed, now, "")
	if !pushed {
		// The job record, for the commit (Claim.job). A pushed claim's
		// worker reads it when it commits: the dispatcher has no use for it.
		ops = append(ops, clientv3.OpGet(s.jobKey(t.JobID)))
	}
	resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		if cache.LeaseGone(err) {
			return nil, fmt.Errorf("jobs: claim %s for %s: %w", t.ID, to.Node, err)
		}
		// The transaction may have committed even though we got an error:
		// remove the claim so the task does not sit claimed by nobody.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, cerr := s.cli.Txn(cctx).If(clientv3.Compare(clientv3.LeaseValue(ck), "=", int64(to.Lease))).
			Then(clientv3.OpDelete(ck)).Commit(); cerr != nil {
			s.log.Warn("claim may be left until the lease ends", zap.String("task", t.ID), zap.Error(cerr))
		}
		return nil, fmt.Errorf("jobs: claim %s: %w", t.ID, err)
	}
	if !resp.Succeeded {
		return nil, ErrTaken
	}
	claimed.Rev = resp.Header.Revision
	c := &Claim{Task: claimed, Node: to.Node, Lease: to.Lease, Rev: resp.Header.Revision, StartedAt: now, ClaimedAt: s.cfg.Now()}
	if !pushed {
		if kvs := resp.Responses[len(ops)-1].GetResponseRange().GetKvs(); len(kvs) == 1 {
			c.job, c.jobRev = kvs[0].Value, kvs[0].ModRevision
		}
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
// not counted up), since the work was done once; the task is rewritten
// with the new lease, so its dispatcher sees it held again. It fails with
// ErrTaken otherwise. A retry after an attempt that got no answer finds
// that attempt's claim, on lease, and returns it.
func (s *Store) Reclaim(ctx context.Context, c *Claim, lease clientv3.LeaseID) (*Claim, error) {
	if c.Revision() == 0 {
		// An offer no write confirmed: its task may not exist, and must
		// not be made from the offer.
		return nil, fmt.Errorf("%w: reclaim of an unconfirmed offer of %s", ErrTaken, c.Task.ID)
	}
	was := c.Task
	was.Rev = c.taskRev() // an offered claim's, as confirmed
	t := was
	t.HolderLease = int64(lease)
	ck := s.ownKey(c)
	resp, err := s.cli.Txn(ctx).If(s.unheld(&was)...).Then(s.claimOps(&t, false, c.StartedAt, "")...).
		Else(clientv3.OpGet(ck), clientv3.OpGet(t.Key, clientv3.WithKeysOnly())).Commit()
	if err != nil {
		return nil, fmt.Errorf("jobs: reclaim %s: %w", c.Task.ID, err)
	}
	n := *c
	n.Lease, n.Task, n.offer = lease, t, nil
	if resp.Succeeded {
		n.Rev, n.Task.Rev = resp.Header.Revision, resp.Header.Revision
		return &n, nil
	}
	claims, tasks := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(claims) == 1 && claims[0].Lease == int64(lease) && len(tasks) == 1 && tasks[0].ModRevision == claims[0].ModRevision {
		// Ours, from an attempt whose answer was lost: it wrote both.
		n.Rev, n.Task.Rev = claims[0].ModRevision, claims[0].ModRevision
		return &n, nil
	}
	return nil, ErrTaken
}

// fenced are the conditions every write by a claim holder carries: the
// claim key is as the claim wrote it (its ModRevision) and on its lease.
// A claim key is written once, when the claim is made. An offered claim
// has no revision until its write confirms it: fenced waits for that
// (Claim.Settle), and fails with ErrFenced for an offer withdrawn.
func (s *Store) fenced(ctx context.Context, c *Claim) ([]clientv3.Cmp, error) {
	if err := c.Settle(ctx); err != nil {
		return nil, err
	}
	ck := s.ownKey(c)
	return []clientv3.Cmp{
		clientv3.Compare(clientv3.ModRevision(ck), "=", c.Revision()),
		clientv3.Compare(clientv3.LeaseValue(ck), "=", int64(c.Lease)),
	}, nil
}

// Drop gives up a claim, if it is still ours, without touching the task or
// the job: the task becomes claimable again (or stays deleted, when a
// cancel deleted it). For a worker that stopped because the job was
// cancelled or its lease changed.
func (s *Store) Drop(ctx context.Context, c *Claim) error {
	fence, err := s.fenced(ctx, c)
	if err != nil {
		return err
	}
	_, err = s.cli.Txn(ctx).If(fence...).Then(
		clientv3.OpDelete(s.ownKey(c)),
		clientv3.OpDelete(s.progressKey(c.Task.JobID)),
		s.dropPreviews(c.Task.JobID),
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

// giveBack writes t back unclaimed in place of c's task: its dispatcher
// sees it wait again.
func (s *Store) giveBack(ctx context.Context, c *Claim, t Task) error {
	fence, err := s.fenced(ctx, c)
	if err != nil {
		return err
	}
	t.Holder, t.HolderLease, t.Back = "", 0, c.Node
	// The task must be the one we claimed: a Cancel that deleted it must not
	// be undone by writing it back.
	cmps := append(fence, clientv3.Compare(clientv3.ModRevision(t.Key), "=", c.taskRev()))
	resp, err := s.cli.Txn(ctx).If(cmps...).
		Then(clientv3.OpPut(t.Key, mustJSON(t)), clientv3.OpDelete(s.ownKey(c)), clientv3.OpDelete(s.progressKey(t.JobID))).
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
// worker to: one fenced transaction deletes c's claim key and claims the
// task for to, on its lease, with the task hinted to it and the job's
// progress key on its lease. It is a give-back that skips the dispatcher.
// The task keeps its attempt and requeue counts: it has not run.
// The tickets its producer issued with the push are dropped: they name
// the worker it was pushed to, and the new one asks for its own.
// ErrFenced means the claim is no longer c's or the task changed (a
// cancel deleted it); an error for which cache.LeaseGone holds means to's
// lease ended: requeue instead.
func (s *Store) HandOver(ctx context.Context, c *Claim, to *Push) error {
	fence, err := s.fenced(ctx, c)
	if err != nil {
		return err
	}
	t := c.Task
	t.Hint, t.Holder, t.HolderLease = to.Node, to.Node, int64(to.Lease)
	t.Inputs = slices.Clone(t.Inputs)
	for i := range t.Inputs {
		t.Inputs[i].Ticket = nil
	}
	cmps := append(fence, clientv3.Compare(clientv3.ModRevision(t.Key), "=", c.taskRev()))
	ops := append([]clientv3.Op{clientv3.OpDelete(s.ownKey(c))}, s.claimOps(&t, true, s.cfg.Now(), "")...)
	resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return fmt.Errorf("jobs: hand %s over to %s: %w", t.ID, to.Node, err)
	}
	if !resp.Succeeded {
		return ErrFenced
	}
	return nil
}

// ownKey is the key of claim c.
func (s *Store) ownKey(c *Claim) string { return s.claimKey(c.Task.Stage, c.Node, c.Task.ID) }
