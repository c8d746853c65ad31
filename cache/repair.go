package cache

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Repair.
//
// An object short of live copies is repaired by its first live holder, so
// exactly one node acts per object. The objects of one pass are repaired
// side by side (Config.RepairParallel), each holder asked under its own
// short deadline (Config.RepairTimeout plus time for the bytes), so one
// paused or cut-off candidate costs its object one deadline, not the pass.
// New holders are chosen by rendezvous, but members that are suspect in
// gossip or joined only recently (Config.RecentJoin: a node that has just
// come back from a crash, likely to be the next to go) are tried last.

// joins is the repair state a Store keeps across passes: since when each
// member has been one without a break, for RecentJoin.
type joins struct {
	mu sync.Mutex
	// mu guards since.
	since map[string]time.Time // node -> since when it has been a member
}

// observe notes the members of this pass, and returns since when each has
// been a member: a node absent from one pass starts over when it returns.
func (j *joins) observe(members []Member, now time.Time) map[string]time.Time {
	j.mu.Lock()
	defer j.mu.Unlock()
	next := make(map[string]time.Time, len(members))
	for _, m := range members {
		since, ok := j.since[m.Node]
		if !ok {
			since = now
			if j.since == nil { // the first pass: everyone was there before us
				since = time.Time{}
			}
		}
		next[m.Node] = since
	}
	j.since = next
	return next
}

// repairAll repairs, side by side, the objects of ls this node is
// responsible for. pending reports that one of them is still short of
// copies.
func (s *Store) repairAll(ctx context.Context, ls []*listed, members []Member, alive map[string]bool) (pending bool) {
	now := s.cfg.Now()
	joined := s.joins.observe(members, now)
	var todo []*listed
	for _, l := range ls {
		if s.repairsHere(l, alive) {
			todo = append(todo, l)
		}
	}
	if len(todo) == 0 {
		return false
	}
	if s.cfg.IsMember != nil && !s.cfg.IsMember(s.h.ID().String()) {
		// Not registered (back from a pause or a partition, its lease
		// gone): the others refuse its requests until it is again.
		s.log.Debug("repairs wait for this node's registration", zap.Int("objects", len(todo)))
		return true
	}
	cands := s.repairCandidates(members, joined, now)
	sem := make(chan struct{}, s.cfg.RepairParallel)
	var wg sync.WaitGroup
	var short atomic.Bool
	for _, l := range todo {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return true
		}
		wg.Go(func() {
			defer func() { <-sem }()
			// ls may hold a marker's thin copy, and a record read now may
			// have changed since (a holder gone, this node unlisted): it
			// is judged again, and one this node no longer repairs is left
			// to the pass that reads it next.
			l, err := s.whole(ctx, l)
			if err != nil || l != nil && s.repairsHere(l, alive) && !s.repair(ctx, l, cands, alive) {
				short.Store(true)
			}
		})
	}
	wg.Wait()
	return short.Load()
}

// repairsHere reports whether this node repairs l: l is short of copies
// (fewer live holders than its replicas, or holders that are not alive)
// and this node is its first live holder. A Cache entry is never
// repaired: losing one costs a recompute, not a job.
func (s *Store) repairsHere(l *listed, alive map[string]bool) bool {
	if l.Mode == Cache {
		return false
	}
	first, nlive := "", 0
	for i := range l.Holders {
		if node := l.Holders[i].Node; alive[node] {
			if nlive == 0 {
				first = node
			}
			nlive++
		}
	}
	return first == s.cfg.Node && (nlive < l.Replicas || nlive < len(l.Holders))
}

// repairCandidates orders the members for new copies: settled members
// first, then those that joined within RecentJoin, then suspect ones; each
// object's rendezvous order applies within each group (place keeps it).
func (s *Store) repairCandidates(members []Member, joined map[string]time.Time, now time.Time) func(id string, size int64, exclude map[string]bool) []Member {
	group := func(m Member) int {
		switch {
		case m.Suspect:
			return 2
		case now.Sub(joined[m.Node]) < s.cfg.RecentJoin:
			return 1
		}
		return 0
	}
	return func(id string, size int64, exclude map[string]bool) []Member {
		out := place(members, id, size, exclude)
		slices.SortStableFunc(out, func(a, b Member) int { return group(a) - group(b) })
		return out
	}
}

// repairTimeout bounds asking one holder for a repair copy of size bytes:
// RepairTimeout plus a second per 64 MiB, at most RequestTimeout.
func (s *Store) repairTimeout(size int64) time.Duration {
	return min(s.cfg.RequestTimeout, s.cfg.RepairTimeout+time.Duration(size>>26)*time.Second)
}

// repair brings one object back to its replica count. This node is its
// first live holder: it copies its own copy onto new holders and rewrites
// the record, if no one else changed it meanwhile, naming the new holders
// in place of holders that are not alive (those not replaced stay named).
// It reports false when a pass soon should try again: the object is still
// short of copies and some member might take one. The caller checked
// that this node repairs l (repairsHere).
func (s *Store) repair(ctx context.Context, l *listed, cands func(string, int64, map[string]bool) []Member, alive map[string]bool) (done bool) {
	var live []Holder
	for _, h := range l.Holders {
		if alive[h.Node] {
			live = append(live, h)
		}
	}
	exclude := map[string]bool{}
	for _, h := range l.Holders {
		exclude[h.Node] = true
	}
	if !s.hold.has(live[0].Ref.ID) {
		// The record names a copy of this node's that it does not hold
		// (a restart): unlistMissing fixes the record, then a pass repairs.
		return false
	}
	var added []Holder
	if need := l.Replicas - len(live); need > 0 {
		// live[0] names this node's copy; a small one goes inline, but only
		// once the holdings confirm it is a Store copy: the record could
		// name another payload of this node's, which pulls would refuse.
		src := source{ref: live[0].Ref}
		var err error
		if s.hold.has(src.ref.ID) {
			src, err = s.sourceOf(ctx, src.ref, nil)
		}
		targets := cands(l.ID, l.Size, exclude)
		if len(targets) == 0 {
			// Nobody to copy to: the periodic pass looks again once members
			// join or free room; retrying sooner would only spin.
			s.log.Debug("re-replication: no member can take a copy", zap.String("object", l.ID))
			return true
		}
		if err == nil {
			added, err = s.stageOnto(ctx, l.ID, l.Mode, src, targets, need, s.repairTimeout(l.Size))
		}
		if err != nil {
			s.log.Info("re-replication failed; a pass tries again soon", zap.String("object", l.ID), zap.Error(err))
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
		return len(live) >= l.Replicas // nothing gained and nobody to drop: leave the record be
	}
	rec := l.Record
	rec.Holders = holders
	resp, err := s.writeIf(ctx, l, &rec) // markers for the new holders, none for those replaced
	if err != nil || !resp.Succeeded {
		st := &Staged{s: s, Record: Record{ID: l.ID, Holders: added}}
		st.Abort(context.WithoutCancel(ctx))
		return false
	}
	s.repairs.Add(1)
	done = len(live)+len(added) >= l.Replicas
	s.log.Info("object re-replicated", zap.String("object", l.ID),
		zap.Int("live", len(live)), zap.Int("added", len(added)), zap.Int("want", l.Replicas))
	return done
}
