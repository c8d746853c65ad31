package gossip

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Bounds on NodeRecord.Models, so one node's record stays a few KiB.
const (
	MaxRecordModels    = 2 * MaxMetaModels
	MaxRecordModelSize = 1024 // bytes of one model's JSON
)

// SetModels replaces NodeRecord.Models in this node's record and writes the
// record again under the current lease, so that every agent's view of
// nodes/ has it within a watch event; it writes nothing when the record in
// etcd, as this node's watch saw it, has them already. A registration made
// later (a lost lease, a replaced etcd) writes them too, but one under way
// may have read the record before: call SetModels again after a
// LeaseChanged. It is for an engine registering, not for anything per job.
func (m *Membership) SetModels(ctx context.Context, models map[string]json.RawMessage) error {
	if len(models) > MaxRecordModels {
		return fmt.Errorf("gossip: %d models in a node record, at most %d", len(models), MaxRecordModels)
	}
	for name, v := range models {
		if len(v) > MaxRecordModelSize || !json.Valid(v) {
			return fmt.Errorf("gossip: model %q: %d bytes of record, want valid JSON of at most %d", name, len(v), MaxRecordModelSize)
		}
	}
	m.mu.Lock()
	m.self.Models = maps.Clone(models)
	rec, lease := m.self.clone(), m.lease
	reg, seen := m.records[m.self.ID]
	m.mu.Unlock()
	if lease == 0 {
		return nil // registering: the registration writes the record as it is now
	}
	if seen && reg.lease == lease && maps.EqualFunc(reg.rec.Models, models, func(a, b json.RawMessage) bool { return string(a) == string(b) }) {
		return nil // etcd has it (as this node's watch of nodes/ saw it)
	}
	val, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("gossip: marshal record: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.RequestTimeout)
	defer cancel()
	// Only while the key is still on our lease: a lease lost meanwhile is
	// re-registered by the lease loop, with these models.
	resp, err := m.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.LeaseValue(m.selfKey), "=", lease)).
		Then(clientv3.OpPut(m.selfKey, string(val), clientv3.WithLease(lease))).
		Commit()
	if err != nil {
		return fmt.Errorf("gossip: update %s: %w", m.selfKey, err)
	}
	if !resp.Succeeded {
		m.log.Debug("record moved to another lease before its models were written; the registration writes them")
	}
	return nil
}
