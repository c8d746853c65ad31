package cache

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// reconcileLocked compares the copies held with the entries (see
// judgeLocked): named copies are committed, committed copies no record
// names are freed, and recovered copies are kept while a record names this
// node for their object (maintenance reannounces them) and freed
// otherwise. It runs once the markers are listed (start, a compacted
// marker watch, a replaced etcd) and on every maintenance pass. It
// returns, for the caller to check with etcd itself (checkUnnamed), the
// copies no followed record names that are due: staged copies older than
// StageTimeout (a record may name them that this node does not follow yet)
// and recovered copies of objects no marker points to. loading reports
// entries whose record has not come yet: their copies wait.
func (s *Store) reconcileLocked() (unnamed []copyOf, loading bool) {
	now := s.cfg.Now()
	for _, c := range s.hold.snapshot() {
		e := s.idx.getLocked(c.object)
		switch {
		case e == nil && (c.recovered || now.Sub(c.stagedAt) > s.cfg.StageTimeout && !c.committed):
			unnamed = append(unnamed, c)
		case e == nil && c.committed:
			// Committed by a record this node followed, which then went or
			// stopped naming it: only an etcd replaced since (whose list
			// has no marker for it) leaves such a copy here.
			if s.hold.dropIf(c.ref.ID, staleBefore(s.idx.rev, true)) {
				s.log.Debug("freed a copy no record names", zap.String("object", c.object))
			}
		case e == nil:
		case e.rev == 0:
			loading = true
		case s.judgeLocked(c, e, now):
			unnamed = append(unnamed, c)
		}
	}
	return unnamed, loading
}

// judgeLocked applies e's record state to copy c of its object: a named
// copy is committed; a recovered copy is freed unless the record names this
// node for an object of the same checksum; a committed copy the record
// does not name is freed, unless it has seen a record state newer than e's
// (the entry lags what it knows). It reports a staged copy older than
// StageTimeout that the record does not name: the caller checks etcd
// before dropping it.
func (s *Store) judgeLocked(c copyOf, e *entry, now time.Time) (unnamed bool) {
	var ref transfer.Ref
	named := false
	if e.rec != nil {
		ref, named = e.rec.Holds(s.cfg.Node)
	}
	switch {
	case named && ref.ID == c.ref.ID:
		s.hold.commit(c.ref.ID, e.rev)
	case c.recovered:
		if !named || e.rec.Checksum != c.ref.Checksum {
			if s.hold.dropIf(c.ref.ID, func(c *copyOf) bool { return c.recovered }) {
				s.log.Info("freed a recovered copy no record wants", zap.String("object", c.object))
			}
		}
	case c.committed:
		if s.hold.dropIf(c.ref.ID, staleBefore(e.rev, true)) {
			s.log.Debug("freed a copy no record names", zap.String("object", c.object))
		}
	case now.Sub(c.stagedAt) > s.cfg.StageTimeout:
		return true
	}
	return false
}

// checkUnnamed reads the record of each copy reconcile found unnamed and
// due, then keeps the copy if the record names it, and drops it otherwise:
// a staged copy may be named by a put committed through any path (a commit
// retried across an outage, a reclaimed task), which this node's entries
// may lag by the length of an outage; a recovered copy by a record whose
// marker is missing (written before markers existed). A record that names
// the copy of an object this node does not follow is followed from then
// on. While etcd does not answer, nothing is dropped.
func (s *Store) checkUnnamed(ctx context.Context, unnamed []copyOf) {
	now := s.cfg.Now()
	for _, c := range unnamed {
		resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, c.object))
		if err != nil {
			s.log.Debug("unnamed copy; etcd did not answer, kept", zap.String("object", c.object), zap.Error(err))
			return
		}
		if len(resp.Kvs) == 1 {
			if rec, err := decodeRecord(resp.Kvs[0].Value); err == nil {
				if ref, ok := rec.Holds(s.cfg.Node); ok && (ref.ID == c.ref.ID || c.recovered && rec.Checksum == c.ref.Checksum) {
					s.followNamed(rec, resp)
					continue
				}
			}
		}
		if c.recovered {
			if s.hold.dropIf(c.ref.ID, func(c *copyOf) bool { return c.recovered }) {
				s.log.Info("freed a recovered copy no record wants", zap.String("object", c.object))
			}
			continue
		}
		stagedAt := c.stagedAt
		if s.hold.dropIf(c.ref.ID, func(c *copyOf) bool { return !c.committed && !c.stagedAt.After(stagedAt) }) {
			s.log.Info("dropped a staged copy whose put never committed", zap.String("object", c.object), zap.Duration("age", now.Sub(c.stagedAt)))
		}
	}
}

// followNamed applies rec, read in resp, which names one of this node's
// copies, to the copies, and follows the record unless it is followed
// already (its watch then brings that state, or a newer one).
func (s *Store) followNamed(rec Record, resp *clientv3.GetResponse) {
	epoch := s.currentEpoch()
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.rev == 0 || s.idx.getLocked(rec.ID) != nil {
		ref, _ := rec.Holds(s.cfg.Node)
		s.hold.commit(ref.ID, resp.Kvs[0].ModRevision)
		return
	}
	e := s.idx.addLocked(rec.ID)
	s.loadedLocked(e, resp.Kvs[0], resp.Header.Revision)
	s.followKeyLocked(epoch, e, resp.Header.Revision+1, 0)
}

// dropMarkers deletes this node's markers whose records no longer name it
// (stale: marker revision by object id), each only if it is still the
// marker seen, so that one a new record wrote meanwhile stays. A marker
// left by a failed delete is tried again on the next pass.
func (s *Store) dropMarkers(ctx context.Context, stale map[string]int64) {
	var ops []clientv3.Op
	flush := func() {
		if len(ops) == 0 {
			return
		}
		if _, err := s.cli.Txn(ctx).Then(ops...).Commit(); err != nil {
			s.log.Debug("dropping stale markers", zap.Int("markers", len(ops)), zap.Error(err))
		}
		ops = ops[:0]
	}
	for id, rev := range stale {
		key := markerKey(s.cfg.Prefix, s.cfg.Node, id)
		ops = append(ops, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", rev)},
			[]clientv3.Op{clientv3.OpDelete(key)}, nil))
		if len(ops) == loadBatch {
			flush()
		}
	}
	flush()
}

// maintainLoop runs a maintenance pass every MaintainEvery, at once when
// kicked, and RepairRetry after a pass that left an object of this node's
// short of copies (a repair failed, or waits for a record to be fixed).
func (s *Store) maintainLoop() {
	t := time.NewTicker(s.cfg.MaintainEvery)
	defer t.Stop()
	retry := time.NewTimer(s.cfg.RepairRetry)
	retry.Stop()
	defer retry.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		case <-s.kick:
		case <-retry.C:
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		pending := s.maintain(ctx)
		cancel()
		if pending {
			retry.Reset(s.cfg.RepairRetry)
		}
	}
}

// maintain is one pass over the records that name this node: reconcile
// our copies with them, then tend them, and collect if this node is the
// collector. It reads none of this node's records from etcd; its watches
// keep them current. While the markers are not listed (at start, or while
// the watch lists again) a pass does nothing. pending reports that the
// pass left work for a pass soon.
func (s *Store) maintain(ctx context.Context) (pending bool) {
	ls, unnamed, stale, loading, ok := s.reconcileIndex()
	if !ok {
		s.log.Debug("maintenance: this node's records are loading; pass skipped")
		return true
	}
	s.checkUnnamed(ctx, unnamed)
	s.dropMarkers(ctx, stale)
	s.verify(ctx)
	return s.tend(ctx, ls) || loading
}

// reconcileIndex reconciles the copies held with the entries, under the
// index's lock, and returns the records it reconciled with, the copies to
// check with etcd, and this node's stale markers.
func (s *Store) reconcileIndex() (ls []*listed, unnamed []copyOf, stale map[string]int64, loading, ok bool) {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.rev == 0 {
		return nil, nil, nil, false, false
	}
	unnamed, loading = s.reconcileLocked()
	stale = map[string]int64{}
	for _, e := range s.idx.entries {
		if e.rev != 0 && e.marker != 0 && !e.names(s.cfg.Node) {
			stale[e.id] = e.marker
		}
	}
	return s.idx.recordsLocked(), unnamed, stale, loading, true
}

// tend is the rest of a pass over the records ls (in id order): unlist
// the copies this node named in a record but lost, repair the objects this
// node is responsible for, and collect if this node is the collector. The
// records may be a little behind etcd; every write is conditional on the
// record's revision, so one that changed meanwhile is left for the next
// pass.
func (s *Store) tend(ctx context.Context, ls []*listed) (pending bool) {
	for _, l := range ls {
		if ctx.Err() != nil {
			return true
		}
		if s.unlistMissing(ctx, l) {
			pending = true // the record changed under this pass: repair it on the next
		}
	}
	members := s.members()
	alive := make(map[string]bool, len(members))
	for _, m := range members {
		alive[m.Node] = true
	}
	if s.repairAll(ctx, ls, members, alive) {
		pending = true
	}
	if r := rank(members, collectorKey); len(r) > 0 && r[0].Node == s.cfg.Node {
		s.collect(ctx, alive)
	}
	return pending
}

// unlistMissing corrects a record that names a copy this node does not
// hold. When the node holds a recovered durable copy of the object (it
// restarted with the file on disk) the record names that copy instead: the
// object keeps its holder. Otherwise the node removes itself, and its
// marker (a put committed after its staged copy timed out, an eviction
// whose record delete failed, a commit that raced an abort, a restart that
// lost a memory copy): a record must not send readers to a copy that is
// gone. Repair then adds a new holder; a record left with no holder is
// deleted. Copies enter the holdings before any record can name them, so a
// named copy that is missing is gone.
func (s *Store) unlistMissing(ctx context.Context, l *listed) (changed bool) {
	ref, ok := l.Holds(s.cfg.Node)
	if !ok || s.hold.has(ref.ID) {
		return false
	}
	l, err := s.whole(ctx, l)
	if err != nil || l == nil {
		return true // gone (its watch says so), or etcd away: the next pass
	}
	if ref, ok = l.Holds(s.cfg.Node); !ok || s.hold.has(ref.ID) {
		return true
	}
	var recovered *copyOf
	for _, c := range s.hold.copiesOf(l.ID) {
		if c.recovered && c.ref.Checksum == l.Checksum {
			recovered = &c
			break
		}
	}
	rec := l.Record
	rec.Holders = nil
	for _, h := range l.Holders {
		switch {
		case h.Node != s.cfg.Node || h.Ref.ID != ref.ID:
			rec.Holders = append(rec.Holders, h)
		case recovered != nil:
			rec.Holders = append(rec.Holders, Holder{Node: s.cfg.Node, Tier: recovered.tier, Ref: recovered.ref})
		}
	}
	next := &rec
	if len(rec.Holders) == 0 {
		next = nil
	}
	resp, err := s.writeIf(ctx, l, next)
	switch {
	case err != nil || !resp.Succeeded:
	case recovered != nil:
		s.reannounced.Add(1)
		s.log.Info("recovered copy named in its record again", zap.String("object", l.ID), zap.String("tier", string(recovered.tier)))
	default:
		s.log.Warn("record named a copy this node does not hold; removed it", zap.String("object", l.ID), zap.Int("holders_left", len(rec.Holders)))
	}
	return true // changed, or to be tried again
}

// writeIf replaces the record l with rec (nil: deletes it), with their
// holders' markers (writeOps), if the record is still at l's revision.
func (s *Store) writeIf(ctx context.Context, l *listed, rec *Record) (*clientv3.TxnResponse, error) {
	key := ObjectKey(s.cfg.Prefix, l.ID)
	return s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", l.modRev)).
		Then(writeOps(s.cfg.Prefix, l.ID, rec, l.lease, l.Holders)...).Commit()
}

// verify reads again, in one read, up to loadBatch of the records this
// node follows by its markers alone that it has not read for VerifyEvery,
// and applies what etcd holds now: a write its marker did not hear of (a
// blind put over the record, a blind delete) reaches the copy here, and
// a record gone frees it. A record changed meanwhile by a marker's event
// (newer than the read) is left as that event set it.
func (s *Store) verify(ctx context.Context) {
	due := s.cfg.Now().Add(-s.cfg.VerifyEvery)
	var ids []string
	s.idx.mu.Lock()
	for id, e := range s.idx.entries {
		if e.byMarker && e.checked.Before(due) {
			ids = append(ids, id)
			if len(ids) == loadBatch {
				break
			}
		}
	}
	s.idx.mu.Unlock()
	if len(ids) == 0 {
		return
	}
	kvs, rev, err := s.readRecords(ctx, ids)
	if err != nil {
		s.log.Debug("verifying records followed by their markers", zap.Int("records", len(ids)), zap.Error(err))
		return
	}
	now := s.cfg.Now()
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	for i, id := range ids {
		e := s.idx.getLocked(id)
		if e == nil || !e.byMarker || e.rev > rev {
			continue
		}
		named := e.names(s.cfg.Node)
		s.loadedLocked(e, kvs[i], rev)
		e.checked = now
		if named && !e.names(s.cfg.Node) {
			s.log.Info("a record followed by its marker changed unannounced; applied", zap.String("object", id), zap.Bool("gone", kvs[i] == nil))
		}
	}
}
