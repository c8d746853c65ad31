package cache

import (
	"context"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// watchLoop follows the object records: a record that names one of our
// staged copies commits it; a record deleted, or rewritten without our
// copy, frees it. A watch that etcd compacted away is replaced by a full
// reconcile, then watched from there.
func (s *Store) watchLoop() {
	var next int64
	for s.ctx.Err() == nil {
		if next == 0 {
			ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
			ls, rev, err := s.list(ctx, "")
			cancel()
			if err != nil {
				s.log.Warn("list objects", zap.Error(err))
				s.pause(time.Second)
				continue
			}
			s.reconcile(ls, rev)
			next = rev + 1
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
		for wr := range s.cli.Watch(wctx, ObjectsPrefix(s.cfg.Prefix), clientv3.WithPrefix(), clientv3.WithPrevKV(), clientv3.WithRev(next)) {
			if wr.CompactRevision > 0 {
				s.log.Info("object watch compacted; reconciling", zap.Int64("from", next), zap.Int64("compacted", wr.CompactRevision))
				next = 0
				break
			}
			for _, ev := range wr.Events {
				s.apply(ev)
			}
			if wr.Header.Revision > 0 {
				next = wr.Header.Revision + 1
			}
		}
		cancel()
		s.pause(time.Second) // the watch broke (leader loss, etcd restart): re-establish
	}
}

func (s *Store) pause(d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.ctx.Done():
	}
}

// apply reacts to one record event. A copy that a newer record state has
// already reached (through a maintenance list) ignores the event.
func (s *Store) apply(ev *clientv3.Event) {
	rev := ev.Kv.ModRevision
	switch ev.Type {
	case mvccpb.PUT:
		rec, err := decodeRecord(ev.Kv.Value)
		if err != nil {
			return
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
	case mvccpb.DELETE:
		if ev.PrevKv == nil {
			return
		}
		rec, err := decodeRecord(ev.PrevKv.Value)
		if err != nil {
			return
		}
		ref, listed := rec.Holds(s.cfg.Node)
		for _, c := range s.hold.copiesOf(rec.ID) {
			named := listed && c.ref.ID == ref.ID
			s.hold.dropIf(c.ref.ID, staleBefore(rev, !named))
		}
	}
}

// reconcile compares the copies held with the records listed at revision
// rev: listed copies are committed, committed copies no record lists are
// freed, and staged copies older than StageTimeout with no record are
// dropped. It runs on every maintenance pass and after a compacted watch,
// whose deletions were lost. A copy the watch has meanwhile seen in a newer
// record state is left to the watch: the list is older than what it knows.
func (s *Store) reconcile(ls []listed, rev int64) {
	byID := make(map[string]Record, len(ls))
	for _, l := range ls {
		byID[l.ID] = l.Record
	}
	now := s.cfg.Now()
	for _, c := range s.hold.snapshot() {
		rec, ok := byID[c.object]
		ref, listed := rec.Holds(s.cfg.Node)
		switch {
		case ok && listed && ref.ID == c.ref.ID:
			s.hold.commit(c.ref.ID, rev)
		case c.committed:
			if s.hold.dropIf(c.ref.ID, staleBefore(rev, true)) {
				s.log.Debug("freed a copy no record names", zap.String("object", c.object))
			}
		case now.Sub(c.stagedAt) > s.cfg.StageTimeout:
			if s.hold.dropIf(c.ref.ID, staleBefore(rev, false)) {
				s.log.Info("dropped a staged copy whose put never committed", zap.String("object", c.object), zap.Duration("age", now.Sub(c.stagedAt)))
			}
		}
	}
}

// maintainLoop runs a maintenance pass every MaintainEvery, and at once
// when kicked.
func (s *Store) maintainLoop() {
	t := time.NewTicker(s.cfg.MaintainEvery)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		case <-s.kick:
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		s.maintain(ctx)
		cancel()
	}
}

// maintain is one pass over every record: reconcile our copies, repair the
// objects this node is responsible for, and collect if this node is the
// collector. One range read per pass.
func (s *Store) maintain(ctx context.Context) {
	ls, rev, err := s.list(ctx, "")
	if err != nil {
		s.log.Debug("maintenance: list objects", zap.Error(err))
		return
	}
	s.reconcile(ls, rev)
	for _, l := range ls {
		if ctx.Err() != nil {
			return
		}
		s.unlistMissing(ctx, l)
	}
	members := s.members()
	alive := make(map[string]bool, len(members))
	for _, m := range members {
		alive[m.Node] = true
	}
	for _, l := range ls {
		if ctx.Err() != nil {
			return
		}
		s.repair(ctx, l, members, alive)
	}
	if r := rank(members, collectorKey); len(r) > 0 && r[0].Node == s.cfg.Node {
		s.collect(ctx, ls, alive)
	}
}

// unlistMissing removes this node from a record that names a copy it does
// not hold (a put committed after its staged copy timed out, an eviction
// whose record delete failed, a commit that raced an abort): a record must
// not send readers to a copy that is gone. Repair then adds a new holder;
// a record left with no holder is deleted. Copies enter the holdings before
// any record can name them, so a named copy that is missing is gone.
func (s *Store) unlistMissing(ctx context.Context, l listed) {
	ref, ok := l.Holds(s.cfg.Node)
	if !ok || s.hold.has(ref.ID) {
		return
	}
	key := ObjectKey(s.cfg.Prefix, l.ID)
	rec := l.Record
	rec.Holders = nil
	for _, h := range l.Holders {
		if h.Node != s.cfg.Node || h.Ref.ID != ref.ID {
			rec.Holders = append(rec.Holders, h)
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
	if err == nil && resp.Succeeded {
		s.log.Warn("record named a copy this node does not hold; removed it", zap.String("object", l.ID), zap.Int("holders_left", len(rec.Holders)))
	}
}

// repair brings an object back to its replica count. The first live holder
// in the record is responsible, so exactly one node acts per object; it
// copies its own copy onto new holders chosen by rendezvous and rewrites the
// record, if no one else changed it meanwhile, naming the new holders in
// place of holders that are not alive (those not replaced stay named). Cache objects are not
// repaired: losing one costs a recompute, not a job.
func (s *Store) repair(ctx context.Context, l listed, members []Member, alive map[string]bool) {
	if l.Mode == Cache {
		return
	}
	var live []Holder
	for _, h := range l.Holders {
		if alive[h.Node] {
			live = append(live, h)
		}
	}
	if len(live) == 0 || live[0].Node != s.cfg.Node || (len(live) == len(l.Holders) && len(live) >= l.Replicas) {
		return
	}
	exclude := map[string]bool{}
	for _, h := range l.Holders {
		exclude[h.Node] = true
	}
	var added []Holder
	if need := l.Replicas - len(live); need > 0 {
		cands := place(members, l.ID, l.Size, exclude)
		var err error
		if added, err = s.stageOnto(ctx, l.ID, l.Mode, live[0].Ref, cands, need); err != nil {
			s.log.Debug("re-replication found no room", zap.String("object", l.ID), zap.Error(err))
			added = nil
		}
	}
	holders := append(live, added...)
	// A holder not alive now may be cut off or paused with its copy
	// intact, and come back: it is dropped only when a new copy takes its
	// place. Dropping it sooner would leave its copy unnamed, freed when
	// it returns, and the object with fewer copies than it had.
	for _, h := range l.Holders {
		if len(holders) >= l.Replicas {
			break
		}
		if !alive[h.Node] {
			holders = append(holders, h)
		}
	}
	if len(added) == 0 && len(holders) == len(l.Holders) {
		return // nothing gained and nobody to drop: leave the record be
	}
	rec := l.Record
	rec.Holders = holders
	key := ObjectKey(s.cfg.Prefix, l.ID)
	put := clientv3.OpPut(key, encodeRecord(rec))
	if l.lease != 0 {
		put = clientv3.OpPut(key, encodeRecord(rec), clientv3.WithLease(l.lease))
	}
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", l.modRev)).Then(put).Commit()
	if err != nil || !resp.Succeeded {
		st := &Staged{s: s, Record: Record{ID: l.ID, Holders: added}}
		st.Abort(ctx)
		return
	}
	s.repairs.Add(1)
	s.log.Info("object re-replicated", zap.String("object", l.ID),
		zap.Int("live", len(live)), zap.Int("added", len(added)), zap.Int("want", l.Replicas))
}

// goneFor returns, for each holder named in ls that is neither alive nor
// registered, how long this collector has seen it so on every pass; a
// holder seen again starts over. With known false (etcd could not be
// read) no holder is counted gone.
func (s *Store) goneFor(ls []listed, alive, registered map[string]bool, known bool, now time.Time) map[string]time.Duration {
	s.goneMu.Lock()
	defer s.goneMu.Unlock()
	next := map[string]time.Time{}
	out := map[string]time.Duration{}
	for _, l := range ls {
		for _, h := range l.Holders {
			if !known || alive[h.Node] || registered[h.Node] {
				continue
			}
			since, ok := s.goneSince[h.Node]
			if !ok {
				since = now
			}
			next[h.Node] = since
			out[h.Node] = now.Sub(since)
		}
	}
	s.goneSince = next // nodes no record names are forgotten
	return out
}

// collect deletes records nobody will use: objects every holder of which
// has been gone for LostGrace (lost), records past their retention plus ExpiryGrace (etcd extends
// leases on a leader change), and objects the agent says are orphans.
func (s *Store) collect(ctx context.Context, ls []listed, alive map[string]bool) {
	now := s.cfg.Now()
	why := map[string]string{}
	// A holder gossip calls dead may be alive and this node's view stale
	// (it was just cut off, or has just healed): an object is lost only when
	// etcd, read now, has no registration for any of its holders.
	var registered map[string]bool
	if s.cfg.Registered != nil {
		reg, err := s.cfg.Registered(ctx)
		if err != nil {
			s.log.Debug("collector: registered nodes", zap.Error(err))
			reg = nil
		}
		registered = reg
	}
	known := s.cfg.Registered == nil || registered != nil
	gone := s.goneFor(ls, alive, registered, known, now)
	for _, l := range ls {
		// A record with no holder left is lost at once: every holder
		// unlisted itself, having found its copy gone.
		lost := known
		for _, h := range l.Holders {
			d, isGone := gone[h.Node]
			lost = lost && isGone && d >= s.cfg.LostGrace
		}
		switch {
		case lost:
			why[l.ID] = "lost"
		case !l.ExpiresAt.IsZero() && now.After(l.ExpiresAt.Add(s.cfg.ExpiryGrace)):
			why[l.ID] = "expired"
		}
	}
	if s.orphans != nil {
		recs := make([]Record, 0, len(ls))
		for _, l := range ls {
			if why[l.ID] == "" {
				recs = append(recs, l.Record)
			}
		}
		ids, err := s.orphans(ctx, recs)
		if err != nil {
			s.log.Debug("collector: orphans", zap.Error(err))
		}
		for _, id := range ids {
			why[id] = "orphaned"
		}
	}
	for _, l := range ls {
		reason := why[l.ID]
		if reason == "" {
			continue
		}
		key := ObjectKey(s.cfg.Prefix, l.ID)
		resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", l.modRev)).Then(clientv3.OpDelete(key)).Commit()
		if err != nil || !resp.Succeeded {
			continue
		}
		if reason == "lost" {
			s.lost.Add(1)
		}
		s.collected.Add(1)
		s.log.Info("object collected", zap.String("object", l.ID), zap.String("reason", reason), zap.String("job", l.Job))
	}
}
