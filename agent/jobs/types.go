package jobs

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/routing"
)

// Stage names one step of the generation pipeline.
type Stage string

// The pipeline stages, in order.
const (
	Encode  Stage = "encode"
	Denoise Stage = "denoise"
	Decode  Stage = "decode"
)

// Stages lists the pipeline in order.
func Stages() []Stage { return []Stage{Encode, Denoise, Decode} }

// Next is the stage after st; last is true for the final stage.
func (st Stage) Next() (next Stage, last bool) {
	switch st {
	case Encode:
		return Denoise, false
	case Denoise:
		return Decode, false
	}
	return "", true
}

// Prev is the stage before st; ok is false for the first stage and for
// anything that is not a stage.
func (st Stage) Prev() (prev Stage, ok bool) {
	switch st {
	case Denoise:
		return Encode, true
	case Decode:
		return Denoise, true
	}
	return "", false
}

// State is where a job is in its life.
type State string

// Job states. Succeeded, Failed and Cancelled are terminal.
const (
	Queued    State = "queued"
	Running   State = "running"
	Succeeded State = "succeeded"
	Failed    State = "failed"
	Cancelled State = "cancelled"
)

// Terminal reports whether no further stage will run.
func (s State) Terminal() bool { return s == Succeeded || s == Failed || s == Cancelled }

// TransferMode says how a stage's output payload reaches the next stage.
type TransferMode string

// Transfer modes.
const (
	// P2P: the consumer pulls straight from the producer's arena, which
	// holds the payload until the consumer commits.
	P2P TransferMode = "p2p"
	// StoreRelay: the producer copies the payload into the Store and frees
	// its buffer at once; the consumer reads a replica, so the producer's
	// death after the handoff costs nothing.
	StoreRelay TransferMode = "store"
	// Auto: p2p when a consumer with credit is known at publish time and the
	// producer's arena has room, the Store otherwise.
	Auto TransferMode = "auto"
)

// ParseTransferMode checks a mode name; "" is valid and means the agent's
// default.
func ParseTransferMode(s string) (TransferMode, error) {
	switch m := TransferMode(s); m {
	case "", P2P, StoreRelay, Auto:
		return m, nil
	}
	return "", fmt.Errorf("jobs: transfer mode %q: want p2p, store or auto", s)
}

// Options are the scheduling choices of a submission: they do not change the
// output bytes (the Spec does).
type Options struct {
	Class routing.Class
	// Transfer overrides the agents' default transfer mode for this job's
	// payloads ("" keeps it).
	Transfer TransferMode
	// Owner identifies who submitted the job (the client API stores a
	// hash of the caller's token, never the token); "" for none.
	Owner string
	// Deadline is when the caller wants the result (zero: none). Within a
	// class, queues serve the earliest deadline first; a missed deadline
	// does not cancel the job.
	Deadline time.Time
	// Push claims the job's first task for a worker at submission (see
	// Push); nil leaves it waiting for its dispatcher to hand it to one.
	Push *Push
	// Dispatcher is the submitting node, whose ledger (Fed) hands the
	// first task to a worker while it waits (Task.Dispatcher).
	Dispatcher string
	// Checkpointing is the request's choice of step checkpoints (nil: the
	// defaults).
	Checkpointing *Checkpointing
	// Fork, if set, starts the job's denoise from another job's
	// checkpoint (POST /v1/jobs/{id}/fork).
	Fork *ForkFrom
	// Cond, if set, is the job's whole conditioning, found in the
	// conditioning cache at submission (cache entries, Input.Cached): the
	// job has no encode task, its first task is the denoise, and its
	// encode stage record says so (StageRecord.Cached).
	Cond []Input
	// Image is the request's reference image, which the agent stages
	// (inputs.go); JobID, if set, is the job's id (NewID), preset so that
	// such objects can be named for it, and Records are written with the
	// job (the staged objects' records). LatentFrames is Job's.
	Image        *ImageUpload
	JobID        string
	Records      []StagedRecord
	LatentFrames int
}

// Job is the durable record of one generation request, stored as JSON at
// <prefix>/jobs/<id>.
type Job struct {
	ID       string                 `json:"id"`
	Spec     engine.Spec            `json:"spec"`
	Class    routing.Class          `json:"class"`
	Transfer TransferMode           `json:"transfer_mode,omitempty"`
	Deadline time.Time              `json:"deadline,omitzero"` // Options.Deadline
	State    State                  `json:"state"`
	Stage    Stage                  `json:"stage,omitempty"` // the stage queued or running now
	Stages   map[Stage]*StageRecord `json:"stages,omitempty"`
	Progress *Progress              `json:"progress,omitempty"` // filled on read from the progress key
	Result   *Result                `json:"result,omitempty"`
	Error    *Error                 `json:"error,omitempty"`
	Rewinds  int                    `json:"rewinds,omitempty"` // restarts from encode after a lost payload
	// LatentFrames is how many latent frames the video maps to, for a
	// model whose latent compresses time (81 frames -> 21); 0: as many as
	// frames.
	LatentFrames int `json:"latent_frames,omitempty"`
	// Checkpointing and Fork are Options'.
	Checkpointing *Checkpointing `json:"checkpointing,omitempty"`
	Fork          *ForkFrom      `json:"fork,omitempty"`
	// Owner is Options.Owner. The client API checks it and leaves it out
	// of its answers.
	Owner     string    `json:"owner,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

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
	// Cached marks a conditioning cache entry (a Store object of mode
	// cache, shared by every job whose text it encodes): its consumer's
	// commit does not release it; its holder evicts it when it needs room.
	Cached bool `json:"cached,omitempty"`
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
	// Checkpointing and Fork are the job's, carried so that a denoise
	// worker need not read the job.
	Checkpointing *Checkpointing `json:"checkpointing,omitempty"`
	Fork          *ForkFrom      `json:"fork,omitempty"`
	// Rewinds is the job's: a task of a rewound job may find checkpoints
	// of the run before.
	Rewinds int `json:"rewinds,omitempty"`
	// Dispatcher is the node whose ledger (Fed) hands the task to a worker
	// while it waits: its creator (the submitting agent, or the worker whose
	// commit or rewind made it), or a node that adopted it when that one
	// left (Store.Adopt). Nobody else follows the task.
	Dispatcher string `json:"dispatcher,omitempty"`
	// Holder is the node whose claim key guards the task, on the lease
	// HolderLease ("": none, the task waits). A claim whose lease ended
	// leaves Holder set: the task waits again once that claim key is gone
	// (claimOps compares it absent).
	Holder      string `json:"holder,omitempty"`
	HolderLease int64  `json:"holder_lease,omitempty"`
	// Back is the worker that gave the waiting task back (Requeue, Yield,
	// Abandon). Its dispatcher hands it there again against that worker's
	// grant, or by gossip only once the worker has gossiped since it was
	// seen back: what gossip said before is what the worker turned down.
	Back string `json:"back,omitempty"`

	Key  string    `json:"-"` // etcd key, set on read
	Rev  int64     `json:"-"` // ModRevision seen, set on read
	Seen time.Time `json:"-"` // when a ledger (Fed) saw this revision, on its clock
}

// Producer is the node whose output the task takes as its first input ("" for
// a task with none): the one whose admission counts it (Fed).
func (t Task) Producer() string {
	if len(t.Inputs) == 0 {
		return ""
	}
	return t.Inputs[0].Node
}

// StageRecord is what one committed stage left behind.
type StageRecord struct {
	Node       string    `json:"node"`
	Attempt    int       `json:"attempt"` // claims taken on this stage's task, including the committed one
	StartedAt  time.Time `json:"started_at"`
	FinishedAt time.Time `json:"finished_at"`
	Millis     float64   `json:"ms"`
	// ClaimMillis is how long the claim transaction took (StartedAt is
	// when it was sent); PullMillis how much of Millis went to pulling
	// the input (to its first chunk, for a decode). They make a job's
	// control-plane overhead visible (latentmesh-dev bench api).
	ClaimMillis float64 `json:"claim_ms,omitempty"`
	PullMillis  float64 `json:"pull_ms,omitempty"`
	// Transport is what carried the stage's input: local, shm, rdma or
	// tcp, with "store " before it for a copy read from the Store, and
	// both joined by "+" when chunks came by different ones (none for
	// encode, which has no input).
	Transport string `json:"transport,omitempty"`
	// ResumedFrom is the step a denoise started from: the checkpoint of an
	// earlier attempt (or, for a fork, of the job it forked); 0 for none.
	// Checkpoints counts those its attempt wrote.
	ResumedFrom int `json:"resumed_from,omitempty"`
	Checkpoints int `json:"checkpoints,omitempty"`
	// Cached says the stage did not run: its output was found whole in
	// the conditioning cache when the job was submitted (encode only), on
	// Node, the entries' holder. CacheHits names the parts of an encode
	// that ran which came from the cache: "prompt", "negative", or
	// "conditioning" (both, of an engine that encodes them together).
	Cached    bool     `json:"cached,omitempty"`
	CacheHits []string `json:"cache_hits,omitempty"`
}

// Progress is the running stage's fine-grained progress (denoise steps).
type Progress struct {
	Stage Stage  `json:"stage"`
	Step  int    `json:"step"`
	Total int    `json:"total"`
	Node  string `json:"node"`
}

// Step is one denoise step as the node running it reported it, for a
// job's event stream: live progress, which never goes through etcd.
type Step struct {
	Stage Stage     `json:"stage"`
	Step  int       `json:"step"`
	Total int       `json:"total"`
	Node  string    `json:"node"`
	At    time.Time `json:"at,omitzero"` // when the node reached the step
}

// Result describes the committed output file. The bytes are a Store object
// (cache), pinned with a retention; etcd holds only this description.
type Result struct {
	ContentType string    `json:"content_type"` // image/png or image/gif
	Bytes       int64     `json:"bytes"`
	SHA256      string    `json:"sha256"`
	Object      string    `json:"object"`              // the Store object holding the file
	ExpiresAt   time.Time `json:"expires_at,omitzero"` // when the Store frees it
}

// Error is why a job failed, with a stable code for clients.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Sentinel errors of the job store.
var (
	ErrNotFound = errors.New("jobs: no such job")
	ErrNotReady = errors.New("jobs: result not ready")
	ErrFenced   = errors.New("jobs: claim lost; commit refused")
	ErrFinished = errors.New("jobs: job already finished")
	ErrTaken    = errors.New("jobs: task already claimed")
	// ErrNotFinished means a job must be finished (or cancelled) first.
	ErrNotFinished = errors.New("jobs: job not finished")
	// ErrExpired means a succeeded job's result passed its retention and
	// was freed.
	ErrExpired = errors.New("jobs: result expired")
	// ErrResultLost means a succeeded job's result is gone before its
	// retention ended: every agent that held a copy lost it (killed before
	// the Store could copy it elsewhere).
	ErrResultLost = errors.New("jobs: result lost")
	// ErrStoreFull means the mesh has no room for a new job's payloads, in
	// memory or on disk: new submissions are refused until room is freed.
	ErrStoreFull = errors.New("jobs: store full")
)
