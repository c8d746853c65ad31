package sim

// Stealing (Config.Steal, `sim --steal`): a proposal the agent does not
// make yet, measured here against the mesh's queueing tail. Producers push
// on gossip half a second old, so they herd onto short-stage workers that
// looked free, which then hold a second of pushed work each while other
// workers of the stage idle (docs/benchmarks.md, "The mesh's queueing
// tail, analysed"). With stealing, a worker left idle with nothing pushed
// to it and the queue empty asks the busiest of a few sampled peers (by
// the claims gossip shows pushed to them) for one; the peer hands over the
// claim it would start last (routing.QueuePolicy.Spare) by a fenced
// hand-over (jobs.Store.HandOver: one write, the thief's inbox and the
// task's dispatcher's ledger see it), as the agent hands claims over when
// it drains.

// stealSample is how many peers an idle worker samples for the busiest.
const stealSample = 4

// stealFor sends idle worker thief's request for a claim to the busiest of
// a few sampled peers of st that gossip shows holding pushed claims.
func (s *sim) stealFor(st *stage, thief *worker) {
	var victim *worker
	most := 0
	for range stealSample {
		w := st.workers[s.rng.IntN(len(st.workers))]
		if w == thief || !w.busy {
			continue
		}
		if n := s.pushesInGossip(w); n > most {
			victim, most = w, n
		}
	}
	if victim == nil {
		return
	}
	thief.stealing = true
	s.clk.at(s.clk.now+s.cfg.NetDelay, event{kind: evStealAsked, stage: int8(st.i), worker: victim.idx, thief: thief.idx})
}

// stealAsked is victim v answering thief's request: it hands over the
// claim it would start last, if thief is still idle with nothing of its
// own.
func (s *sim) stealAsked(st *stage, v, thief *worker) {
	now := s.clk.now
	if thief.waitPos < 0 || len(thief.pushed) > 0 {
		thief.stealing = false
		return
	}
	s.inbox = s.inboxOf(st, v, s.inbox[:0])
	k := s.cfg.Queue.Spare(s.inbox, st.names[v.idx], s.epoch.Add(now), v.busy)
	if k < 0 {
		thief.stealing = false
		return
	}
	t := v.pushed[k]
	s.unpush(st, v, t)
	s.steals++
	s.etcd.write(now, 1) // jobs.Store.HandOver, fenced by v's claim
	s.clk.at(now+s.etcd.writeLat(now), event{kind: evStolen, stage: int8(st.i), worker: v.idx, thief: thief.idx, task: t})
}

// stolen is the hand-over of t from worker from to thief landing: the claim
// is thief's, which starts it at its next look.
func (s *sim) stolen(st *stage, from, thief *worker, t *task) {
	thief.stealing = false
	s.hold(st, from, -1)
	t.pushTo, t.pushedAt = thief.idx, s.clk.now
	s.handOverLanded(st, t)
}
