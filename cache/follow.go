package cache

import (
	"context"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Following the records that name this node.
//
// A Store follows only the records that name it (marker.go): a watch of
// its markers' prefix finds the records that come to name it, and a watch
// of each such record's key follows its changes into the index and the
// holdings (a record that names one of our staged copies commits it; a
// record deleted, or rewritten without our copy, frees it). An entry is
// forgotten once its record no longer names this node and its marker is
// gone.

// loadBatch is how many records one read of load asks for: etcd takes up
// to 128 operations a transaction by default.
const loadBatch = 64

// watchLoop lists this node's markers, loads the records they point to and
// follows them, then follows the markers from the list's revision. It lists
// again when etcd compacted the markers' watch away, and starts over,
// following nothing until it has listed, when etcd was replaced.
func (s *Store) watchLoop() {
	epoch := s.currentEpoch()
	var next int64    // the revision to follow the markers from; 0: list first
	replaced := false // etcd was replaced: run a pass once listed again
	for s.ctx.Err() == nil {
		if epoch.Err() != nil {
			// The entries and the copies' revisions follow a history the
			// new etcd does not have. The reset waits for a pass that is
			// reconciling, and stops the next ones until the list.
			s.log.Info("etcd replaced; listing this node's records again")
			s.idx.reset()
			s.hold.forgetRevisions()
			epoch, next, replaced = s.currentEpoch(), 0, true
		}
		if next == 0 {
			rev, err := s.listMarkers(epoch)
			if err != nil {
				if epoch.Err() == nil {
					s.log.Warn("list this node's records", zap.Error(err))
					s.pause(s.ctx, time.Second)
				}
				continue
			}
			next = rev + 1
			if replaced || s.hold.anyRecovered() {
				s.Kick() // judge every copy by the new etcd; name recovered copies again
			}
			replaced = false
		}
		if next = s.followMarkers(epoch, next); next != 0 && epoch.Err() == nil {
			s.pause(s.ctx, time.Second) // the watch broke (leader loss, etcd restart): re-establish
		}
	}
}

// listMarkers reads this node's markers, notes those gone, follows the
// records of those not followed yet (loading them first), and reconciles
// the copies with the entries; it returns the revision the markers are
// whole through.
func (s *Store) listMarkers(epoch context.Context) (int64, error) {
	ctx, cancel := context.WithTimeout(epoch, 10*time.Second)
	defer cancel()
	prefix := markersPrefix(s.cfg.Prefix, s.cfg.Node)
	resp, err := s.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return 0, fmt.Errorf("cache: list markers: %w", err)
	}
	markers := make(map[string]int64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		markers[strings.TrimPrefix(string(kv.Key), prefix)] = kv.ModRevision
	}
	var load []string
	s.idx.mu.Lock()
	for id, e := range s.idx.entries {
		if _, ok := markers[id]; !ok {
			e.marker = 0
			if e.byMarker {
				// Its marker was its only news: gone, the record no
				// longer names this node (or is gone too).
				s.applyLocked(e, nil, resp.Header.Revision)
			}
			s.forgetIfDoneLocked(e)
		}
	}
	for id, rev := range markers {
		e := s.idx.getLocked(id)
		if e == nil {
			e = s.idx.addLocked(id)
		}
		e.marker = rev
		if e.stop == nil { // new, or its load failed before
			load = append(load, id)
		}
	}
	s.idx.mu.Unlock()
	if err := s.load(ctx, epoch, load); err != nil {
		return 0, err
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	s.idx.rev = max(s.idx.rev, resp.Header.Revision)
	s.reconcileLocked() // staged copies past their timeout wait for the pass
	return resp.Header.Revision, nil
}

// load reads the records of the loading entries ids, loadBatch to a
// read, applies each to the copies of its object, and follows each from
// the revision read.
func (s *Store) load(ctx, epoch context.Context, ids []string) error {
	for len(ids) > 0 {
		batch := ids[:min(len(ids), loadBatch)]
		ids = ids[len(batch):]
		kvs, rev, err := s.readRecords(ctx, batch)
		if err != nil {
			return fmt.Errorf("cache: load records: %w", err)
		}
		s.idx.mu.Lock()
		for i, id := range batch {
			e := s.idx.getLocked(id)
			if e == nil || e.stop != nil {
				continue // forgotten meanwhile, or followed by a marker's event
			}
			s.loadedLocked(e, kvs[i], rev)
			s.follow(epoch, e, rev)
		}
		s.idx.mu.Unlock()
	}
	return nil
}

// readRecords reads the records of objects ids (at most 128, etcd's
// operations a transaction) in one read: each one's key-value, nil where
// there is none, and the revision read.
func (s *Store) readRecords(ctx context.Context, ids []string) ([]*mvccpb.KeyValue, int64, error) {
	ops := make([]clientv3.Op, len(ids))
	for i, id := range ids {
		ops[i] = clientv3.OpGet(ObjectKey(s.cfg.Prefix, id))
	}
	resp, err := s.cli.Txn(ctx).Then(ops...).Commit()
	if err != nil {
		return nil, 0, err
	}
	kvs := make([]*mvccpb.KeyValue, len(ids))
	for i := range ids {
		if got := resp.Responses[i].GetResponseRange().GetKvs(); len(got) == 1 {
			kvs[i] = got[0]
		}
	}
	return kvs, resp.Header.Revision, nil
}

// followMarkers applies the markers' watch from revision next until it
// breaks or epoch ends, and returns the revision to resume at; 0 when etcd
// compacted that revision away (the markers are listed again).
func (s *Store) followMarkers(epoch context.Context, next int64) int64 {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(epoch))
	defer cancel()
	for wr := range s.cli.Watch(ctx, markersPrefix(s.cfg.Prefix, s.cfg.Node), clientv3.WithPrefix(), clientv3.WithRev(next)) {
		if wr.CompactRevision > 0 {
			s.log.Info("marker watch compacted; listing again", zap.Int64("from", next), zap.Int64("compacted", wr.CompactRevision))
			return 0
		}
		if rev := s.applyMarkers(epoch, wr); rev > 0 {
			next = rev + 1
		}
	}
	return next
}

// applyMarkers applies one response of the markers' watch and returns the
// revision of its last event (0 for none). A new marker carries the record
// its transaction wrote (marker.go), which is the record as of the
// marker's revision: the holder loads it and watches the record from the
// next revision, so a new record costs each holder one event (the
// marker's) and no read, and a record deleted before its holder's watch
// began still commits, then frees, the copy it named. A marker without a
// record (one written before markers carried it) has the record read as of
// the marker's revision. Watching the record from the marker's revision
// would cost its write's event too.
func (s *Store) applyMarkers(epoch context.Context, wr clientv3.WatchResponse) int64 {
	if len(wr.Events) == 0 {
		return 0
	}
	s.watchEvents.Add(int64(len(wr.Events)))
	prefix := markersPrefix(s.cfg.Prefix, s.cfg.Node)
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	for _, ev := range wr.Events {
		id, rev := strings.TrimPrefix(string(ev.Kv.Key), prefix), ev.Kv.ModRevision
		e := s.idx.getLocked(id)
		switch {
		case ev.Type == mvccpb.PUT && e == nil:
			e = s.idx.addLocked(id)
			e.marker = rev
			if l := s.carried(ev.Kv, id); l != nil {
				s.applyLocked(e, l, rev)
				s.follow(epoch, e, rev)
			} else {
				s.followKeyLocked(epoch, e, 0, rev)
			}
		case ev.Type == mvccpb.PUT:
			e.marker = rev
			if l := s.carried(ev.Kv, id); l != nil && e.byMarker && rev > e.rev {
				s.applyLocked(e, l, rev) // a rewrite that still names this node
			}
		case e != nil:
			e.marker = 0
			if e.byMarker && rev > e.rev {
				s.applyLocked(e, nil, rev) // unlisted, or the record deleted with its markers
			}
			s.forgetIfDoneLocked(e)
		}
	}
	rev := wr.Events[len(wr.Events)-1].Kv.ModRevision
	s.idx.rev = max(s.idx.rev, rev)
	return rev
}

// carried is the thin record a marker's put carries (encodeThin), which
// is object id's record as the marker's transaction wrote it, with the
// marker's revision and lease; nil for an empty marker, or one that does
// not carry a record of id (which the record's read then settles).
func (s *Store) carried(marker *mvccpb.KeyValue, id string) *listed {
	if len(marker.Value) == 0 {
		return nil
	}
	rec, err := decodeThin(marker.Value)
	if err != nil || rec.ID != id {
		return nil
	}
	return &listed{Record: rec, modRev: marker.ModRevision, lease: clientv3.LeaseID(marker.Lease), thin: true}
}

// follow has e, just loaded as of revision rev, followed from there: by
// its marker alone for a record byMarkerOnly keeps so, by a watch of its
// key otherwise.
func (s *Store) follow(epoch context.Context, e *entry, rev int64) {
	if byMarkerOnly(e.rec) {
		e.byMarker, e.checked = true, s.cfg.Now()
		return
	}
	s.followKeyLocked(epoch, e, rev+1, 0)
}

// followKeyLocked starts the watch of e's record from revision next; with
// next 0 the record is read first, as of revision at (0: the current one).
func (s *Store) followKeyLocked(epoch context.Context, e *entry, next, at int64) {
	ctx, cancel := context.WithCancel(epoch)
	e.stop = cancel
	s.wg.Go(func() { s.followKey(ctx, e, next, at) })
}

// followKey follows e's record from revision next (0: read it first, as of
// revision at, 0 for the current one) until e is forgotten or the epoch
// ends. A broken watch resumes after the last revision applied; one etcd
// compacted away reads the record again, as it is now.
func (s *Store) followKey(ctx context.Context, e *entry, next, at int64) {
	key := ObjectKey(s.cfg.Prefix, e.id)
	for ctx.Err() == nil {
		if next == 0 {
			rev, err := s.readKey(ctx, e, key, at)
			if err != nil {
				at = 0 // compacted, or etcd failed: read what is there now
				s.pause(ctx, time.Second)
				continue
			}
			next = rev + 1
		}
		if next = s.watchKey(ctx, e, key, next); next != 0 && ctx.Err() == nil {
			s.pause(ctx, time.Second)
		}
	}
}

// readKey reads e's record at key as of revision at (0: the current one)
// and loads e with it; it returns the revision read.
func (s *Store) readKey(ctx context.Context, e *entry, key string, at int64) (int64, error) {
	var opts []clientv3.OpOption
	if at != 0 {
		opts = append(opts, clientv3.WithRev(at))
	}
	resp, err := s.cli.Get(ctx, key, opts...)
	if err != nil {
		return 0, err
	}
	rev := resp.Header.Revision
	if at != 0 {
		rev = at
	}
	var kv *mvccpb.KeyValue
	if len(resp.Kvs) == 1 {
		kv = resp.Kvs[0]
	}
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.getLocked(e.id) == e {
		s.loadedLocked(e, kv, rev)
	}
	return rev, nil
}

// watchKey applies the watch of e's record at key from revision next until
// it breaks or ctx ends, and returns the revision to resume at; 0 when
// etcd compacted that revision away.
func (s *Store) watchKey(ctx context.Context, e *entry, key string, next int64) int64 {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for wr := range s.cli.Watch(wctx, key, clientv3.WithPrevKV(), clientv3.WithRev(next)) {
		if wr.CompactRevision > 0 {
			s.log.Debug("record watch compacted; reading it again", zap.String("object", e.id), zap.Int64("from", next))
			return 0
		}
		if rev := s.applyKey(e, wr); rev > 0 {
			next = rev + 1
		}
	}
	return next
}

// applyKey applies one response of e's watch to the holdings and to e, as
// one step (see index.mu), and returns the revision of its last event (0
// for none). Only events advance it: the header's revision of a response
// may run ahead of the events delivered so far (etcd catching a watcher
// up, a thousand revisions at a time).
func (s *Store) applyKey(e *entry, wr clientv3.WatchResponse) int64 {
	if len(wr.Events) == 0 {
		return 0
	}
	s.watchEvents.Add(int64(len(wr.Events)))
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.getLocked(e.id) != e {
		return 0 // forgotten: its watch is ending
	}
	for _, ev := range wr.Events {
		e.rec = nil
		if rec, ok := s.apply(ev); ok {
			e.rec = s.listedAt(ev.Kv, rec)
		}
	}
	e.rev = wr.Events[len(wr.Events)-1].Kv.ModRevision
	s.forgetIfDoneLocked(e)
	return e.rev
}

// whole is l, a record this node follows, as etcd holds it when l is a
// marker's thin copy (l itself otherwise): what a rewrite of the record,
// or a reader, needs. The entry takes it while its record is still the
// one l copies; nil, with no error, when the record is gone.
func (s *Store) whole(ctx context.Context, l *listed) (*listed, error) {
	if !l.thin {
		return l, nil
	}
	resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, l.ID))
	if err != nil {
		return nil, err
	}
	ls := s.decodeListed(resp.Kvs)
	if len(ls) != 1 {
		return nil, nil
	}
	s.idx.mu.Lock()
	if e := s.idx.getLocked(l.ID); e != nil && e.rec != nil && e.rec.thin && e.rec.modRev == ls[0].modRev {
		e.rec = ls[0]
	}
	s.idx.mu.Unlock()
	return ls[0], nil
}

// loadedLocked sets e to the state of its record kv (nil: none) read at
// revision rev, and applies that state to the copies of its object as a
// pass would (judgeLocked). A staged copy past its timeout waits for the
// pass.
func (s *Store) loadedLocked(e *entry, kv *mvccpb.KeyValue, rev int64) {
	var l *listed
	if kv != nil {
		if ls := s.decodeListed([]*mvccpb.KeyValue{kv}); len(ls) == 1 {
			l = ls[0]
		}
	}
	s.applyLocked(e, l, rev)
}

// applyLocked sets e to the record l (nil: none) as of revision rev, and
// applies it to the copies of its object as a pass would (judgeLocked).
func (s *Store) applyLocked(e *entry, l *listed, rev int64) {
	e.rec, e.rev = l, rev
	now := s.cfg.Now()
	for _, c := range s.hold.copiesOf(e.id) {
		s.judgeLocked(c, e, now)
	}
	s.forgetIfDoneLocked(e)
}

// listedAt is rec, read at kv, as the index keeps it; nil for a record at
// another id's key, which this node does not maintain.
func (s *Store) listedAt(kv *mvccpb.KeyValue, rec Record) *listed {
	if id := strings.TrimPrefix(string(kv.Key), ObjectsPrefix(s.cfg.Prefix)); rec.ID != id {
		s.log.Warn("object record at another id's key; not maintained", zap.ByteString("key", kv.Key), zap.String("id", rec.ID))
		return nil
	}
	return &listed{Record: rec, modRev: kv.ModRevision, lease: clientv3.LeaseID(kv.Lease)}
}

// forgetIfDoneLocked stops following e once it is loaded, its record no
// longer names this node and its marker is gone. A record that names this
// node stays followed without a marker (one checkUnnamed found); a marker
// whose record does not name it is dropped by the next pass.
func (s *Store) forgetIfDoneLocked(e *entry) {
	if e.rev != 0 && e.marker == 0 && !e.names(s.cfg.Node) {
		s.idx.forgetLocked(e)
	}
}

// pause waits d, or until ctx ends.
func (s *Store) pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// apply reacts to one record event. A copy that a newer record state has
// already reached (through a read) ignores the event. It returns the
// record a put leaves; ok is false for a delete, and for a put whose value
// does not decode.
func (s *Store) apply(ev *clientv3.Event) (put Record, ok bool) {
	rev := ev.Kv.ModRevision
	switch ev.Type {
	case mvccpb.PUT:
		rec, err := decodeRecord(ev.Kv.Value)
		if err != nil {
			return Record{}, false
		}
		ref, listed := rec.Holds(s.cfg.Node)
		for _, c := range s.hold.copiesOf(rec.ID) {
			switch {
			case listed && c.ref.ID == ref.ID:
				s.hold.commit(c.ref.ID, rev)
			case c.committed:
				s.hold.dropIf(c.ref.ID, staleBefore(rev, true)) // superseded by a newer put of the same id
			}
		}
		if listed && len(rec.Holders) < rec.Replicas && ev.PrevKv != nil {
			// A holder left the record (one restarted without its copy
			// removes itself): repair now, not at the next periodic pass,
			// so a second loss soon after does not take the last copy.
			if prev, err := decodeRecord(ev.PrevKv.Value); err == nil && len(prev.Holders) > len(rec.Holders) {
				s.Kick()
			}
		}
		return rec, true
	case mvccpb.DELETE:
		if ev.PrevKv == nil {
			return Record{}, false
		}
		rec, err := decodeRecord(ev.PrevKv.Value)
		if err != nil {
			return Record{}, false
		}
		ref, listed := rec.Holds(s.cfg.Node)
		for _, c := range s.hold.copiesOf(rec.ID) {
			named := listed && c.ref.ID == ref.ID
			s.hold.dropIf(c.ref.ID, staleBefore(rev, !named))
		}
	}
	return Record{}, false
}
