package jobs

// Offers: a pushed claim reaches its worker before the transaction that
// writes it has answered.
//
// A push (a submit's, a commit's, a dispatcher's hand-on) writes the
// claim in etcd, and the worker's inbox sees it one watch event later:
// the task's start waits for a raft write and its delivery, the dispatch
// latency that grows with etcd's load. So the writer also sends the claim
// key's value, exactly as its transaction writes it, to the worker over
// libp2p as it sends the transaction (Config.Offer). The worker may start
// the task from that offer at once: pull its inputs (each with the ticket
// the producer issued with the push) and run the engine. Nothing it does
// reaches etcd until the offer is settled: every fenced write of the
// claim (Commit, Fail, Rewind, a checkpoint, a give-back) first waits for
// it (Claim.Settle). The inbox's watch settles it when the claim key
// arrives: with the same bytes it is the claim, fenced by the key's
// revision as any pushed claim; with other bytes (a retried transaction
// rewrote it) the offer is refused and the claim that was written is
// offered as any pushed claim. An offer that no write confirms within
// Config.OfferTTL (the writer's transaction failed, or never reached etcd) is
// refused: the worker drops what it did, and etcd never heard of it. A
// claim is never fenced on an offer alone, so a forged offer costs its
// worker only the work it started, and a lost one only the latency it
// was to save.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultOfferTTL is how long an offered claim waits for the write that
// confirms it before it is refused (Config.OfferTTL). A commit's
// transaction answers in milliseconds; one that takes longer than this is
// retried, and its claim then starts from the inbox's watch like any
// other.
const DefaultOfferTTL = 10 * time.Second

// MaxOfferBytes bounds an offered claim's value: a claim carries its task
// and the job record, each of a few KiB, and etcd refuses a request of
// more than 1.5 MiB.
const MaxOfferBytes = 1 << 20

// Offer is a pushed claim as its writer sends it to its worker: the
// claim key and its value, byte for byte as the transaction writes them.
type Offer struct {
	Stage Stage
	Node  string // the worker
	Key   string
	Value []byte
}

// offer is the state of a claim its worker took from an offer.
type offer struct {
	value   []byte
	settled chan struct{} // closed once confirmed or refused
	// rev is the claim key's ModRevision once confirmed, 0 if refused;
	// written before settled is closed, read after.
	rev int64
}

func newOffer(value []byte) *offer {
	return &offer{value: value, settled: make(chan struct{})}
}

// settle confirms the offer at revision rev, or refuses it (rev 0). Only
// the first call counts; the caller holds the inbox's lock.
func (o *offer) settle(rev int64) {
	select {
	case <-o.settled:
	default:
		o.rev = rev
		close(o.settled)
	}
}

// pending reports whether the offer is not settled yet.
func (o *offer) pending() bool {
	select {
	case <-o.settled:
		return false
	default:
		return true
	}
}

// revision is the claim's revision once the offer is confirmed: 0 while
// it is not settled, or refused.
func (o *offer) revision() int64 {
	if o.pending() {
		return 0
	}
	return o.rev
}

// Offered reports whether the claim came from an offer (it may be settled
// since).
func (c *Claim) Offered() bool { return c.offer != nil }

// Settled returns a channel closed once an offered claim is confirmed or
// refused (Withdrawn says which); nil for a claim read from etcd, which
// never settles because it needs not.
func (c *Claim) Settled() <-chan struct{} {
	if c.offer == nil {
		return nil
	}
	return c.offer.settled
}

// Withdrawn reports whether an offered claim was refused: no write
// confirmed it, or the write put other bytes. Its worker drops what it
// did; the claim, if one was written, is in the inbox as any pushed one.
func (c *Claim) Withdrawn() bool {
	return c.offer != nil && !c.offer.pending() && c.offer.rev == 0
}

// Settle waits until an offered claim is confirmed (nil) or refused
// (ErrFenced), or ctx ends. A claim read from etcd is settled already.
func (c *Claim) Settle(ctx context.Context) error {
	if c.offer == nil {
		return nil
	}
	if c.offer.pending() {
		select {
		case <-c.offer.settled:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if c.offer.rev == 0 {
		return fmt.Errorf("%w: the offered claim on %s was not written", ErrFenced, c.Task.ID)
	}
	return nil
}

// Revision is the claim key's revision, the fencing token: an offered
// claim's once confirmed, 0 before (and if withdrawn): no write is fenced
// on it until then (fenced settles it first).
func (c *Claim) Revision() int64 {
	if c.offer != nil {
		return c.offer.revision()
	}
	return c.Rev
}

// taskRev is the task's ModRevision as the claim wrote it (a pushed
// claim's transaction writes both).
func (c *Claim) taskRev() int64 {
	if c.offer != nil {
		return c.offer.revision()
	}
	return c.Task.Rev
}

// jobRecord is the job record as the claim read it, with its revision
// (nil: read it).
func (c *Claim) jobRecord() ([]byte, int64) {
	if c.offer != nil {
		if rev := c.offer.revision(); rev != 0 && c.job != nil {
			return c.job, rev // written with the claim
		}
		return nil, 0
	}
	return c.job, c.jobRev
}

// offerOf sends the claim key value that ops put for t.Holder to
// Config.Offer, as the transaction holding them is about to go.
func (s *Store) offerOf(t *Task, value string) {
	if s.cfg.Offer == nil || t.Holder == "" {
		return
	}
	s.cfg.Offer(Offer{Stage: t.Stage, Node: t.Holder, Key: s.heldKey(t), Value: []byte(value)})
}

// Offered takes an offered claim into the view (see Offer), to be started
// like a pushed claim (Pushed, Take) before the write that confirms it
// arrives. One the view has already, from the watch or an earlier offer,
// is ignored. It is checked as a claim key's value is: for this inbox's
// node and stage, with its task.
func (q *Inbox) Offered(key string, value []byte) error {
	if len(value) > MaxOfferBytes {
		return fmt.Errorf("jobs: offered claim of %d bytes (at most %d)", len(value), MaxOfferBytes)
	}
	prefix := q.s.inboxPrefix(q.stage, q.node)
	id, ok := strings.CutPrefix(key, prefix)
	if !ok || !validID(id) {
		return fmt.Errorf("jobs: offered claim key %q is not a task under %s", key, prefix)
	}
	var rec claimRecord
	if err := json.Unmarshal(value, &rec); err != nil {
		return fmt.Errorf("jobs: offered claim: %w", err)
	}
	if !rec.Pushed || rec.Of == nil || rec.Task != id || rec.Node != q.node || rec.Of.ID != id ||
		rec.Of.Stage != q.stage || rec.Of.Holder != q.node || rec.Of.HolderLease == 0 ||
		!strings.HasPrefix(rec.TaskKey, q.s.taskPrefix(q.stage)) {
		return fmt.Errorf("jobs: offered claim on %s is not a claim pushed to %s for %s", id, q.node, q.stage)
	}
	o := newOffer(bytes.Clone(value))
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, ok := q.claims[id]; ok {
		return nil
	}
	if _, ok := q.taken[id]; ok {
		return nil
	}
	if _, ok := q.done[id]; ok {
		return nil // later than its write's event, and than its run
	}
	q.claims[id] = claimInfo{lease: clientv3.LeaseID(rec.Of.HolderLease), rec: rec, offer: o}
	q.changed.notify()
	time.AfterFunc(q.s.cfg.OfferTTL, func() { q.expire(id, o) })
	return nil
}

// expire refuses offer o on task id if no write confirmed it yet.
func (q *Inbox) expire(id string, o *offer) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if tc, ok := q.taken[id]; ok && tc.offer == o {
		delete(q.taken, id)
		o.settle(0)
	}
	if c, ok := q.claims[id]; ok && c.offer == o {
		delete(q.claims, id)
		o.settle(0)
		q.changed.notify()
	}
}

// confirmLocked settles the offer of task id, if the view holds one, by
// the claim key kv etcd has: confirmed when kv holds the offered bytes on
// the offered lease. It reports whether kv was the offered claim (then
// nothing more is to be done with it).
func (q *Inbox) confirmLocked(id string, c claimInfo, value []byte) bool {
	if tc, ok := q.taken[id]; ok && tc.offer != nil {
		if bytes.Equal(value, tc.offer.value) {
			tc.offer.settle(c.rev)
			q.taken[id] = takenClaim{rev: c.rev}
			return true
		}
		tc.offer.settle(0) // its worker stops it; the claim written is offered below
		delete(q.taken, id)
		return false
	}
	if cur, ok := q.claims[id]; ok && cur.offer != nil {
		if bytes.Equal(value, cur.offer.value) && cur.lease == c.lease {
			cur.offer.settle(c.rev)
		} else {
			cur.offer.settle(0)
		}
		delete(q.claims, id) // the claim written replaces it
	}
	return false
}
