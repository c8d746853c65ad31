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

// This file holds the Store itself (Config, NewStore) and what both its
// client and worker sides use: job record reads and writes, on a retention
// lease once the job is finished, and the JSON of every value.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/cache"
)

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
	// Offer, when set, is given every claim a transaction pushes to a
	// worker as the transaction goes, for the worker to start it before
	// the write answers (offer.go). It must not block.
	Offer func(Offer)
	// OfferTTL is how long an offered claim may wait for the write that
	// confirms it before its worker drops it.
	OfferTTL time.Duration
}

// DefaultConfig uses the default mesh prefix.
func DefaultConfig() Config {
	return Config{
		Prefix:     "/latentmesh/default",
		Retention:  7 * 24 * time.Hour, // a week to fetch a result's record; etcd stays bounded
		MaxRewinds: 3,                  // a payload lost three times means something is broken
		QueuePage:  1000,               // ~1 MiB responses; a view loads once, then follows a watch
		OfferTTL:   DefaultOfferTTL,
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
	if cfg.Retention < 0 || cfg.QueuePage <= 0 || cfg.MaxRewinds < 0 || cfg.OfferTTL <= 0 {
		return nil, errors.New("jobs: QueuePage and OfferTTL must be positive and Retention not negative (start from DefaultConfig)")
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Store{cli: cli, cfg: cfg, log: cfg.Logger.Named("jobs"), ret: cache.NewRetention(cli, cfg.Now)}, nil
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

// endedTTL is how long a finished job's ended key (keys.go) lives, at
// most (a shorter retention takes it with the record): the waiters at its
// end have returned long before; one that comes later reads the record and
// finds it finished.
const endedTTL = 10 * time.Minute

// recordOps are the writes of a job record: a finished job's goes on the
// retention lease of its bucket, so etcd deletes it when the retention
// passes, and is copied to the job's ended key, which Wait watches (one
// event a job, not one a stage). leases are the leases the ops name, for
// leaseGone.
func (s *Store) recordOps(ctx context.Context, rec record) (ops []clientv3.Op, leases []clientv3.LeaseID, raw string, err error) {
	raw = mustJSON(rec)
	if !rec.State.Terminal() {
		return []clientv3.Op{clientv3.OpPut(s.jobKey(rec.ID), raw)}, nil, raw, nil
	}
	put, retention := clientv3.OpPut(s.jobKey(rec.ID), raw), clientv3.LeaseID(0)
	if s.cfg.Retention != 0 {
		if retention, _, err = s.ret.Lease(ctx, s.cfg.Retention); err != nil {
			return nil, nil, "", err
		}
		put, leases = clientv3.OpPut(s.jobKey(rec.ID), raw, clientv3.WithLease(retention)), append(leases, retention)
	}
	// The ended key goes after endedTTL, or with the record when its
	// retention is shorter.
	ended := retention
	if s.cfg.Retention == 0 || s.cfg.Retention > endedTTL {
		if ended, _, err = s.ret.Lease(ctx, endedTTL); err != nil {
			return nil, nil, "", err
		}
		leases = append(leases, ended)
	}
	return []clientv3.Op{put, clientv3.OpPut(s.endedKey(rec.ID), raw, clientv3.WithLease(ended))}, leases, raw, nil
}

// leaseGone reports whether a write failed because etcd no longer knows one
// of its retention leases (an etcd replaced or restored); the leases are
// forgotten and the caller writes again with fresh ones.
func (s *Store) leaseGone(err error, leases []clientv3.LeaseID) bool {
	if len(leases) == 0 || !cache.LeaseGone(err) {
		return false
	}
	for _, l := range leases {
		s.ret.Forget(l)
	}
	return true
}
