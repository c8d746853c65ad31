package cache

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Collection.
//
// One member at a time, the first by rendezvous on collectorKey, deletes
// the records nobody will use: objects every holder of which has been gone
// for LostGrace (lost), records past their retention plus ExpiryGrace
// (etcd extends leases on a leader change), and objects the agent says
// are orphans. No Store follows every record (each follows those that
// name it, marker.go), so the collector reads them from etcd: a page of
// OrphanBatch records a pass, in id order from where the last page ended,
// wrapping round. Each of N records is judged within ceil(N/OrphanBatch)
// passes, and a pass costs one read however many objects the mesh keeps.

// collector is the collector's state across passes.
type collector struct {
	mu sync.Mutex
	// mu guards the fields below.
	after     string               // the id the last page ended at; "": start a round
	goneSince map[string]time.Time // since when each holder seen gone has been
	goneNamed map[string]bool      // the gone holders a page of this round named
}

// collect judges the next page of records and deletes those that are
// lost, expired or orphaned, each with its holders' markers and only if
// it is still the record read.
func (s *Store) collect(ctx context.Context, alive map[string]bool) {
	page, wrapped, err := s.collectPage(ctx)
	if err != nil {
		s.log.Debug("collector: read records", zap.Error(err))
		return
	}
	now := s.cfg.Now()
	why := map[string]string{}
	// A holder gossip calls dead may be alive and this node's view stale
	// (it was just cut off, or has just healed): an object is lost only when
	// etcd, read now, has no registration for any of its holders. While
	// gossip calls every holder in sight alive, etcd is not asked.
	var registered map[string]bool
	known := true
	if s.cfg.Registered != nil && s.coll.anyDead(page, alive) {
		registered, err = s.cfg.Registered(ctx)
		if err != nil {
			s.log.Debug("collector: registered nodes", zap.Error(err))
			registered, known = nil, false
		}
	}
	gone := s.coll.goneFor(page, wrapped, alive, registered, known, now)
	var ask []Record
	for _, l := range page {
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
		default:
			ask = append(ask, l.Record)
		}
	}
	if s.orphans != nil && len(ask) > 0 {
		ids, err := s.orphans(ctx, ask)
		if err != nil {
			s.log.Debug("collector: orphans", zap.Error(err))
		}
		for _, id := range ids {
			why[id] = "orphaned"
		}
	}
	for _, l := range page {
		reason := why[l.ID]
		if reason == "" {
			continue
		}
		if resp, err := s.writeIf(ctx, l, nil); err != nil || !resp.Succeeded {
			continue
		}
		if reason == "lost" {
			s.lost.Add(1)
		}
		s.collected.Add(1)
		s.log.Info("object collected", zap.String("object", l.ID), zap.String("reason", reason), zap.String("job", l.Job))
	}
}

// collectPage reads the next OrphanBatch records, after the id the last
// page ended at; wrapped reports the last page of a round (the next starts
// from the first record).
func (s *Store) collectPage(ctx context.Context) (page []*listed, wrapped bool, err error) {
	s.coll.mu.Lock()
	after := s.coll.after
	s.coll.mu.Unlock()
	objects := ObjectsPrefix(s.cfg.Prefix)
	from := objects
	if after != "" {
		from = ObjectKey(s.cfg.Prefix, after) + "\x00" // the first key after it
	}
	resp, err := s.cli.Get(ctx, from, clientv3.WithRange(clientv3.GetPrefixRangeEnd(objects)), clientv3.WithLimit(int64(s.cfg.OrphanBatch)))
	if err != nil {
		return nil, false, fmt.Errorf("cache: collector page: %w", err)
	}
	page = s.decodeListed(resp.Kvs)
	after = ""
	if resp.More && len(resp.Kvs) > 0 {
		after = strings.TrimPrefix(string(resp.Kvs[len(resp.Kvs)-1].Key), objects)
	}
	s.coll.mu.Lock()
	s.coll.after = after
	s.coll.mu.Unlock()
	return page, after == "", nil
}

// anyDead reports whether a holder named in page, or one seen gone on an
// earlier pass, is not alive.
func (c *collector) anyDead(page []*listed, alive map[string]bool) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for node := range c.goneSince {
		if !alive[node] {
			return true
		}
	}
	for _, l := range page {
		for _, h := range l.Holders {
			if !alive[h.Node] {
				return true
			}
		}
	}
	return false
}

// goneFor returns, for each holder named in page or seen gone before that
// is neither alive nor registered, how long this collector has seen it so
// on every pass since it first did; a holder seen again starts over. A
// holder no page named during a whole round (wrapped ends one) is
// forgotten. With known false (etcd could not be read) no holder is
// counted gone, and those counted before start over.
func (c *collector) goneFor(page []*listed, wrapped bool, alive, registered map[string]bool, known bool, now time.Time) map[string]time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	isGone := func(node string) bool { return known && !alive[node] && !registered[node] }
	if c.goneSince == nil {
		c.goneSince, c.goneNamed = map[string]time.Time{}, map[string]bool{}
	}
	for node := range c.goneSince {
		if !isGone(node) {
			delete(c.goneSince, node)
		}
	}
	for _, l := range page {
		for _, h := range l.Holders {
			if !isGone(h.Node) {
				continue
			}
			if _, ok := c.goneSince[h.Node]; !ok {
				c.goneSince[h.Node] = now
			}
			c.goneNamed[h.Node] = true
		}
	}
	out := make(map[string]time.Duration, len(c.goneSince))
	for node, since := range c.goneSince {
		out[node] = now.Sub(since)
	}
	if wrapped {
		for node := range c.goneSince {
			if !c.goneNamed[node] {
				delete(c.goneSince, node) // no record names it any more
			}
		}
		clear(c.goneNamed)
	}
	return out
}
