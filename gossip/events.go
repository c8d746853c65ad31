package gossip

// EventType says what changed about a peer.
type EventType uint8

// The event types.
const (
	// EventRegistered: the peer's record appeared in etcd.
	EventRegistered EventType = iota + 1
	// EventDeregistered: the peer's record left etcd (lease expired or
	// revoked, or Close). It no longer appears in Peers.
	EventDeregistered
	// EventUpdated: the peer's record or gossiped meta changed.
	EventUpdated
	// EventAlive: memberlist counts the peer as a member again (joined, or
	// came back after being declared dead).
	EventAlive
	// EventSuspect: this node's probes of the peer failed.
	EventSuspect
	// EventDead: memberlist declared the peer dead, or it left gracefully.
	EventDead
)

func (t EventType) String() string {
	switch t {
	case EventRegistered:
		return "registered"
	case EventDeregistered:
		return "deregistered"
	case EventUpdated:
		return "updated"
	case EventAlive:
		return "alive"
	case EventSuspect:
		return "suspect"
	case EventDead:
		return "dead"
	}
	return "unknown"
}

// Event is one change in the view, with the peer as it is after the change.
type Event struct {
	Type EventType
	Peer Peer
}

type subscription struct {
	ch chan Event
}

// Subscribe returns a channel of view changes, buffered to
// Config.EventBuffer, and a function that ends the subscription and closes
// the channel. Events are never allowed to block memberlist or the etcd
// watch: when the buffer is full they are dropped and counted in Dropped,
// so a consumer that must not miss state should re-read Peers after a
// burst. Close ends every subscription.
func (m *Membership) Subscribe() (<-chan Event, func()) {
	s := &subscription{ch: make(chan Event, m.cfg.EventBuffer)}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.subsDone {
		close(s.ch)
		return s.ch, func() {}
	}
	m.subs[s] = struct{}{}
	return s.ch, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if _, ok := m.subs[s]; ok {
			delete(m.subs, s)
			close(s.ch)
		}
	}
}

// Dropped counts events not delivered because a subscriber's buffer was full.
func (m *Membership) Dropped() uint64 { return m.dropped.Load() }

func (m *Membership) emitLocked(t EventType, id string) {
	if len(m.subs) == 0 {
		return
	}
	m.emitPeerLocked(t, m.peerLocked(id))
}

func (m *Membership) emitPeerLocked(t EventType, p Peer) {
	for s := range m.subs {
		select {
		case s.ch <- Event{Type: t, Peer: p}:
		default:
			m.dropped.Add(1)
		}
	}
}
