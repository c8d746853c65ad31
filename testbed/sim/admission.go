package sim

// Admission, per worker as the agent admits (agent.admit): a worker of a
// stage with one after it starts a task only while its own count (its task
// running, its commits on their way, and the next stage's tasks they
// created that are not done) is under its share of the next stage's budget
// (routing.Admission.Quota). Held back, it waits off the waiting list
// (heldBack), grants nothing and gossip leaves the stage out of its roles
// (agent.takingWork, takesWork), a GossipDelay late; the claims pushed to
// it meanwhile go back at their steal grace (routing.QueuePolicy.Returns:
// no busy slot to wait for). The central dispatcher admits nothing: it
// holds every task in its own queue.

// setQuotas gives each worker of st its share of the next stage's budget,
// whose workers have one credit each (Admission.Share; the membership does
// not change during a run).
func (s *sim) setQuotas(st *stage, downstream int) {
	for _, wk := range st.workers {
		wk.quota = int32(s.cfg.Admission.Share(downstream, st.names, st.names[wk.idx]))
	}
}

// admitted reports whether admission lets worker wk of st start a task
// (routing.Admission.Admit on its own count).
func (s *sim) admitted(st *stage, wk *worker) bool {
	return !s.admits(st) || s.cfg.Admission.Admit(s.mine(wk), int(wk.quota))
}

// admits reports whether admission bounds st: a stage with one after it,
// on the mesh (the central dispatcher holds every task in its queue).
func (s *sim) admits(st *stage) bool { return st.i < 2 && !s.central() }

// mine is what worker wk counts against its quota: its task running, its
// commits on their way and the tasks of the next stage they created that
// are not done.
func (s *sim) mine(wk *worker) int {
	n := int(wk.committing + wk.fed)
	if wk.busy {
		n++
	}
	return n
}

// holdBack puts idle worker w, which admission holds back, on st's
// heldBack list.
func (s *sim) holdBack(st *stage, w int32) {
	wk := st.workers[w]
	wk.held, wk.heldFrom = true, s.clk.now
	wk.heldPos = int32(len(st.heldBack))
	st.heldBack = append(st.heldBack, w)
}

// unhold is held-back worker w let go by admission: it waits to start a
// task, and, with nothing pushed to it, grants its slot (agent.grantIdle,
// from its worker's loop).
func (s *sim) unhold(st *stage, w int32) {
	wk := st.workers[w]
	p := wk.heldPos
	last := st.heldBack[len(st.heldBack)-1]
	st.heldBack[p] = last
	st.workers[last].heldPos = p
	st.heldBack = st.heldBack[:len(st.heldBack)-1]
	wk.held, wk.heldPos, wk.heldTo = false, -1, s.clk.now
	s.addWaiting(st, w)
	s.grantSlot(st, w, -1)
}

// fedDone is mesh task t of st done (its key deleted by its commit): its
// producer's ledger sees it go (jobs.Fed: one watch event), and the
// producer, if admission held it back, looks again then.
func (s *sim) fedDone(st *stage, t *task) {
	if st.i == 0 || t.producer < 0 {
		return // a submit's task: no producer counts it
	}
	up := s.st[st.i-1]
	pw := up.workers[t.producer]
	pw.fed--
	if pw.held && s.admitted(up, pw) {
		s.unhold(up, t.producer)
		s.requestWake(up, s.clk.now+s.etcd.watchLat(s.clk.now))
	}
}

// heldInGossip reports whether gossip shows worker w's stage held back
// (its meta leaves the stage out of its roles), as it was a GossipDelay
// ago.
func (s *sim) heldInGossip(w *worker) bool {
	t := s.clk.now - s.cfg.GossipDelay
	if w.held {
		return w.heldFrom <= t
	}
	return w.heldTo > t && w.heldFrom <= t
}
