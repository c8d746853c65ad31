// Package jobs is the durable job and task store of latentmesh, kept in etcd.
//
// A job is a record at <prefix>/jobs/<id>. Each stage of a job is one task key
// under <prefix>/queues/<stage>/tasks/<class>/<order>, ordered by priority
// class and enqueue time. A worker claims a task by creating
// <prefix>/queues/<stage>/claims/<task> on its own etcd lease, in a
// transaction that requires the task unchanged and unclaimed; the claim's revision is its fencing token. The worker commits its
// stage in one transaction that requires the claim to still exist with that
// revision on that lease: it writes the stage record, enqueues the next stage's
// task (or the final result), publishes its output payload records, and deletes
// the task, the claim and the consumed input payload records. A worker whose
// lease expired has lost its claim and can never commit, and a dead worker's
// task becomes claimable again when its lease expires. Nothing is deleted on
// claim (unlike etcd's recipe queue), so no accepted job is lost.
//
// Files, previews and Store-relayed latents are Store objects (package cache):
// a commit writes their records in its transaction, and releases consumed
// ones, but no bytes enter etcd. A finished job's record goes on a retention
// lease, so etcd forgets it after Config.Retention.
//
// The package knows etcd, the engine's Spec and the Store's key layout; it
// does not know how payloads move (transfer) or who the peers are (gossip).
// Only the agent uses it.
package jobs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// Input is a payload a task consumes: which payload, who produced it, and the
// transport's reference to it (opaque here; the agent decodes it). A Store
// input (Store true) is a Store object: Payload is its object id, Node the
// node that put it, and Ref is empty (readers look the holders up).
type Input struct {
	Payload string          `json:"payload"`
	Node    string          `json:"node"`
	Ref     json.RawMessage `json:"ref,omitempty"`
	Store   bool            `json:"store,omitempty"`
	// Ticket is the producer's ticket for the worker its task was pushed
	// to (transfer.Service.Issue), so that worker pulls without asking
	// for one; opaque here, and only that worker uses it.
	Ticket []byte `json:"ticket,omitempty"`
}

// Task is one runnable stage of a job, stored as JSON at its task key.
type Task struct {
	ID         string        `json:"id"`
	JobID      string        `json:"job"`
	Stage      Stage         `json:"stage"`
	Class      routing.Class `json:"class"`
	Transfer   TransferMode  `json:"transfer_mode,omitempty"`
	Deadline   time.Time     `json:"deadline,omitzero"` // the job's, for earliest deadline first
	Spec       engine.Spec   `json:"spec"`              // carried so a worker need not read the job
	Inputs     []Input       `json:"inputs,omitempty"`
	Hint       string        `json:"hint,omitempty"` // preferred worker node
	EnqueuedAt time.Time     `json:"enqueued_at"`
	NotBefore  time.Time     `json:"not_before,omitempty"` // backoff after a failed attempt
	Attempt    int           `json:"attempt"`              // claims taken so far
	// Requeues counts claims given back without a failure (preempted,
	// drained): they do not use up the task's transient retries.
	Requeues int `json:"requeues,omitempty"`
	// PreemptedAt is when the task was last given back for interactive
	// work (Yield): the slot it freed is on its way to that work.
	PreemptedAt time.Time `json:"preempted_at,omitzero"`

	Key string `json:"-"` // etcd key, set on read
	Rev int64  `json:"-"` // ModRevision seen, set on read
}

// Claim is a worker's hold on a task.
type Claim struct {
	Task      Task
	Node      string
	Lease     clientv3.LeaseID
	Rev       int64 // the claim key's CreateRevision: the fencing token
	StartedAt time.Time
	ClaimedAt time.Time // when the claim transaction answered
	// CommitRev is the etcd revision of the claim's successful commit (or
	// fail, or rewind): the next stage's task exists from there on.
	CommitRev int64

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

// PayloadRecord says where a peer-to-peer output payload lives until its
// consumer commits (a Store object has its own record, under objects/).
type PayloadRecord struct {
	Input
	Job   string `json:"job"`
	Stage Stage  `json:"stage"` // the stage that produced it
}

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

// Config configures a Store.
type Config struct {
	Prefix string // key prefix shared by all agents of one mesh
	// Retention is how long a finished job's record stays in etcd (on an
	// etcd lease per retention bucket); 0 keeps records for good.
	Retention time.Duration
	// MaxRewinds bounds restarts from encode after lost payloads.
	MaxRewinds int
	// QueuePage bounds one response of a queue read (Pending, a Queue
	// view's load): the queue is read in pages of this many tasks.
	QueuePage int64
	Logger    *zap.Logger
	Now       func() time.Time
}

// DefaultConfig uses the default mesh prefix.
func DefaultConfig() Config {
	return Config{
		Prefix:     "/latentmesh/default",
		Retention:  7 * 24 * time.Hour, // a week to fetch a result's record; etcd stays bounded
		MaxRewinds: 3,                  // a payload lost three times means something is broken
		QueuePage:  1000,               // ~1 MiB responses; a view loads once, then follows a watch
		Logger:     zap.NewNop(),
		Now:        time.Now,
	}
}

// Store reads and writes jobs, tasks, claims and results in etcd.
type Store struct {
	cli *clientv3.Client
	cfg Config
	log *zap.Logger
	ret *cache.Retention // leases that expire finished job records
}

// NewStore returns a Store using cli.
func NewStore(cli *clientv3.Client, cfg Config) (*Store, error) {
	if cli == nil {
		return nil, errors.New("jobs: nil etcd client")
	}
	if !strings.HasPrefix(cfg.Prefix, "/") || strings.HasSuffix(cfg.Prefix, "/") {
		return nil, fmt.Errorf("jobs: prefix %q must start and not end with /", cfg.Prefix)
	}
	if cfg.Retention < 0 || cfg.QueuePage <= 0 || cfg.MaxRewinds < 0 {
		return nil, errors.New("jobs: QueuePage must be positive and Retention not negative (start from DefaultConfig)")
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Store{cli: cli, cfg: cfg, log: cfg.Logger.Named("jobs"), ret: cache.NewRetention(cli, cfg.Now)}, nil
}

// Key layout. Values are JSON (except result parts) so etcdctl shows them.
func (s *Store) jobKey(id string) string      { return s.cfg.Prefix + "/jobs/" + id }
func (s *Store) progressKey(id string) string { return s.cfg.Prefix + "/progress/" + id }

// A stage's tasks and claims share one prefix, so that one watch sees both
// in revision order (Queue): a commit's deletion of a task and of its claim
// then arrive together, never the claim's first.
func (s *Store) queuePrefix(st Stage) string { return s.cfg.Prefix + "/queues/" + string(st) + "/" }
func (s *Store) taskPrefix(st Stage) string  { return s.queuePrefix(st) + "tasks/" }
func (s *Store) claimPrefix(st Stage) string { return s.queuePrefix(st) + "claims/" }
func (s *Store) claimKey(t *Task) string     { return s.claimPrefix(t.Stage) + t.ID }

// Payload records are keyed by their producer, so that a producer follows
// the releases of its own payloads and no others'.
func (s *Store) payloadPrefix() string             { return s.cfg.Prefix + "/payloads/" }
func (s *Store) producerPrefix(node string) string { return s.payloadPrefix() + node + "/" }
func (s *Store) payloadKey(node, id string) string { return s.producerPrefix(node) + id }

// objectsOf is the key prefix of every Store object a job owns (its result,
// previews and relayed latents are named cache.JobObjectID(job, ...)).
func (s *Store) objectsOf(id string) string {
	return cache.ObjectKey(s.cfg.Prefix, cache.JobObjectID(id, ""))
}

// PreviewID names frame f's preview object of job id.
func PreviewID(id string, f int) string { return fmt.Sprintf("%s%04d", previewsOf(id), f) }

// previewsOf is the id prefix of job id's preview objects.
func previewsOf(id string) string { return cache.JobObjectID(id, "frame.") }

// IsPreview reports whether a Store object id names a frame preview of job
// id (PreviewID).
func IsPreview(id, obj string) bool { return strings.HasPrefix(obj, previewsOf(id)) }

// ResultID names the result object of job id.
func ResultID(id string) string { return cache.JobObjectID(id, "result") }

// previewPrefix is the key prefix of a job's preview objects.
func (s *Store) previewPrefix(id string) string {
	return cache.ObjectKey(s.cfg.Prefix, previewsOf(id))
}

// taskKey orders by class, then enqueue time; the task id makes it unique.
func (s *Store) taskKey(t *Task) string {
	return fmt.Sprintf("%s%d/%016x-%s", s.taskPrefix(t.Stage), t.Class, t.EnqueuedAt.UnixNano(), t.ID)
}

// record is the JSON at a job key: the public Job plus bookkeeping.
type record struct {
	Job
	TaskKey string `json:"task_key,omitempty"` // the current stage's task
}

func newID() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("jobs: crypto/rand: %v", err)) // the kernel's RNG does not fail
	}
	return hex.EncodeToString(b[:])
}

// Submit stores a new job and its first task in one transaction. The job is
// durable once Submit returns.
func (s *Store) Submit(ctx context.Context, spec engine.Spec, opt Options) (Job, error) {
	class := opt.Class
	if !class.Valid() {
		return Job{}, fmt.Errorf("jobs: invalid class %d", class)
	}
	if _, err := ParseTransferMode(string(opt.Transfer)); err != nil {
		return Job{}, err
	}
	now := s.cfg.Now()
	t := Task{ID: newID(), JobID: newID(), Stage: Encode, Class: class, Transfer: opt.Transfer, Deadline: opt.Deadline, Spec: spec, EnqueuedAt: now}
	t.Key = s.taskKey(&t)
	push := opt.Push
	rec := record{
		Job: Job{
			ID: t.JobID, Spec: spec, Class: class, Transfer: opt.Transfer, Deadline: opt.Deadline, State: Queued, Stage: Encode,
			Stages: map[Stage]*StageRecord{}, CreatedAt: now, UpdatedAt: now, Owner: opt.Owner,
		},
		TaskKey: t.Key,
	}
	for {
		task, ops := t, []clientv3.Op{clientv3.OpPut(s.jobKey(t.JobID), mustJSON(rec))}
		if push != nil {
			task.Attempt, task.Hint = 1, push.Node
			ops = append(ops, s.pushOps(&task, push, now)...)
		}
		ops = append(ops, clientv3.OpPut(t.Key, mustJSON(task)))
		resp, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(s.jobKey(t.JobID)), "=", 0)).
			Then(ops...).
			Commit()
		if push != nil && cache.LeaseGone(err) {
			push = nil // the worker's lease ended: queue the task for anyone
			continue
		}
		if err != nil {
			return Job{}, fmt.Errorf("jobs: submit: %w", err)
		}
		if !resp.Succeeded {
			return Job{}, fmt.Errorf("jobs: submit: job id %s collided", t.JobID)
		}
		break
	}
	s.log.Debug("submitted", zap.String("job", t.JobID), zap.Stringer("class", class))
	return rec.Job, nil
}

func millis(d time.Duration) float64 { return float64(max(d, 0).Microseconds()) / 1000 }

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("jobs: marshal %T: %v", v, err)) // only our own plain structs get here
	}
	return string(b)
}

// getRecord reads a job record and its ModRevision.
func (s *Store) getRecord(ctx context.Context, id string) (record, int64, error) {
	rec, rev, _, err := s.readRecord(ctx, id)
	return rec, rev, err
}

// readRecord reads a job record, its ModRevision and the revision of the
// read (from which a watch sees every later change).
func (s *Store) readRecord(ctx context.Context, id string, opts ...clientv3.OpOption) (rec record, modRev, readRev int64, err error) {
	if !validID(id) {
		return record{}, 0, 0, ErrNotFound
	}
	resp, err := s.cli.Get(ctx, s.jobKey(id), opts...)
	if err != nil {
		return record{}, 0, 0, fmt.Errorf("jobs: get %s: %w", id, err)
	}
	if len(resp.Kvs) == 0 {
		return record{}, 0, 0, ErrNotFound
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		return record{}, 0, 0, fmt.Errorf("jobs: decode job %s: %w", id, err)
	}
	return rec, resp.Kvs[0].ModRevision, resp.Header.Revision, nil
}

// validID keeps user-supplied ids from escaping their key (no '/').
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '-' || c == '_') {
			return false
		}
	}
	return true
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
// one watch of the record, waits until etcd has created it, then reads the
// record, and follows the watch, reading the records its events carry. The
// order matters: a watch asked to start at a revision etcd has already
// passed (the read's, once a stage committed since) is served by etcd's
// unsynced-watcher loop, up to 100 ms later, which was most of a tiny job's
// latency; a watch from now never is, and the read after it misses
// nothing. A broken or compacted watch starts over.
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
	wch := s.cli.Watch(ctx, s.jobKey(id), clientv3.WithCreatedNotify())
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
			if ev.Type == clientv3.EventTypeDelete {
				return Job{}, false, nil // deleted: the next read says what became of it
			}
			// Most events are a stage committing: read the state alone
			// (decoding into one field allocates nothing else), and the
			// whole record only once it is the last.
			var st struct {
				State State `json:"state"`
			}
			if json.Unmarshal(ev.Kv.Value, &st) != nil || !st.State.Terminal() {
				continue
			}
			var rec record
			if json.Unmarshal(ev.Kv.Value, &rec) == nil {
				return rec.Job, true, nil
			}
		}
	}
	return Job{}, false, ctx.Err()
}

// Cancel stops a job: its queued task and unconsumed inputs are deleted, and a
// worker running it will find the job cancelled when it tries to commit.
func (s *Store) Cancel(ctx context.Context, id string) (Job, error) {
	for {
		rec, rev, err := s.getRecord(ctx, id)
		if err != nil {
			return Job{}, err
		}
		if rec.State.Terminal() {
			return rec.Job, ErrFinished
		}
		ops := []clientv3.Op{
			clientv3.OpDelete(s.progressKey(id)),
			clientv3.OpDelete(s.previewPrefix(id), clientv3.WithPrefix()),
		}
		if rec.TaskKey != "" {
			ops = append(ops, clientv3.OpDelete(rec.TaskKey))
			t, err := s.readTask(ctx, rec.TaskKey)
			switch {
			case err == nil:
				ops = append(ops, s.releaseOps(t.Inputs)...)
			case !errors.Is(err, ErrNotFound):
				// Without the task we cannot release its inputs: do not cancel half-way.
				return Job{}, fmt.Errorf("jobs: cancel %s: read task: %w", id, err)
			}
		}
		rec.State, rec.Stage, rec.TaskKey = Cancelled, "", ""
		rec.UpdatedAt = s.cfg.Now()
		rec.Error = &Error{Code: "cancelled", Message: "cancelled by request"}
		put, lease, err := s.putRecord(ctx, rec)
		if err != nil {
			return Job{}, fmt.Errorf("jobs: cancel %s: %w", id, err)
		}
		ops = append(ops, put)
		resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(s.jobKey(id)), "=", rev)).Then(ops...).Commit()
		if s.leaseGone(err, lease) {
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

// releaseOps free consumed inputs: delete-on-consume for peer-to-peer
// payloads (the producer frees the buffer) and Store objects alike (the
// holders free their copies).
func (s *Store) releaseOps(in []Input) []clientv3.Op {
	ops := make([]clientv3.Op, 0, len(in))
	for _, i := range in {
		if i.Store {
			ops = append(ops, clientv3.OpDelete(cache.ObjectKey(s.cfg.Prefix, i.Payload)))
		} else {
			ops = append(ops, clientv3.OpDelete(s.payloadKey(i.Node, i.Payload)))
		}
	}
	return ops
}

// putRecord is the write of a job record: a finished job's goes on the
// retention lease of its bucket, so etcd deletes it when the retention
// passes. lease is 0 for a record that does not expire.
func (s *Store) putRecord(ctx context.Context, rec record) (clientv3.Op, clientv3.LeaseID, error) {
	if !rec.State.Terminal() || s.cfg.Retention == 0 {
		return clientv3.OpPut(s.jobKey(rec.ID), mustJSON(rec)), 0, nil
	}
	lease, _, err := s.ret.Lease(ctx, s.cfg.Retention)
	if err != nil {
		return clientv3.Op{}, 0, err
	}
	return clientv3.OpPut(s.jobKey(rec.ID), mustJSON(rec), clientv3.WithLease(lease)), lease, nil
}

// leaseGone reports whether a write failed because etcd no longer knows its
// retention lease (an etcd replaced or restored); the lease is forgotten and
// the caller writes again with a fresh one.
func (s *Store) leaseGone(err error, lease clientv3.LeaseID) bool {
	if lease == 0 || !cache.LeaseGone(err) {
		return false
	}
	s.ret.Forget(lease)
	return true
}

// renewLeases forgets the job record's retention lease (the next putRecord
// grants a fresh one) and renews those of the staged records.
func (s *Store) renewLeases(ctx context.Context, lease clientv3.LeaseID, records []StagedRecord) error {
	if lease != 0 {
		s.ret.Forget(lease)
	}
	for _, r := range records {
		if err := r.Renew(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Pending reads the unclaimed tasks of a stage, every one of them, and the
// etcd revision they were read at. Workers do not call it: they scan a
// Queue view.
func (s *Store) Pending(ctx context.Context, stage Stage) ([]Task, int64, error) {
	tasks, claims, rev, err := s.readQueue(ctx, stage)
	if err != nil {
		return nil, 0, err
	}
	claimed := make(map[string]bool, len(claims))
	for _, kv := range claims {
		claimed[strings.TrimPrefix(string(kv.Key), s.claimPrefix(stage))] = true
	}
	out := tasks[:0]
	for _, t := range tasks {
		if !claimed[t.ID] {
			out = append(out, t)
		}
	}
	return out, rev, nil
}

// Depth counts a stage's tasks, queued (unclaimed) and running (claimed), at
// etcd revision rev: two range counts, for a status page asking about a
// stage this agent has no Queue view of.
func (s *Store) Depth(ctx context.Context, stage Stage) (queued, running, rev int64, err error) {
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(s.taskPrefix(stage), clientv3.WithPrefix(), clientv3.WithCountOnly()),
		clientv3.OpGet(s.claimPrefix(stage), clientv3.WithPrefix(), clientv3.WithCountOnly()),
	).Commit()
	if err != nil {
		return 0, 0, 0, fmt.Errorf("jobs: depth %s: %w", stage, err)
	}
	total := resp.Responses[0].GetResponseRange().Count
	running = resp.Responses[1].GetResponseRange().Count
	return total - running, running, resp.Header.Revision, nil
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
		n.Rev = claims[0].CreateRevision // ours, from an attempt whose answer was lost
		return &n, nil
	}
	return nil, ErrTaken
}

// fenced are the conditions every write by a claim holder carries.
func (s *Store) fenced(c *Claim) []clientv3.Cmp {
	ck := s.claimKey(&c.Task)
	return []clientv3.Cmp{
		clientv3.Compare(clientv3.CreateRevision(ck), "=", c.Rev),
		clientv3.Compare(clientv3.LeaseValue(ck), "=", int64(c.Lease)),
	}
}

// finishOps delete the task, its claim, its progress and, after the
// decode stage (which makes them), its frame previews.
func (s *Store) finishOps(c *Claim) []clientv3.Op {
	ops := []clientv3.Op{
		clientv3.OpDelete(c.Task.Key),
		clientv3.OpDelete(s.claimKey(&c.Task)),
		clientv3.OpDelete(s.progressKey(c.Task.JobID)),
	}
	if _, last := c.Task.Stage.Next(); last {
		ops = append(ops, clientv3.OpDelete(s.previewPrefix(c.Task.JobID), clientv3.WithPrefix()))
	}
	return ops
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
func (s *Store) update(ctx context.Context, c *Claim, what string, records []StagedRecord, leaseGone func() bool, mutate func(*record) ([]clientv3.Op, error)) error {
	renewals := 0
	known, knownRev := c.job, c.jobRev // the record as last seen, if any
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
		put, lease, err := s.putRecord(ctx, rec)
		if err != nil {
			return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, err)
		}
		ops := append(s.finishOps(c), put)
		ops = append(ops, extra...)
		for _, r := range records {
			ops = append(ops, r.Op())
		}
		ops = putsReplaceDeletes(ops)
		cmps := append(s.fenced(c), clientv3.Compare(clientv3.ModRevision(s.jobKey(rec.ID)), "=", rev))
		resp, err := s.cli.Txn(ctx).If(cmps...).Then(ops...).
			Else(clientv3.OpGet(s.claimKey(&c.Task)), clientv3.OpGet(s.jobKey(rec.ID))).Commit()
		if cache.LeaseGone(err) && leaseGone != nil && leaseGone() {
			continue // (rare) the record is read again, since mutate edited this copy
		}
		if cache.LeaseGone(err) && renewals < leaseRenewals {
			// The error does not say whose lease is gone: renew them all.
			renewals++
			if rerr := s.renewLeases(ctx, lease, records); rerr != nil {
				return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, rerr)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("jobs: %s %s/%s: %w", what, c.Task.JobID, c.Task.Stage, err)
		}
		if resp.Succeeded {
			c.CommitRev = resp.Header.Revision
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 || kvs[0].CreateRevision != c.Rev || kvs[0].Lease != int64(c.Lease) {
			return ErrFenced
		}
		// Claim intact: only the job record moved (or the claim's copy was
		// stale). Go again on the record the answer carries.
		if jk := resp.Responses[1].GetResponseRange().Kvs; len(jk) == 1 {
			known, knownRev = jk[0].Value, jk[0].ModRevision
		}
	}
}

// putsReplaceDeletes drops the deletes of single keys that ops also put
// (a commit's push writes the progress key that finishing a stage
// deletes): etcd refuses a transaction that names one key twice.
func putsReplaceDeletes(ops []clientv3.Op) []clientv3.Op {
	put := map[string]bool{}
	for _, op := range ops {
		if op.IsPut() {
			put[string(op.KeyBytes())] = true
		}
	}
	out := ops[:0]
	for _, op := range ops {
		if op.IsDelete() && len(op.RangeBytes()) == 0 && put[string(op.KeyBytes())] {
			continue
		}
		out = append(out, op)
	}
	return out
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

// dropFinished ends a claim on a task of a finished (or vanished) job: the
// claim and the task itself go, so an orphan task left by a race with
// Cancel cannot be claimed again. It returns ErrFinished.
func (s *Store) dropFinished(ctx context.Context, c *Claim) error {
	if _, err := s.cli.Txn(ctx).If(s.fenced(c)...).Then(s.finishOps(c)...).Commit(); err != nil {
		return fmt.Errorf("jobs: drop claim: %w", err)
	}
	return ErrFinished
}

// Commit finishes the claimed stage with out, atomically: the stage record, the
// next task or the result, the output payload records, and the release of the
// consumed inputs. ErrFenced means the claim was lost (lease expired): nothing
// was written and the caller must discard its output. ErrFinished means the job
// was cancelled meanwhile: the claim was dropped; discard the output too.
func (s *Store) Commit(ctx context.Context, c *Claim, out Output) error {
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
	return s.update(ctx, c, "commit", out.Records, dropPush, func(rec *record) ([]clientv3.Op, error) {
		now := s.cfg.Now()
		if rec.Stages == nil {
			rec.Stages = map[Stage]*StageRecord{}
		}
		rec.Stages[c.Task.Stage] = &StageRecord{
			Node: c.Node, Attempt: c.Task.Attempt, StartedAt: c.StartedAt, FinishedAt: now,
			Millis:      millis(out.Work),
			ClaimMillis: millis(c.ClaimedAt.Sub(c.StartedAt)),
			PullMillis:  millis(out.Pull),
		}
		ops := s.releaseOps(c.Task.Inputs)
		if last {
			rec.State, rec.Stage, rec.TaskKey = Succeeded, "", ""
			res := *out.Result
			rec.Result = &res
			return ops, nil
		}
		t := Task{
			ID: newID(), JobID: rec.ID, Stage: next, Class: rec.Class, Transfer: rec.Transfer, Deadline: rec.Deadline, Spec: rec.Spec,
			Inputs: out.Payloads, Hint: out.Hint, EnqueuedAt: now,
		}
		t.Key = s.taskKey(&t)
		if push != nil {
			t.Attempt, t.Hint = 1, push.Node
			ops = append(ops, s.pushOps(&t, push, now)...)
		}
		for _, p := range out.Payloads {
			if !p.Store {
				ops = append(ops, clientv3.OpPut(s.payloadKey(p.Node, p.Payload), mustJSON(PayloadRecord{Input: p, Job: rec.ID, Stage: c.Task.Stage})))
			}
		}
		rec.State, rec.Stage, rec.TaskKey = Running, next, t.Key
		return append(ops, clientv3.OpPut(t.Key, mustJSON(t))), nil
	})
}

// Fail ends the job with an error (a deterministic failure: retrying would
// fail the same way). Inputs are released.
func (s *Store) Fail(ctx context.Context, c *Claim, code, msg string) error {
	return s.update(ctx, c, "fail", nil, nil, func(rec *record) ([]clientv3.Op, error) {
		rec.State, rec.Stage, rec.TaskKey = Failed, "", ""
		rec.Error = &Error{Code: code, Message: msg}
		return s.releaseOps(c.Task.Inputs), nil
	})
}

// Rewind restarts the job from its first stage because an input payload was
// lost with its producer. The engine is deterministic, so the output is the
// same. After MaxRewinds the job fails instead.
func (s *Store) Rewind(ctx context.Context, c *Claim, reason string) error {
	return s.update(ctx, c, "rewind", nil, nil, func(rec *record) ([]clientv3.Op, error) {
		ops := s.releaseOps(c.Task.Inputs)
		if rec.Rewinds >= s.cfg.MaxRewinds {
			rec.State, rec.Stage, rec.TaskKey = Failed, "", ""
			rec.Error = &Error{Code: "payload_lost", Message: fmt.Sprintf("input lost %d times; last: %s", rec.Rewinds+1, reason)}
			return ops, nil
		}
		rec.Rewinds++
		t := Task{ID: newID(), JobID: rec.ID, Stage: Encode, Class: rec.Class, Transfer: rec.Transfer, Deadline: rec.Deadline, Spec: rec.Spec, EnqueuedAt: s.cfg.Now()}
		t.Key = s.taskKey(&t)
		rec.Stage, rec.TaskKey = Encode, t.Key
		return append(ops, clientv3.OpPut(t.Key, mustJSON(t))), nil
	})
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

// WatchReleases calls release with the id of every payload produced by node
// whose record is deleted (consumed, cancelled or rewound), until ctx is done.
// The producer frees the buffer then. It follows node's payload records
// only (they are keyed by producer), so a release costs one event, to the
// producer. When etcd compacted away the events of a gap in the watch,
// resync is called: the caller must compare what it holds with Recorded
// and release the difference.
func (s *Store) WatchReleases(ctx context.Context, node string, release func(payload string), resync func()) {
	// Watch from now on (payloads of a previous incarnation died with it);
	// after a broken watch, resume after the last revision seen so no release
	// in the gap is missed, unless etcd compacted it away meanwhile.
	prefix := s.producerPrefix(node)
	var next int64
	for ctx.Err() == nil {
		opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithFilterPut()}
		if next > 0 {
			opts = append(opts, clientv3.WithRev(next))
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range s.cli.Watch(wctx, prefix, opts...) {
			if wr.CompactRevision > 0 {
				s.log.Warn("payload release watch compacted; resyncing held payloads",
					zap.Int64("from", next), zap.Int64("compacted", wr.CompactRevision))
				next = 0
				resync()
				break
			}
			for _, ev := range wr.Events {
				release(strings.TrimPrefix(string(ev.Kv.Key), prefix))
			}
			if wr.Header.Revision > 0 {
				next = wr.Header.Revision + 1
			}
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second): // watch broke (leader loss): re-establish
		}
	}
}

// Payloads lists the payload records, for status pages and leak checks.
func (s *Store) Payloads(ctx context.Context) ([]PayloadRecord, error) {
	resp, err := s.cli.Get(ctx, s.payloadPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := make([]PayloadRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var pr PayloadRecord
		if err := json.Unmarshal(kv.Value, &pr); err == nil {
			out = append(out, pr)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Payload < out[j].Payload })
	return out, nil
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
		case _, ok := <-jobs:
			if !ok {
				return Job{}, fmt.Errorf("jobs: job watch of %s ended", id)
			}
			job, err := s.Get(ctx, id)
			if err != nil {
				return Job{}, err
			}
			if job.State.Terminal() {
				return job, nil
			}
		}
	}
}

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
	rec, rev, err := s.getRecord(ctx, id)
	if err != nil {
		return err
	}
	if !rec.State.Terminal() {
		return fmt.Errorf("%w: job %s is %s", ErrNotFinished, id, rec.State)
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(s.jobKey(id)), "=", rev)).Then(
		clientv3.OpDelete(s.jobKey(id)),
		clientv3.OpDelete(s.objectsOf(id), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return fmt.Errorf("jobs: delete %s: %w", id, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("jobs: delete %s: the job changed meanwhile; try again", id)
	}
	return nil
}

// PayloadRecorded reports whether payload id, produced by node, has a
// record: whether a commit that published it took effect.
func (s *Store) PayloadRecorded(ctx context.Context, node, id string) (bool, error) {
	resp, err := s.cli.Get(ctx, s.payloadKey(node, id), clientv3.WithCountOnly())
	if err != nil {
		return false, err
	}
	return resp.Count > 0, nil
}

// Recorded returns the ids of the payload records of node.
func (s *Store) Recorded(ctx context.Context, node string) (map[string]bool, error) {
	prefix := s.producerPrefix(node)
	resp, err := s.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), prefix)] = true
	}
	return out, nil
}
