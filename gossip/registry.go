package gossip

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// registerOnce grants a lease and writes this node's record under it. The
// record is written only if the key is absent, unleased, or held by prev (our
// own previous lease, which etcd may not have expired yet); a key held by any
// other lease is another live process with our id: ErrDuplicateID.
func (m *Membership) registerOnce(ctx context.Context, prev clientv3.LeaseID) (clientv3.LeaseID, error) {
	m.mu.Lock()
	rec := m.self.clone()
	m.mu.Unlock()
	val, err := json.Marshal(rec)
	if err != nil {
		return 0, fmt.Errorf("gossip: marshal record: %w", err)
	}
	rctx, cancel := context.WithTimeout(ctx, m.cfg.RequestTimeout)
	defer cancel()
	g, err := m.cli.Grant(rctx, m.cfg.leaseTTLSeconds())
	if err != nil {
		return 0, fmt.Errorf("gossip: grant lease: %w", err)
	}
	lease := g.ID
	m.touchLease()
	ok := false
	defer func() {
		if !ok {
			m.revoke(lease)
		}
	}()
	put := clientv3.OpPut(m.selfKey, string(val), clientv3.WithLease(lease))
	resp, err := m.cli.Txn(rctx).
		If(clientv3.Compare(clientv3.CreateRevision(m.selfKey), "=", 0)).
		Then(put).
		Else(clientv3.OpGet(m.selfKey)).
		Commit()
	if err != nil {
		return 0, fmt.Errorf("gossip: register %s: %w", m.selfKey, err)
	}
	if !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 1 {
			held := clientv3.LeaseID(kvs[0].Lease)
			if held != 0 && held != prev {
				return 0, fmt.Errorf("%w: %s held by lease %x", ErrDuplicateID, m.selfKey, int64(held))
			}
			// Overwrite our own stale registration, only if it still is.
			resp, err = m.cli.Txn(rctx).
				If(clientv3.Compare(clientv3.LeaseValue(m.selfKey), "=", held)).
				Then(put).
				Commit()
			if err != nil {
				return 0, fmt.Errorf("gossip: register %s: %w", m.selfKey, err)
			}
			if held != 0 {
				m.revoke(held)
			}
		}
		if !resp.Succeeded {
			return 0, fmt.Errorf("gossip: register %s: lost a race with another writer", m.selfKey)
		}
	}
	ok = true
	return lease, nil
}

// registerRetry calls registerOnce with backoff until it succeeds or ctx
// ends; it then returns the last error.
func (m *Membership) registerRetry(ctx context.Context, prev clientv3.LeaseID) (clientv3.LeaseID, error) {
	b := m.newBackoff()
	var last error // the last failure not caused by ctx ending
	for {
		m.beat()
		lease, err := m.registerOnce(ctx, prev)
		if err == nil {
			return lease, nil
		}
		if ctx.Err() == nil || last == nil {
			last = err
			m.log.Warn("register", zap.Error(err))
		}
		if ctx.Err() != nil || !b.wait(ctx) {
			return 0, fmt.Errorf("%w (gave up: %v)", last, context.Cause(ctx))
		}
	}
}

// leaseLoop keeps the lease alive and, when it is lost, registers again
// under a new one. Watchers learn of both changes through LeaseChanged.
func (m *Membership) leaseLoop(lease clientv3.LeaseID) {
	defer m.wg.Done()
	for {
		m.beat()
		reason := m.holdLease(lease)
		if m.ctx.Err() != nil {
			return
		}
		m.log.Warn("lease lost; registering again", zap.Int64("lease", int64(lease)), zap.String("reason", reason))
		m.setLease(0)
		next, err := m.registerRetry(m.ctx, lease)
		if err != nil {
			return // only when Close canceled m.ctx
		}
		m.log.Info("registered under new lease", zap.Int64("old", int64(lease)), zap.Int64("lease", int64(next)))
		lease = next
		m.setLease(lease)
	}
}

// holdLease renews lease until etcd says it is gone or m.ctx ends, and
// reports why. The client stops renewing a lease that got no answer for a
// TTL, but that is not etcd expiring it: etcd expires leases only while it
// has a leader, and a new leader extends every lease by its TTL. So through
// an outage of any length (quorum lost, every member down) the lease, and
// the claims on it, live on; only etcd's own "not found" ends it.
func (m *Membership) holdLease(lease clientv3.LeaseID) string {
	for {
		reason, gone := m.renew(lease)
		if gone || m.ctx.Err() != nil {
			return reason
		}
		m.log.Warn("lease keepalive ended; asking etcd whether the lease lives",
			zap.Int64("lease", int64(lease)), zap.String("reason", reason))
		if reason, gone = m.renewOnce(lease); gone || m.ctx.Err() != nil {
			return reason
		}
		m.log.Info("lease held through the etcd outage", zap.Int64("lease", int64(lease)))
	}
}

// renew keeps lease alive until the client stops renewing it (gone false:
// etcd may simply not have answered) or etcd says it is gone (gone true).
func (m *Membership) renew(lease clientv3.LeaseID) (reason string, gone bool) {
	ctx, cancel := context.WithCancel(m.ctx)
	defer cancel() // drops this lease's keepalive from the client
	ka, err := m.cli.KeepAlive(ctx, lease)
	if err != nil {
		return "keepalive: " + err.Error(), errors.Is(err, rpctypes.ErrLeaseNotFound)
	}
	for {
		m.waiting() // on etcd's renewals, however long an outage lasts
		select {
		case <-m.ctx.Done():
			return "closing", true
		case _, ok := <-ka:
			if ok {
				m.touchLease()
			}
			if !ok {
				// The client closes the channel when etcd answered that
				// the lease is not found, and when no renewal was answered
				// within the TTL; renewOnce tells which.
				return "keepalive ended", false
			}
		case <-m.selfGone:
			m.beat()
			// Someone deleted our record. If the lease still exists, put
			// the record back under it; if not, the lease is gone too.
			if err := m.reput(lease); err != nil {
				if errors.Is(err, rpctypes.ErrLeaseNotFound) {
					return "record deleted and lease not found", true
				}
				m.log.Warn("restore deleted record", zap.Error(err))
			}
		}
	}
}

// renewOnce renews lease once, retrying until etcd answers: gone reports
// that it answered "not found" (the lease expired or was revoked). Each try
// is bounded by RequestTimeout and they follow one another closely: once
// etcd has a leader again the lease lives one TTL (plus an election
// timeout), and a renewal must land within it.
func (m *Membership) renewOnce(lease clientv3.LeaseID) (reason string, gone bool) {
	b := m.newBackoff()
	b.max = min(b.max, m.cfg.LeaseTTL/4)
	for {
		m.beat()
		ctx, cancel := context.WithTimeout(m.ctx, m.cfg.RequestTimeout)
		_, err := m.cli.KeepAliveOnce(ctx, lease)
		cancel()
		switch {
		case err == nil:
			m.touchLease()
			return "", false
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			return "lease not found", true
		case m.ctx.Err() != nil:
			return "closing", true
		}
		m.log.Debug("lease renewal", zap.Int64("lease", int64(lease)), zap.Error(err))
		if !b.wait(m.ctx) {
			return "closing", true
		}
	}
}

// reput writes this node's record again under lease.
func (m *Membership) reput(lease clientv3.LeaseID) error {
	m.mu.Lock()
	rec := m.self.clone()
	m.mu.Unlock()
	val, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("gossip: marshal record: %w", err)
	}
	ctx, cancel := context.WithTimeout(m.ctx, m.cfg.RequestTimeout)
	defer cancel()
	if _, err := m.cli.Put(ctx, m.selfKey, string(val), clientv3.WithLease(lease)); err != nil {
		return fmt.Errorf("gossip: restore %s: %w", m.selfKey, err)
	}
	m.log.Info("restored deleted record", zap.Int64("lease", int64(lease)))
	return nil
}

// revoke revokes lease, bounded by RequestTimeout. It runs during Close and
// on failure paths, so it does not use m.ctx.
func (m *Membership) revoke(lease clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.RequestTimeout)
	defer cancel()
	if _, err := m.cli.Revoke(ctx, lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		m.log.Warn("revoke lease", zap.Int64("lease", int64(lease)), zap.Error(err))
	}
}

// watchLoop keeps the records view current from rev on. When the watch
// breaks (compaction, lost leader, etcd restart) it backs off, re-reads the
// whole prefix and watches again from there.
func (m *Membership) watchLoop(rev int64) {
	defer m.wg.Done()
	b := m.newBackoff()
	for {
		rev = m.watchFrom(rev)
		if m.ctx.Err() != nil {
			return
		}
		for {
			if !b.wait(m.ctx) {
				return
			}
			next, err := m.resync(m.ctx)
			if err == nil {
				rev = next
				b.reset()
				break
			}
			m.log.Warn("resync node records", zap.Error(err))
		}
	}
}

// watchFrom applies watch events from rev until the watch ends, and
// returns the revision to continue from.
func (m *Membership) watchFrom(rev int64) int64 {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(m.ctx))
	defer cancel()
	wch := m.cli.Watch(ctx, m.nodesPrefix, clientv3.WithPrefix(), clientv3.WithRev(rev))
	for resp := range wch {
		if err := resp.Err(); err != nil {
			m.log.Warn("watch node records", zap.Error(err))
			return rev
		}
		for _, ev := range resp.Events {
			switch ev.Type {
			case mvccpb.PUT:
				m.applyPut(ev.Kv)
			case mvccpb.DELETE:
				m.applyDelete(string(ev.Kv.Key))
			}
		}
		rev = resp.Header.Revision + 1
	}
	return rev
}

// resync replaces the records view with a fresh read of the prefix and
// returns the revision to watch from.
func (m *Membership) resync(ctx context.Context) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, m.cfg.RequestTimeout)
	defer cancel()
	resp, err := m.cli.Get(rctx, m.nodesPrefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("gossip: list %s: %w", m.nodesPrefix, err)
	}
	seen := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if id, ok := m.applyPut(kv); ok {
			seen[id] = true
		}
	}
	m.mu.Lock()
	var gone []string
	for id := range m.records {
		if !seen[id] {
			gone = append(gone, id)
		}
	}
	m.mu.Unlock()
	for _, id := range gone {
		m.applyDelete(m.nodesPrefix + id)
	}
	return resp.Header.Revision + 1, nil
}

// applyPut records a node registration read from etcd.
func (m *Membership) applyPut(kv *mvccpb.KeyValue) (string, bool) {
	id := strings.TrimPrefix(string(kv.Key), m.nodesPrefix)
	var rec NodeRecord
	if err := json.Unmarshal(kv.Value, &rec); err != nil || rec.ID != id || validateID(id) != nil {
		m.log.Warn("ignoring malformed node record", zap.ByteString("key", kv.Key), zap.Error(err))
		return "", false
	}
	lease := clientv3.LeaseID(kv.Lease)
	m.mu.Lock()
	defer m.mu.Unlock()
	old, existed := m.records[id]
	m.records[id] = registration{rec: rec, lease: lease}
	m.gen++
	if id != m.self.ID && rec.GossipAddr != "" {
		if s, ok := m.members[id]; !ok || !s.alive {
			m.joins[id] = rec.GossipAddr
			m.kickWork()
		}
	}
	switch {
	case !existed:
		m.emitLocked(EventRegistered, id)
	case old.lease != lease || !recordsEqual(old.rec, rec):
		m.emitLocked(EventUpdated, id)
	}
	return id, true
}

// applyDelete drops a node registration that left etcd.
func (m *Membership) applyDelete(key string) {
	id := strings.TrimPrefix(key, m.nodesPrefix)
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.records[id]; !ok {
		return
	}
	p := m.peerLocked(id)
	delete(m.records, id)
	m.gen++
	delete(m.joins, id)
	if s, ok := m.members[id]; ok && !s.alive {
		delete(m.members, id) // gone from both sources
	}
	p.Registered = false
	m.emitPeerLocked(EventDeregistered, p)
	if id == m.self.ID && m.lease != 0 {
		select {
		case m.selfGone <- struct{}{}:
		default:
		}
	}
}

func recordsEqual(a, b NodeRecord) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// backoff is a bounded exponential backoff with jitter.
type backoff struct {
	cur, min, max time.Duration
}

func (m *Membership) newBackoff() *backoff {
	return &backoff{cur: m.cfg.RetryMin, min: m.cfg.RetryMin, max: m.cfg.RetryMax}
}

func (b *backoff) reset() { b.cur = b.min }

// wait sleeps for the next interval; false if ctx ended first.
func (b *backoff) wait(ctx context.Context) bool {
	d := b.cur/2 + rand.N(b.cur/2+1)
	b.cur = min(2*b.cur, b.max)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
