package cache

import (
	"context"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// watchLoop follows the object records into the index and the holdings:
// a record that names one of our staged copies commits it; a record
// deleted, or rewritten without our copy, frees it. It lists the records
// first, and again when etcd compacted the watch away or was replaced,
// loading the index and reconciling the copies with the list, then watches
// from the list's revision.
func (s *Store) watchLoop() {
	epoch := s.currentEpoch()
	var next int64    // the revision to follow from; 0: list first
	replaced := false // etcd was replaced: run a pass once listed again
	for s.ctx.Err() == nil {
		if epoch.Err() != nil {
			// The index and the copies' revisions follow a history the
			// new etcd does not have. The reset waits for a pass that is
			// reconciling, and stops the next ones until the list.
			s.log.Info("etcd replaced; listing the objects again")
			s.idx.reset()
			s.hold.forgetRevisions()
			epoch, next, replaced = s.currentEpoch(), 0, true
		}
		if next == 0 {
			ctx, cancel := context.WithTimeout(epoch, 10*time.Second)
			ls, rev, err := s.list(ctx, "")
			cancel()
			if err != nil {
				if epoch.Err() == nil {
					s.log.Warn("list objects", zap.Error(err))
					s.pause(s.ctx, time.Second)
				}
				continue
			}
			s.idx.mu.Lock()
			s.idx.loadLocked(ls, rev)
			s.reconcile(ls, rev) // staged copies past their timeout wait for the pass
			s.idx.mu.Unlock()
			next = rev + 1
			if replaced || s.hold.anyRecovered() {
				s.Kick() // judge every copy by the new etcd; name recovered copies again
			}
			replaced = false
		}
		if next = s.follow(epoch, next); next != 0 && epoch.Err() == nil {
			s.pause(s.ctx, time.Second) // the watch broke (leader loss, etcd restart): re-establish
		}
	}
}

// follow applies the object watch from revision next until it breaks or
// epoch ends, and returns the revision to resume at; 0 (the index reset
// for a new list) when etcd compacted that revision away.
func (s *Store) follow(epoch context.Context, next int64) int64 {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(epoch))
	defer cancel()
	for wr := range s.cli.Watch(ctx, ObjectsPrefix(s.cfg.Prefix), clientv3.WithPrefix(), clientv3.WithPrevKV(), clientv3.WithRev(next)) {
		if wr.CompactRevision > 0 {
			s.log.Info("object watch compacted; listing again", zap.Int64("from", next), zap.Int64("compacted", wr.CompactRevision))
			s.idx.reset()
			return 0
		}
		if rev := s.applyResponse(wr); rev > 0 {
			next = rev + 1
		}
	}
	return next
}

// applyResponse applies one watch response to the holdings and the index,
// as one step (see index.mu), and returns the revision of its last event
// (0 for none). A response holds whole revisions, so the index is whole
// through that one. Only events advance it: the header's revision of a
// response may run ahead of the events delivered so far (etcd catching a
// watcher up, a thousand revisions at a time).
func (s *Store) applyResponse(wr clientv3.WatchResponse) int64 {
	if len(wr.Events) == 0 {
		return 0
	}
	objects := ObjectsPrefix(s.cfg.Prefix)
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	for _, ev := range wr.Events {
		rec, ok := s.apply(ev)
		id := strings.TrimPrefix(string(ev.Kv.Key), objects)
		switch {
		case ok && rec.ID == id:
			s.idx.putLocked(&listed{Record: rec, modRev: ev.Kv.ModRevision, lease: clientv3.LeaseID(ev.Kv.Lease)})
		case ok:
			s.log.Warn("object record at another id's key; not maintained", zap.ByteString("key", ev.Kv.Key), zap.String("id", rec.ID))
			s.idx.deleteLocked(id)
		default: // deleted, or rewritten with a value that does not decode
			s.idx.deleteLocked(id)
		}
	}
	rev := wr.Events[len(wr.Events)-1].Kv.ModRevision
	s.idx.rev = max(s.idx.rev, rev)
	s.idx.changedLocked()
	return rev
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
// already reached (through a list) ignores the event. It returns the
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

// reconcile compares the copies held with the records ls (in id order)
// that are whole through revision rev: named copies are committed,
// committed copies no record names are freed, and recovered copies are kept
// while a record names this node for their object (maintenance reannounces
// them) and freed otherwise. It runs on every list (start, a compacted
// watch, whose deletions were lost, a replaced etcd) and on every
// maintenance pass, with the index. A copy that has seen a record state
// newer than rev is left alone: ls is older than what it knows. Staged
// copies older than StageTimeout that no record names are returned, for
// the caller to check with etcd itself before dropping them (expireStaged):
// ls may lag a commit that names them.
func (s *Store) reconcile(ls []*listed, rev int64) (expired []copyOf) {
	now := s.cfg.Now()
	for _, c := range s.hold.snapshot() {
		var ref transfer.Ref
		named := false
		l := lookup(ls, c.object)
		if l != nil {
			ref, named = l.Holds(s.cfg.Node)
		}
		switch {
		case named && ref.ID == c.ref.ID:
			s.hold.commit(c.ref.ID, rev)
		case c.recovered:
			if !named || l.Checksum != c.ref.Checksum {
				if s.hold.dropIf(c.ref.ID, func(c *copyOf) bool { return c.recovered }) {
					s.log.Info("freed a recovered copy no record wants", zap.String("object", c.object))
				}
			}
		case c.committed:
			if s.hold.dropIf(c.ref.ID, staleBefore(rev, true)) {
				s.log.Debug("freed a copy no record names", zap.String("object", c.object))
			}
		case now.Sub(c.stagedAt) > s.cfg.StageTimeout:
			expired = append(expired, c)
		}
	}
	return expired
}

// expireStaged drops the staged copies reconcile found past StageTimeout,
// each after reading its record from etcd: a put committed through any
// path (a commit retried across an outage, a reclaimed task) names its
// copy, and the copy is then committed, not dropped. While etcd does not
// answer, nothing is dropped.
func (s *Store) expireStaged(ctx context.Context, expired []copyOf) {
	now := s.cfg.Now()
	for _, c := range expired {
		resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, c.object))
		if err != nil {
			s.log.Debug("staged copy past its timeout; etcd did not answer, kept", zap.String("object", c.object), zap.Error(err))
			return
		}
		if len(resp.Kvs) == 1 {
			if rec, err := decodeRecord(resp.Kvs[0].Value); err == nil {
				if ref, ok := rec.Holds(s.cfg.Node); ok && ref.ID == c.ref.ID {
					s.hold.commit(c.ref.ID, resp.Kvs[0].ModRevision)
					continue
				}
			}
		}
		stagedAt := c.stagedAt
		if s.hold.dropIf(c.ref.ID, func(c *copyOf) bool { return !c.committed && !c.stagedAt.After(stagedAt) }) {
			s.log.Info("dropped a staged copy whose put never committed", zap.String("object", c.object), zap.Duration("age", now.Sub(c.stagedAt)))
		}
	}
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

// maintain is one pass over the records of the index: reconcile our
// copies with them, then tend them. It reads no record from etcd; the
// watch keeps the index current. While the index is not loaded (at start,
// or while the watch lists again) a pass does nothing. pending reports
// that the pass left work for a pass soon.
func (s *Store) maintain(ctx context.Context) (pending bool) {
	ls, expired, ok := s.reconcileIndex()
	if !ok {
		s.log.Debug("maintenance: the record index is loading; pass skipped")
		return true
	}
	s.expireStaged(ctx, expired)
	return s.tend(ctx, ls)
}

// reconcileIndex reconciles the copies held with the index, under its
// lock, and returns the records it reconciled with.
func (s *Store) reconcileIndex() (ls []*listed, expired []copyOf, ok bool) {
	s.idx.mu.Lock()
	defer s.idx.mu.Unlock()
	if s.idx.rev == 0 {
		return nil, nil, false
	}
	expired = s.reconcile(s.idx.recs, s.idx.rev)
	return slices.Clone(s.idx.recs), expired, true
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
// object keeps its holder. Otherwise the node removes itself (a put
// committed after its staged copy timed out, an eviction whose record
// delete failed, a commit that raced an abort, a restart that lost a
// memory copy): a record must not send readers to a copy that is gone.
// Repair then adds a new holder; a record left with no holder is deleted.
// Copies enter the holdings before any record can name them, so a named
// copy that is missing is gone.
func (s *Store) unlistMissing(ctx context.Context, l *listed) (changed bool) {
	ref, ok := l.Holds(s.cfg.Node)
	if !ok || s.hold.has(ref.ID) {
		return false
	}
	var recovered *copyOf
	for _, c := range s.hold.copiesOf(l.ID) {
		if c.recovered && c.ref.Checksum == l.Checksum {
			recovered = &c
			break
		}
	}
	key := ObjectKey(s.cfg.Prefix, l.ID)
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
	op := clientv3.OpDelete(key)
	switch {
	case len(rec.Holders) > 0 && l.lease != 0:
		op = clientv3.OpPut(key, encodeRecord(rec), clientv3.WithLease(l.lease))
	case len(rec.Holders) > 0:
		op = clientv3.OpPut(key, encodeRecord(rec))
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", l.modRev)).Then(op).Commit()
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
