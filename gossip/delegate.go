package gossip

import (
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// delegate receives memberlist's callbacks. memberlist calls the event
// methods while holding its own node lock, so they only copy what they need
// into the view, never call back into memberlist and never block.
type delegate struct {
	m *Membership
}

var (
	_ memberlist.Delegate      = (*delegate)(nil)
	_ memberlist.EventDelegate = (*delegate)(nil)
	_ memberlist.PingDelegate  = (*delegate)(nil)
	_ memberlist.AliveDelegate = (*delegate)(nil)
)

// NodeMeta returns this node's current encoded meta.
func (d *delegate) NodeMeta(limit int) []byte {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	if len(d.m.metaBytes) > limit {
		return nil // EncodeMeta keeps us under MetaMaxSize; a smaller limit is a memberlist change
	}
	return append([]byte(nil), d.m.metaBytes...)
}

// NotifyMsg is unused: gossip carries only node meta.
func (d *delegate) NotifyMsg([]byte) {}

// GetBroadcasts is unused: gossip carries only node meta.
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }

// LocalState is unused: etcd, not push/pull, is the durable state.
func (d *delegate) LocalState(join bool) []byte { return nil }

// MergeRemoteState is unused, see LocalState.
func (d *delegate) MergeRemoteState(buf []byte, join bool) {}

// NotifyJoin: a node became a member, or came back from dead.
func (d *delegate) NotifyJoin(n *memberlist.Node) {
	d.m.memberChanged(n, EventAlive)
}

// NotifyUpdate: a member's meta changed.
func (d *delegate) NotifyUpdate(n *memberlist.Node) {
	d.m.memberChanged(n, EventUpdated)
}

// NotifyLeave: a member was declared dead or left.
func (d *delegate) NotifyLeave(n *memberlist.Node) {
	d.m.memberChanged(n, EventDead)
}

// NotifyAlive admits a node to memberlist only if it is this node or is
// registered in etcd at the gossip address it claims. A node writes its
// record before it joins, so a real peer passes; a memberlist node that is
// not in this mesh's etcd, or an alive message that moves a member to
// another address, does not. A peer whose record the watch has not
// delivered yet is refused for now and joined when the record arrives.
// Without a keyring this is the only check, and it cannot tell a forged
// alive message from the member's own (same name, same address).
func (d *delegate) NotifyAlive(n *memberlist.Node) error {
	m := d.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if n.Name == m.self.ID {
		return nil // memberlist refutes claims about us itself
	}
	r, ok := m.records[n.Name]
	if !ok {
		return errors.New("gossip: not registered in etcd")
	}
	ip, port, err := splitIPPort(r.rec.GossipAddr)
	if err != nil || !ip.Equal(n.Addr) || port != int(n.Port) {
		return fmt.Errorf("gossip: registered at %q, not at %s", r.rec.GossipAddr,
			net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port))))
	}
	return nil
}

// AckPayload is unused.
func (d *delegate) AckPayload() []byte { return nil }

// NotifyPingComplete: a direct probe of other succeeded, so it is not
// suspect any more as far as this node can tell.
func (d *delegate) NotifyPingComplete(other *memberlist.Node, rtt time.Duration, payload []byte) {
	m := d.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.members[other.Name]; ok && !s.suspectUntil.IsZero() {
		s.suspectUntil = time.Time{}
		m.gen++
	}
}

// memberChanged folds a memberlist event into the view. The state comes
// from which callback fired: memberlist never fills in Node.State (its
// internal nodeState shadows that field), so n.State always reads alive.
// A leave callback does not say whether the node left or was declared dead.
func (m *Membership) memberChanged(n *memberlist.Node, t EventType) {
	id := n.Name
	var meta NodeMeta
	var metaErr error
	if len(n.Meta) > 0 {
		meta, metaErr = DecodeMeta(n.Meta)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.members[id]
	if !ok {
		s = &member{}
		m.members[id] = s
	}
	m.gen++
	s.alive = t != EventDead
	s.suspectUntil = time.Time{}
	if metaErr != nil {
		m.log.Warn("undecodable meta from peer", zap.String("peer", id), zap.Error(metaErr))
	} else if len(n.Meta) > 0 {
		s.meta, s.metaAt = meta, time.Now()
	}
	if t == EventDead {
		delete(m.joins, id)
		// A peer that left gracefully revokes its own lease in Close, so
		// revoking it here as well is harmless.
		if m.cfg.RevokeDeadPeers && id != m.self.ID {
			if r, ok := m.records[id]; ok && r.lease != 0 {
				m.revokes[r.lease] = id
				m.kickWork()
			}
		}
	}
	m.log.Debug("member", zap.String("peer", id), zap.Stringer("event", t))
	m.emitLocked(t, id)
	if _, registered := m.records[id]; !s.alive && !registered {
		delete(m.members, id) // gone from both sources
	}
}

// suspected marks a peer whose probe failed. memberlist (v0.7.0 too) has
// no delegate for suspicion and never fills in Node.State, so logBridge
// feeds this from memberlist's log line. The mark lapses after the longest
// suspicion timeout memberlist could use, and clears sooner on any sign of
// the peer or a death verdict.
func (m *Membership) suspected(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.members[id]
	if !ok || !s.alive {
		return
	}
	ml := m.cfg.Memberlist
	n := math.Max(1, math.Log10(math.Max(1, float64(len(m.members)))))
	longest := time.Duration(float64(ml.SuspicionMult*ml.SuspicionMaxTimeoutMult) * n * float64(ml.ProbeInterval))
	s.suspectUntil = time.Now().Add(longest)
	m.gen++
	m.emitLocked(EventSuspect, id)
}
