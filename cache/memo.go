package cache

// This file holds content-addressed entries: Cache objects whose id names
// what produced their bytes (a hash of a model, an encoder version and a
// text, say), so that any agent finds one by computing its id, and the
// mesh produces each once however many agents ask for it at the same time.
//
// Finding an entry reads the index this node's watch keeps, not etcd.
// Producing one takes a flight key first (<prefix>/objflight/<id>, on the
// producer's lease, written only if neither the key nor the object's record
// exists): the agent that gets it produces the entry and commits its record
// and the flight key's deletion in one transaction; the others wait, on the
// index, for the record to appear. An entry's one copy is held by the agent
// that produced it (a Local put), so it costs no transfer to store, and
// evicting it is that holder's LRU decision (Config.CacheCapacity).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// flightKey is the key an agent producing entry id holds meanwhile.
func flightKey(prefix, id string) string { return prefix + "/objflight/" + id }

// Entry returns the record of Cache object id when this node's index has it
// with a live holder: what a reader can pull now, at no etcd read. A record
// whose every holder left the mesh is no entry (its copy went with them).
func (s *Store) Entry(id string) (Record, bool) {
	s.idx.mu.Lock()
	l := lookup(s.idx.recs, id)
	s.idx.mu.Unlock()
	if l == nil || l.Mode != Cache || !s.anyAlive(l.Holders) {
		return Record{}, false
	}
	s.hold.touchObject(id) // a use, if the copy is here
	return l.Record, true
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
	if rec, ok := s.Entry(spec.ID); ok {
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
	if rec, ok := s.Entry(spec.ID); ok {
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
			// A record this node's index has not seen yet, or a dead one
			// (no live holder; maintenance has not collected it yet),
			// which is produced again and replaced.
			if rec, ok := s.liveEntry(kvs[0].Value); ok {
				s.memoHits.Add(1)
				return rec, true, nil
			}
			replace = kvs[0].ModRevision
		} else if rec, ok := s.waitEntry(ctx, spec.ID, s.cfg.MemoWait); ok {
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
			if rec, ok := s.liveEntry(got.Kvs[0].Value); ok {
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
	return st.Record, nil
}

// waitEntry waits up to d for entry id to appear in the index with a live
// holder.
func (s *Store) waitEntry(ctx context.Context, id string, d time.Duration) (Record, bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		changed := s.idx.watch()
		if rec, ok := s.Entry(id); ok {
			return rec, true
		}
		select {
		case <-changed:
		case <-t.C:
			return Record{}, false
		case <-ctx.Done():
			return Record{}, false
		case <-s.ctx.Done():
			return Record{}, false
		}
	}
}

// DropEntries deletes the records of the Cache objects this node holds
// whose id starts with prefix and that keep refuses: entries no reader
// can ask for any more (an encoder version changed, say). Their holders
// free the copies when the watch brings the deletions.
func (s *Store) DropEntries(ctx context.Context, prefix string, keep func(id string) bool) (int, error) {
	s.idx.mu.Lock()
	var ids []string
	i, _ := search(s.idx.recs, prefix)
	for ; i < len(s.idx.recs) && len(s.idx.recs[i].ID) >= len(prefix) && s.idx.recs[i].ID[:len(prefix)] == prefix; i++ {
		l := s.idx.recs[i]
		if l.Mode == Cache && !keep(l.ID) && slices.ContainsFunc(l.Holders, func(h Holder) bool { return h.Node == s.cfg.Node }) {
			ids = append(ids, l.ID)
		}
	}
	s.idx.mu.Unlock()
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
