package gossip

// Heartbeat is told how the etcd session goroutine (the lease keepalive,
// and the re-registration after a lost lease) is doing, for a watchdog:
// Beat as it makes progress, Wait as it blocks on a channel or timer that
// may take long. Config.SessionHeartbeat; the agent's liveness implements it.
type Heartbeat interface {
	Beat()
	Wait()
}

func (m *Membership) beat() {
	if h := m.cfg.SessionHeartbeat; h != nil {
		h.Beat()
	}
}

func (m *Membership) waiting() {
	if h := m.cfg.SessionHeartbeat; h != nil {
		h.Wait()
	}
}
