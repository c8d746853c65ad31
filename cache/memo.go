package cache

// This file holds content-addressed entries: Cache objects whose id names
// what produced their bytes (a hash of a model, an encoder version and a
// text, say), so that any agent finds one by computing its id, and the
// mesh produces each once however many agents ask for it at the same time.
//
// Finding an entry reads this node's index when it holds the entry, else
// a record read within Config.EntryTTL, else etcd (one read). Producing
// one takes a flight key first (<prefix>/objflight/<id>, on the producer's
// lease, written only if neither the key nor the object's record exists):
// the agent that gets it produces the entry and commits its record and the
// flight key's deletion in one transaction; the others wait, each on a
// watch of that one record's key, for the record to appear. An entry's one
// copy is held by the agent that produced it (a Local put), so it costs no
// transfer to store, and evicting it is that holder's LRU decision
// (Config.CacheCapacity).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// flightKey is the key an agent producing entry id holds meanwhile.
func flightKey(prefix, id string) string { return prefix + "/objflight/" + id }

// Entry returns the record of Cache object id when it has a live holder:
// what a reader can pull now. It reads etcd only for an entry this node
// neither holds nor read within Config.EntryTTL. A record whose every
// holder left the mesh is no entry (its copy went with them).
func (s *Store) Entry(ctx context.Context, id string) (Record, bool) {
	s.wholeEntry(ctx, id)
	if rec, ok, known := s.knownEntry(id); known {
		return rec, ok
	}
	if !ValidID(id) {
		return Record{}, false
	}
	resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, id))
	if err != nil || len(resp.Kvs) == 0 {
		return Record{}, false
	}
	return s.readEntry(resp.Kvs[0].Value)
}

// knownEntry is Entry from what this node knows without a read: known
// reports that it knows the entry, or that it is none.
func (s *Store) knownEntry(id string) (rec Record, ok, known bool) {
	s.idx.mu.Lock()
	// A record that names this node, or did; a marker's thin copy is not
	// enough for a reader (wholeEntry reads the record the first time).
	if e := s.idx.getLocked(id); e != nil && e.rev != 0 && (e.rec == nil || !e.rec.thin) {
		known = true
		if e.rec != nil {
			rec = e.rec.Record
		}
	}
	s.idx.mu.Unlock()
	if !known {
		rec, known = s.recent.get(id, s.cfg.Now().Add(-s.cfg.EntryTTL))
	}
	if !known || rec.Mode != Cache || !s.anyAlive(rec.Holders) {
		return Record{}, false, known
	}
	s.hold.touchObject(id) // a use, if the copy is here
	return rec, true, true
}

// wholeEntry replaces the thin copy of object id's record that this
// node's marker gave it, if that is what it has, with the record: once,
// on the entry's first lookup here.
func (s *Store) wholeEntry(ctx context.Context, id string) {
	s.idx.mu.Lock()
	var l *listed
	if e := s.idx.getLocked(id); e != nil && e.rec != nil && e.rec.thin {
		l = e.rec
	}
	s.idx.mu.Unlock()
	if l != nil {
		s.whole(ctx, l) // an error leaves it thin: Entry reads the record itself
	}
}

// readEntry is the entry whose record val was read from etcd, if it is
// one with a live holder; one held elsewhere is remembered for EntryTTL.
func (s *Store) readEntry(val []byte) (Record, bool) {
	rec, ok := s.liveEntry(val)
	if ok && !names(rec.Holders, s.cfg.Node) {
		s.recent.put(rec, s.cfg.Now())
	}
	return rec, ok
}

// MemoSpec is an entry to find or produce.
type MemoSpec struct {
	// ID names the entry's content (ValidID).
	ID string
	// Lease is the producer's etcd lease, which its flight key lives on:
	// when the producer dies, the key goes, and a waiter produces instead.
	Lease clientv3.LeaseID
}

// Produce makes an entry: its bytes and what they are. It is called at
// most once per Memo.
type Produce func(ctx context.Context) ([]byte, transfer.TensorMeta, error)

// Memo returns entry spec.ID, producing it with produce when no agent has
// it: hit reports that this call did not produce it (it was there, another
// call on this node was producing it, or another agent was). Concurrent
// Memos of one id on this node share one attempt; across the mesh, the
// flight key makes one agent produce while the others wait up to
// Config.MemoWait for it. An entry that does not fit this node's cache
// room (ErrFull) is not cached: the caller uses its own bytes.
func (s *Store) Memo(ctx context.Context, spec MemoSpec, produce Produce) (rec Record, hit bool, err error) {
	if !ValidID(spec.ID) {
		return Record{}, false, fmt.Errorf("cache: memo: invalid id %q", spec.ID)
	}
	if rec, ok, _ := s.knownEntry(spec.ID); ok {
		s.memoHits.Add(1)
		return rec, true, nil
	}
	s.flights.mu.Lock()
	if f, ok := s.flights.on[spec.ID]; ok {
		s.flights.mu.Unlock()
		select {
		case <-f.done:
		case <-ctx.Done():
			return Record{}, false, ctx.Err()
		}
		if f.err == nil {
			s.memoHits.Add(1)
			return f.rec, true, nil
		}
		// The attempt this call waited for failed (its caller gave up, or
		// the cache had no room): try on its own.
		return s.memoOnce(ctx, spec, produce)
	}
	f := &flight{done: make(chan struct{})}
	s.flights.on[spec.ID] = f
	s.flights.mu.Unlock()
	f.rec, hit, f.err = s.memoOnce(ctx, spec, produce)
	s.flights.mu.Lock()
	delete(s.flights.on, spec.ID)
	s.flights.mu.Unlock()
	close(f.done)
	return f.rec, hit, f.err
}

// flights are this node's Memos under way, by id.
type flights struct {
	mu sync.Mutex
	on map[string]*flight // mu guards it
}

// flight is one Memo attempt; rec and err are set before done is closed.
type flight struct {
	done chan struct{}
	rec  Record
	err  error
}

// memoOnce is one node-wide Memo attempt: take the mesh's flight key, or
// wait for whoever holds it.
func (s *Store) memoOnce(ctx context.Context, spec MemoSpec, produce Produce) (Record, bool, error) {
	if rec, ok, _ := s.knownEntry(spec.ID); ok {
		s.memoHits.Add(1)
		return rec, true, nil
	}
	objKey, fk := ObjectKey(s.cfg.Prefix, spec.ID), flightKey(s.cfg.Prefix, spec.ID)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(objKey), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(fk), "=", 0)).
		Then(clientv3.OpPut(fk, s.cfg.Node, clientv3.WithLease(spec.Lease))).
		Else(clientv3.OpGet(objKey)).
		Commit()
	if err != nil {
		return Record{}, false, fmt.Errorf("cache: memo %s: flight: %w", spec.ID, err)
	}
	flying, replace := resp.Succeeded, int64(0)
	if !flying {
		if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) == 1 {
			// A record this node has not read yet, or a dead one (no
			// live holder; maintenance has not collected it yet), which
			// is produced again and replaced.
			if rec, ok := s.readEntry(kvs[0].Value); ok {
				s.memoHits.Add(1)
				return rec, true, nil
			}
			replace = kvs[0].ModRevision
		} else if rec, ok := s.waitEntry(ctx, spec.ID, resp.Header.Revision, s.cfg.MemoWait); ok {
			// Another agent held the flight key: it produced the entry.
			s.memoHits.Add(1)
			return rec, true, nil
		} else if ctx.Err() != nil {
			return Record{}, false, ctx.Err()
		} else {
			s.log.Debug("memo: the entry did not come; producing it here", zap.String("object", spec.ID))
		}
	}
	rec, err := s.produce(ctx, spec, produce, flying, replace)
	if errors.Is(err, errMemoTaken) {
		// Committed by another agent meanwhile: theirs is the entry.
		got, gerr := s.cli.Get(ctx, objKey)
		if gerr == nil && len(got.Kvs) == 1 {
			if rec, ok := s.readEntry(got.Kvs[0].Value); ok {
				s.memoHits.Add(1)
				return rec, true, nil
			}
		}
		return Record{}, false, fmt.Errorf("cache: memo %s: committed elsewhere, but not readable: %w", spec.ID, errors.Join(ErrNotFound, gerr))
	}
	if err != nil {
		return Record{}, false, err
	}
	s.memoMisses.Add(1)
	return rec, false, nil
}

// liveEntry decodes a Cache record read from etcd, if a holder of it is
// alive.
func (s *Store) liveEntry(val []byte) (Record, bool) {
	rec, err := decodeRecord(val)
	if err != nil || rec.Mode != Cache {
		return Record{}, false
	}
	return rec, s.anyAlive(rec.Holders)
}

// anyAlive reports whether a holder among hs is this node or a member.
func (s *Store) anyAlive(hs []Holder) bool {
	alive := map[string]bool{s.cfg.Node: true}
	for _, m := range s.members() {
		alive[m.Node] = true
	}
	return slices.ContainsFunc(hs, func(h Holder) bool { return alive[h.Node] })
}

// errMemoTaken: another agent committed the entry first.
var errMemoTaken = errors.New("cache: memo entry committed by another agent")

// produce stages produce's bytes on this node and commits the record if the
// object's key is still at revision replace (0: absent), deleting the
// flight key in the same transaction (when this call holds it); on failure
// the flight key is deleted, so waiters stop waiting.
func (s *Store) produce(ctx context.Context, spec MemoSpec, produce Produce, flying bool, replace int64) (rec Record, err error) {
	fk := flightKey(s.cfg.Prefix, spec.ID)
	if flying {
		defer func() {
			if err != nil {
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RequestTimeout)
				defer cancel()
				s.cli.Txn(dctx).If(clientv3.Compare(clientv3.LeaseValue(fk), "=", int64(spec.Lease))).Then(clientv3.OpDelete(fk)).Commit()
			}
		}()
	}
	data, meta, err := produce(ctx)
	if err != nil {
		return Record{}, err
	}
	if err := meta.Validate(int64(len(data))); err != nil || meta.Bytes() != int64(len(data)) {
		return Record{}, fmt.Errorf("cache: memo %s: %d bytes of %v: %v", spec.ID, len(data), meta, err)
	}
	ref, err := s.xfer.Publish(meta, data)
	if err != nil {
		return Record{}, err
	}
	defer s.xfer.Release(ref.ID)
	st, err := s.stage(ctx, PutSpec{ID: spec.ID, Mode: Cache, Replicas: 1, Local: true}, ref, data, nil)
	if err != nil {
		return Record{}, err
	}
	objKey := ObjectKey(s.cfg.Prefix, spec.ID)
	then := []clientv3.Op{st.Op()}
	if flying {
		then = append(then, clientv3.OpDelete(fk))
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(objKey), "=", replace)).Then(then...).Commit()
	if err != nil {
		st.Abort(context.WithoutCancel(ctx))
		return Record{}, fmt.Errorf("cache: memo %s: commit: %w", spec.ID, err)
	}
	if !resp.Succeeded {
		st.Abort(context.WithoutCancel(ctx))
		return Record{}, errMemoTaken
	}
	st.written(resp.Header.Revision)
	return st.Record, nil
}

// waitEntry waits up to d for entry id, absent at revision rev, to appear
// with a live holder: it watches that one record's key, so another agent's
// entry costs this node one event, not every agent one.
func (s *Store) waitEntry(ctx context.Context, id string, rev int64, d time.Duration) (Record, bool) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	defer context.AfterFunc(s.ctx, cancel)() // Close ends the wait
	key, next := ObjectKey(s.cfg.Prefix, id), rev+1
	for ctx.Err() == nil {
		var rec Record
		var ok bool
		if rec, ok, next = s.watchEntry(ctx, key, next); ok {
			return rec, true
		}
		s.pause(ctx, 200*time.Millisecond) // a broken watch (leader loss): resume shortly
	}
	return Record{}, false
}

// watchEntry watches the entry's record at key from revision next until
// a live entry is put, the watch breaks or ctx ends; it returns the
// revision to resume at. A watch etcd compacted away reads the record.
func (s *Store) watchEntry(ctx context.Context, key string, next int64) (Record, bool, int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for wr := range s.cli.Watch(wctx, key, clientv3.WithRev(next)) {
		if wr.CompactRevision > 0 {
			resp, err := s.cli.Get(ctx, key)
			if err != nil {
				return Record{}, false, next
			}
			if len(resp.Kvs) == 1 {
				if rec, ok := s.readEntry(resp.Kvs[0].Value); ok {
					return rec, true, 0
				}
			}
			return Record{}, false, resp.Header.Revision + 1
		}
		for _, ev := range wr.Events {
			next = ev.Kv.ModRevision + 1
			if ev.Type != mvccpb.PUT {
				continue
			}
			if rec, ok := s.readEntry(ev.Kv.Value); ok {
				return rec, true, 0
			}
		}
	}
	return Record{}, false, next
}

// DropEntries deletes the records of the Cache objects this node holds
// whose id starts with prefix and that keep refuses: entries no reader
// can ask for any more (an encoder version changed, say). Their holders
// free the copies when their watches bring the deletions.
func (s *Store) DropEntries(ctx context.Context, prefix string, keep func(id string) bool) (int, error) {
	var ids []string
	for _, c := range s.hold.snapshot() {
		if c.mode == Cache && c.committed && strings.HasPrefix(c.object, prefix) && !keep(c.object) {
			ids = append(ids, c.object)
		}
	}
	var errs []error
	n := 0
	for _, id := range ids {
		if err := s.Delete(ctx, id); err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// recentEntries remembers, for Config.EntryTTL, the entries held on other
// nodes that this node read from etcd: a text every job asks for costs
// one read per EntryTTL, not one per job. An entry evicted meanwhile costs
// the job that found it here a rewind (its pull fails and the agent drops
// the entry), as it did when a watch brought the eviction a moment late.
type recentEntries struct {
	mu sync.Mutex
	// mu guards on.
	on map[string]recentEntry
}

type recentEntry struct {
	rec Record
	at  time.Time // when it was read
}

// maxRecentEntries bounds the entries remembered: a few texts are asked
// for again and again; the rest are read once.
const maxRecentEntries = 1024

// get returns entry id if it was read after since.
func (r *recentEntries) get(id string, since time.Time) (Record, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.on[id]
	if !ok || !e.at.After(since) {
		return Record{}, false
	}
	return e.rec, true
}

// put remembers rec, read at now. When full, it forgets what it read
// longest ago.
func (r *recentEntries) put(rec Record, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.on == nil {
		r.on = map[string]recentEntry{}
	}
	if _, ok := r.on[rec.ID]; !ok && len(r.on) >= maxRecentEntries {
		oldest := ""
		for id, e := range r.on {
			if oldest == "" || e.at.Before(r.on[oldest].at) {
				oldest = id
			}
		}
		delete(r.on, oldest)
	}
	r.on[rec.ID] = recentEntry{rec: rec, at: now}
}

// forget drops entry id (deleted by this node).
func (r *recentEntries) forget(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.on, id)
}
