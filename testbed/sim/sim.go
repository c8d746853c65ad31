package sim

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
)

// Per-agent background etcd traffic that does not depend on jobs. The
// queue views, the Store's record index and the membership follow watches
// and read nothing idle (TestIdleAgentEtcdLoad); what each agent still
// sends is its lease keepalives (gossip.Membership renews its lease each
// third of its TTL), which etcd's leader answers from its lessor, no raft
// proposal and no read: they are charged as keepalives, against
// EtcdCosts.KeepAliveCap. Every GPU agent registers under a lease in the
// central baseline too, so both designs pay them. (The NOSPACE alarm is
// read only after a refused write, so an agent polls it no more.) The
// collector's read of nodes/ each 10 s is one agent's, not modelled.
const keepAliveEvery = 10 * time.Second / 3 // gossip: lease TTL 10 s, renewed about every third

type worker struct {
	idx       int32
	busy      bool          // its credit is in use: it runs a task
	waitPos   int32         // index in its stage's waiting list, -1 when not waiting
	idleSince time.Duration // last change to idle
	busySince time.Duration // last change to busy
	freeAt    time.Duration // its last compute ended
	// holds counts the claims it holds, as the queue views show them
	// (jobs.Queue.HeldBy): running, committing, and pushed to it but not
	// started.
	holds int32
	// pushed are the claims pushed to it that it has not started, oldest
	// first; readyPos is its index in its stage's ready list (waiting, with
	// a pushed claim), -1 when not there.
	pushed   []*task
	readyPos int32
	// grantTo is the producer (the previous stage's worker) whose ledger
	// holds a credit of its free slot until grantUntil (a grant, or a
	// credit returned, grants.go): only that producer pushes to it against
	// it. -1: none.
	grantTo    int32
	grantUntil time.Duration
	// book is its slot book, the agent's (routing.SlotBook): to whom its
	// free slot is promised, and when its busy slot should free, learnt
	// from its tasks. slotDone frees the slot it took; nil while it runs
	// nothing.
	book     *routing.SlotBook
	slotDone func(end time.Time, learn bool)
	// Admission (mesh, a stage with one after it; agent.admit): quota is
	// its share of the next stage's budget (routing.Admission.Quota, over
	// its stage's workers), against which it counts its task running, its
	// tasks committing, and fed, the next stage's tasks its commits
	// created that are not done (its ledger, jobs.Fed). held: idle, and
	// admission holds it back (its stage's heldBack list) until a task it
	// fed is done; heldFrom and heldTo bound its last hold, which gossip
	// shows a GossipDelay late.
	quota, committing, fed int32
	held                   bool
	heldPos                int32 // index in its stage's heldBack list, -1 when not there
	heldFrom, heldTo       time.Duration
	// running is the task it computes (nil: none); stopping, that it has
	// been told to give way and stops at its step's end.
	running  *task
	stopping bool
	stealing bool // Config.Steal: its request for a claim is on its way
	unowned  bool // in its stage's unowned list
	declines bool // a dispatcher declined a grant of its (its book says which, and when)
	// lookAt is when it looks next over the claims pushed to it
	// (giveBackCheck), -1 for no look due.
	lookAt time.Duration
}

type stage struct {
	i       int
	compute time.Duration
	inBytes int64 // the input pulled from the previous stage
	workers []*worker
	names   []string
	waiting []int32 // mesh: idle workers asleep on a watch that may start a task; central: free GPUs
	// heldBack: mesh, idle workers admission holds back (worker.held).
	heldBack []int32
	ready    []int32 // mesh: waiting workers that hold a pushed claim
	// unowned: mesh, waiting workers that found nobody to grant their
	// slot to (grantSlot), some of which may since have one.
	unowned []int32
	// settleAt: mesh, when the next waiting worker gossip shows free
	// settles (settledWorkers), 0 when not known.
	settleAt time.Duration
	// ledgers are the dispatchers' (ledger.go), queued the tasks waiting
	// in them; waitingD lists the ledgers with tasks waiting (and some
	// that no longer have, dropped by handOn).
	ledgers  []*ledger
	queued   int
	waitingD []int32
	// credited: ledgers a grant reached while they had work waiting
	// (handOn hands on against it); visible, visibleIdx: the dispatchers
	// gossip shows waiting, and their ledgers (waitingSeen, waitingGone).
	credited   []int32
	visible    []string
	visibleIdx []int32
	wakeAt     time.Duration // mesh: the pending wake, -1 when none
	free       int           // workers with their credit free
	// Mesh: workers holding no claim (the views' free slots), pushed claims
	// not started, and tasks done whose commit is on its way (admission
	// counts them as running, agent.committing).
	viewFree, pushWaiting, committing int
	// granted lists, by dispatcher (its ledger's index), the workers
	// whose credit its table holds, newest last; an entry whose worker has
	// since started work or granted its slot elsewhere is dropped when
	// found (takeGrant, handOn).
	granted [][]int32
}

type sim struct {
	cfg                Config
	model              costmodel.Model
	plan               costmodel.Plan
	rng                *rand.Rand // the agents' random choices
	jobRng             *rand.Rand // arrivals and classes: the same jobs in every mode
	clk                clock
	etcd               *etcdModel
	st                 [3]*stage
	epoch              time.Time
	rate               float64
	cands              []routing.Candidate
	inbox              []routing.Pushed
	due                []routing.Candidate // preemptCheck's
	back               []*task
	tasks              []*task
	ready              []int32
	grantedW, settledW []int32  // handOn's: waiting workers a dispatcher may hand a task to
	dispW              []int32  // handOn's: the dispatchers it looks at
	waitNames          []string // visibleWaiting's
	nextID             int
	seen               map[int]int // job id -> completions (CheckJobs)

	submitted, completed, completedInWindow int
	conflicts, claimTxns, giveBacks         uint64
	preemptions, steals                     uint64
	handOns, handOnStarts                   uint64    // of due interactive work to a worker that gives way, and its starts from them
	stoppedClaimed                          uint64    // preempted runs whose commit would have read the job record
	overQuota                               uint64    // tasks started past their worker's admission share
	giveBacksBy                             [3]uint64 // by stage
	heldGiveBacks                           uint64    // by a worker admission held back
	pushes                                  uint64    // tasks created with a pushed claim
	assigns, assignsBack                    uint64    // waiting tasks handed on against queue credit, and of them given back
	grantMsgs                               uint64    // credit grants sent (libp2p messages)
	pushedStarts, claimedStarts             [3]uint64 // by stage: tasks started from a pushed claim, and from a claim txn
	overhead                                time.Duration
	overheads                               histogram // per job
	queueing                                histogram
	queueingBy                              [3]histogram  // by class
	busy                                    time.Duration // compute inside [0, Duration]

	snap          etcdModel // the counters when arrivals stop
	snapped       bool
	dispBusyUntil time.Duration
	dispBusy      time.Duration
	snapDispBusy  time.Duration // dispBusy within [0, Duration]
	dispPending   bool
}

// Run simulates one configuration.
func Run(cfg Config) (Result, error) {
	s, err := newSim(cfg)
	if err != nil {
		return Result{}, err
	}
	return s.run(), nil
}

func newSim(cfg Config) (*sim, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	models, err := costmodel.Load()
	if err != nil {
		return nil, err
	}
	m, err := models.Model(cfg.Model)
	if err != nil {
		return nil, err
	}
	if cfg.CondCached {
		m = costmodel.Cache{PromptHit: 1, NegativeHit: 1}.Apply(m) // no job encodes
	}
	plan, err := costmodel.PlanPools(m, cfg.GPUs, 0)
	if err != nil {
		return nil, err
	}
	if cfg.Pools != (costmodel.Pools{}) {
		plan.Pools, plan.Capacity = cfg.Pools, costmodel.Capacity(m, cfg.Pools)
	}
	s := &sim{
		cfg:    cfg,
		model:  m,
		plan:   plan,
		rng:    rand.New(rand.NewPCG(cfg.Seed, 0x6c6d)),
		jobRng: rand.New(rand.NewPCG(cfg.Seed, 0x6a6f6273)),
		etcd:   newEtcdModel(cfg.Etcd),
		epoch:  time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		rate:   cfg.Load * plan.Capacity,
	}
	if cfg.Mode != Mesh {
		s.cfg.Queue.Push = false // only the mesh mode pushes claims
	}
	if cfg.CheckJobs {
		s.seen = map[int]int{}
	}
	sizes := [3]int{plan.Pools.Encode, plan.Pools.Denoise, plan.Pools.Decode}
	inBytes := [3]int64{0, m.Cond.Bytes(), m.Latent.Bytes()}
	for i, name := range costmodel.Stages {
		st := &stage{i: i, compute: m.StageTime(name), inBytes: inBytes[i], wakeAt: -1, free: sizes[i], viewFree: sizes[i]}
		for w := range sizes[i] {
			st.workers = append(st.workers, &worker{idx: int32(w), waitPos: -1, readyPos: -1, heldPos: -1, lookAt: -1, grantTo: -1, book: routing.NewSlotBook()})
			st.names = append(st.names, fmt.Sprintf("%s-%d", name, w))
		}
		if i < 2 && cfg.Mode != Central {
			s.setQuotas(st, sizes[i+1])
		}
		for w := range st.workers {
			s.addWaiting(st, int32(w))
		}
		s.st[i] = st
		var producers []string
		if i > 0 {
			producers = s.st[i-1].names
		}
		st.ledgers = newLedgers(producers, s.central())
		st.granted = make([][]int32, len(st.ledgers))
	}
	if !s.central() {
		for _, st := range s.st {
			for w := range st.workers {
				s.grantSlot(st, int32(w), -1) // a free slot's first owner
			}
		}
	}
	for k := time.Duration(0); k < cfg.Duration; k += time.Second {
		s.clk.at(k, event{kind: evTick})
	}
	first := s.interarrival()
	if len(cfg.Arrivals) > 0 {
		first = cfg.Arrivals[0].At
	}
	s.clk.at(first, event{kind: evArrive})
	return s, nil
}

func (s *sim) run() Result {
	start := time.Now()
	cfg := s.cfg
	// Jobs drain for as long again as they arrived, and at least ten jobs'
	// GPU time (a short replayed trace).
	drainEnd := cfg.Duration + max(cfg.Duration, 10*s.model.Total())
	for {
		e, ok := s.clk.next()
		if !ok || e.at > drainEnd {
			break
		}
		if !s.snapped && e.at > cfg.Duration {
			s.snapshot()
		}
		s.handle(e)
	}
	if !s.snapped {
		s.snapshot()
	}
	return s.result(time.Since(start))
}

func (s *sim) snapshot() {
	s.snapped = true
	s.snap = *s.etcd
	s.snap.roll(s.cfg.Duration)
	// The dispatcher has been busy without a break since before Duration
	// up to dispBusyUntil, when that is later.
	s.snapDispBusy = s.dispBusy - max(0, s.dispBusyUntil-s.cfg.Duration)
}

func (s *sim) interarrival() time.Duration {
	return time.Duration(s.jobRng.ExpFloat64() / s.rate * float64(time.Second))
}

func (s *sim) class() routing.Class {
	mix := s.cfg.ClassMix
	x := s.jobRng.Float64() * (mix[0] + mix[1] + mix[2])
	for c, f := range mix {
		if x < f {
			return routing.Class(c)
		}
		x -= f
	}
	return routing.Batch
}

func (s *sim) central() bool { return s.cfg.Mode == Central }

// hints reports whether producers hint the next stage's worker.
func (s *sim) hints() bool { return s.cfg.Mode == Mesh || s.cfg.Mode == MeshNoPush }

// newTask is stage's task of j, runnable from avail.
func newTask(j *job, stage int, avail time.Duration) *task {
	return &task{job: j, stage: stage, avail: avail, hint: -1, pushTo: -1, nextHint: -1, nextPush: -1, producer: -1}
}

func (s *sim) handle(e event) {
	now := s.clk.now
	switch e.kind {
	case evTick:
		// Every agent's lease renewals (each keepAliveEvery), in both
		// designs. A mesh agent's views cost nothing idle.
		s.etcd.keepAlive(now, int(float64(s.cfg.GPUs)/keepAliveEvery.Seconds()+0.5))
	case evArrive:
		s.arrive()
	case evEnqueue:
		s.enqueue(e.task)
	case evWake:
		if e.at == s.st[e.stage].wakeAt {
			s.wake(s.st[e.stage])
		}
	case evClaimed:
		s.start(s.st[e.stage], e.worker, e.task)
	case evDone:
		if e.run == e.task.run { // else the run was stopped (preempted)
			s.done(s.st[e.stage], e.worker, e.task)
		}
	case evCommitted:
		s.committed(s.st[e.stage], e.worker, e.task)
	case evDispatch:
		s.dispatch()
	case evGiveBack:
		if st, wk := s.st[e.stage], s.st[e.stage].workers[e.worker]; wk.lookAt == now {
			wk.lookAt = -1
			s.giveBackCheck(st, wk)
		}
	case evOffered:
		s.offerLanded(e.task)
	case evStealAsked:
		st := s.st[e.stage]
		s.stealAsked(st, st.workers[e.worker], st.workers[e.thief])
	case evStolen:
		st := s.st[e.stage]
		s.stolen(st, st.workers[e.worker], st.workers[e.thief], e.task)
	case evPreemptDue:
		s.preemptDue(e.task)
	case evHandedOn:
		s.handedOn(e.task)
	case evStopped:
		if e.run == e.task.run {
			s.stopped(s.st[e.stage], e.worker, e.task)
		}
	case evRequeued:
		s.requeued(e.task)
	case evGrantEnds:
		s.grantEnds(s.st[e.stage], e.worker)
	case evWaitingSeen:
		s.waitingSeen(s.st[e.stage], e.disp)
	case evWaitingGone:
		s.waitingGone(s.st[e.stage], e.disp)
	case evAssigned:
		s.assigned(e.task)
	case evDeclined:
		s.declined(s.st[e.stage], e.worker, e.disp)
	}
}

func (s *sim) arrive() {
	now := s.clk.now
	if now >= s.cfg.Duration {
		return
	}
	var class routing.Class
	if arr := s.cfg.Arrivals; len(arr) > 0 {
		class = arr[s.nextID].Class
		if k := s.nextID + 1; k < len(arr) {
			s.clk.at(arr[k].At, event{kind: evArrive})
		}
	} else {
		s.clk.at(now+s.interarrival(), event{kind: evArrive})
		class = s.class()
	}
	j := &job{id: s.nextID, class: class, arrive: now}
	s.nextID++
	s.submitted++
	first := 0
	if s.cfg.CondCached {
		first = 1 // no encode task: denoise reads the cached entry
	}
	t := newTask(j, first, now)
	if s.central() {
		// The dispatcher records the job durably (one write, as the mesh's
		// submit) and queues it once the write lands; the client
		// long-polls the job record as it does on the mesh (a watch, then
		// a read).
		s.etcd.write(now, 1)
		s.etcd.watch(now, 1)
		s.etcd.read(now, 1)
		s.clk.at(now+s.cfg.NetDelay+s.etcd.writeLat(now), event{kind: evEnqueue, task: t})
		return
	}
	// Submit: job record and encode task in one txn, with the task's claim
	// for an encoder gossip shows free when the policy pushes (the agent
	// hints the encode task only to push it). The agent taking the submit
	// is most likely a denoise agent, which has no view of the encode
	// queue to look a peer up in (agent.freeSlots): gossip alone. The
	// client long-polls the job (httpapi wait, Store.Wait: a watch, then a
	// read).
	if s.cfg.Queue.Push {
		if h := s.pickHint(s.st[first]); h >= 0 {
			t.hint, t.pushTo, t.pushedAt = h, h, now
		}
	}
	s.etcd.write(now, 1)
	s.etcd.watch(now, 1)
	s.etcd.read(now, 1)
	lands := now + s.etcd.writeLat(now)
	if t.pushTo >= 0 && s.offers() {
		s.offer(t, now, lands)
	}
	s.clk.at(lands, event{kind: evEnqueue, task: t})
}

// offers reports whether pushed claims are offered to their workers
// ahead of their writes (agent/jobs offer.go): the mesh, pushing, with
// Queue.Offer.
func (s *sim) offers() bool { return s.cfg.Mode == Mesh && s.cfg.Queue.Push && s.cfg.Queue.Offer }

// offer sends pushed task t's claim to its worker as the write that
// creates it goes at sent, landing at lands: the worker has it one message
// later (offerLanded), and the write's event confirms it one watch
// delivery after it lands.
func (s *sim) offer(t *task, sent, lands time.Duration) {
	t.offered = true
	t.confirmAt = lands + s.etcd.watchLat(sent)
	s.clk.at(sent+s.cfg.NetDelay, event{kind: evOffered, task: t})
}

// offerLanded is an offered claim reaching its worker (jobs.Inbox.Offered):
// the task is its worker's, as a pushed claim whose write landed is, and
// its worker wakes to it with no etcd event.
func (s *sim) offerLanded(t *task) {
	if t.claimed {
		return // its write landed first (enqueue took it as any push)
	}
	st := s.st[t.stage]
	t.enq = s.clk.now
	s.pushLanded(st, t)
	if st.workers[t.pushTo].waitPos >= 0 {
		s.requestWake(st, s.clk.now)
	}
}

// enqueue is a task's creating transaction landing: the task is in its
// stage's queue, or, pushed, claimed for its worker.
func (s *sim) enqueue(t *task) {
	now := s.clk.now
	st := s.st[t.stage]
	if s.central() {
		t.enq = now
		s.enqueueTask(st, t)
		s.watchDue(t)
		s.requestDispatch()
		return
	}
	switch {
	case t.offered && t.claimed:
		// Its worker has it since its offer landed.
	case t.pushTo >= 0:
		t.enq = now
		s.pushLanded(st, t)
	default:
		t.enq = now
		s.enqueueTask(st, t)
		s.watchDue(t)
	}
	// The task key reaches its dispatcher's ledger (jobs.Fed watches the
	// prefix of the tasks its node creates, made once at start: no watch
	// per task), and a pushed claim's key its worker's inbox.
	if t.pushTo >= 0 {
		s.stageEvent(st, 2)
	} else {
		s.stageEvent(st, 1)
	}
}

// pushLanded is a claim pushed with its task (jobs.Push) reaching etcd:
// the task is its worker's, which finds it in its view (jobs.Queue.Pushed)
// and starts it at its next look if it has a slot and nothing comes first
// in its order; nobody else may take it. Its worker looks at the steal
// grace whether to give it back (agent.returnPushes).
func (s *sim) pushLanded(st *stage, t *task) {
	s.pushes++
	s.claimLanded(st, t)
}

// claimLanded is a claim for t's pushTo in etcd (a push, or a hand-over):
// its worker finds it in its view and starts it at its next look, or looks
// at the steal grace whether to give it back.
func (s *sim) claimLanded(st *stage, t *task) {
	wk := st.workers[t.pushTo]
	t.claimed, t.pushed = true, true
	s.hold(st, wk, 1)
	wk.pushed = append(wk.pushed, t)
	s.updateReady(st, wk)
	st.pushWaiting++
	s.lookAt(st, wk, t.pushedAt+s.cfg.Queue.StealGrace)
}

// handOverLanded is a claim for t's pushTo written by someone other than
// t's creator (a dispatcher's hand-on, a peer's hand-over) landing: the
// claim key reaches the worker's inbox and the task key's rewrite its
// dispatcher's ledger, and a worker free meanwhile starts it.
func (s *sim) handOverLanded(st *stage, t *task) {
	s.claimLanded(st, t)
	s.stageEvent(st, 2)
	if st.workers[t.pushTo].waitPos >= 0 {
		s.requestWake(st, s.clk.now)
	}
}

// hold counts a claim that w takes (d = 1) or lets go (-1) in the views.
func (s *sim) hold(st *stage, w *worker, d int32) {
	was := w.holds == 0
	w.holds += d
	if is := w.holds == 0; is != was {
		if is {
			st.viewFree++
		} else {
			st.viewFree--
		}
	}
}

// updateReady keeps w in its stage's ready list while it waits with a
// pushed claim.
func (s *sim) updateReady(st *stage, w *worker) {
	want := w.waitPos >= 0 && len(w.pushed) > 0
	switch {
	case want && w.readyPos < 0:
		w.readyPos = int32(len(st.ready))
		st.ready = append(st.ready, w.idx)
	case !want && w.readyPos >= 0:
		p := w.readyPos
		last := st.ready[len(st.ready)-1]
		st.ready[p] = last
		st.workers[last].readyPos = p
		st.ready = st.ready[:len(st.ready)-1]
		w.readyPos = -1
	}
}

// unpush removes pushed claim t from its worker's list: started or given
// back.
func (s *sim) unpush(st *stage, w *worker, t *task) {
	for i, u := range w.pushed {
		if u == t {
			w.pushed = append(w.pushed[:i], w.pushed[i+1:]...)
			break
		}
	}
	if len(w.pushed) == 0 {
		w.pushed = nil // let a long list's array go
	}
	t.pushed = false
	st.pushWaiting--
	s.updateReady(st, w)
}

// giveBackCheck is worker wk looking over the claims pushed to it that it
// has not started, at the first one's steal grace and then as routing says:
// a worker with a slot free and admitted would have started them, so it is
// busy, or admission holds it back. Running batch work, it gives way for
// interactive work due for preemption (preemptCheck, agent.preemptLoop);
// else it gives back what routing.QueuePolicy.Returns says
// (agent.returnPushes) to the task's dispatcher: an interactive claim
// stranded on a worker that runs other work too, which its dispatcher
// then hands to a worker that gives way (preemptDue).
func (s *sim) giveBackCheck(st *stage, wk *worker) {
	if len(wk.pushed) == 0 {
		return
	}
	now := s.clk.now
	if wk.waitPos >= 0 {
		// Free and admitted: its wake, due within a watch delivery, starts them.
		s.lookAt(st, wk, now+routing.LookAgain)
		return
	}
	if s.preemptCheck(st, wk) {
		return // its slot frees at its step's end, and it starts one of them
	}
	s.inbox = s.inboxOf(st, wk, s.inbox[:0])
	canPreempt := wk.running != nil && wk.running.job.class == routing.Batch // agent.returnPushes: batchOnly, whatever the stage
	back, next := s.cfg.Queue.Returns(s.inbox, s.epoch.Add(now), len(st.workers) > 1, canPreempt, wk.book)
	s.back = s.back[:0]
	for _, r := range back {
		s.back = append(s.back, wk.pushed[r.Index])
	}
	for _, u := range s.back {
		// jobs.Store.Requeue: the task back to its dispatcher, unclaimed,
		// the claim deleted; the dispatcher hands it to the next worker to
		// grant it a slot (no hand-over by gossip's free slots).
		s.unpush(st, wk, u)
		s.etcd.write(now, 1)
		s.giveBacks++
		if u.assigned {
			s.assignsBack++ // its claim txn started nothing
		}
		s.giveBacksBy[st.i]++
		if wk.held {
			s.heldGiveBacks++
		}
		s.clk.at(now+s.etcd.writeLat(now), event{kind: evRequeued, stage: int8(st.i), task: u})
	}
	if !next.IsZero() {
		s.lookAt(st, wk, next.Sub(s.epoch))
	}
	// An offer not yet written is nothing to give back; its write's
	// event brings the worker back.
	for _, t := range wk.pushed {
		if t.confirmAt > now {
			s.lookAt(st, wk, t.confirmAt)
		}
	}
}

// lookAt has worker wk look over its pushed claims at t (giveBackCheck),
// unless a look is due by then.
func (s *sim) lookAt(st *stage, wk *worker, t time.Duration) {
	if wk.lookAt >= 0 && wk.lookAt <= t {
		return
	}
	wk.lookAt = t
	s.clk.at(t, event{kind: evGiveBack, stage: int8(st.i), worker: wk.idx})
}

// inboxOf appends to dst the claims pushed to worker wk, as routing sees
// them: what the agent passes its queue policy (agent.pushedOf).
func (s *sim) inboxOf(st *stage, wk *worker, dst []routing.Pushed) []routing.Pushed {
	now := s.clk.now
	for k, t := range wk.pushed {
		dst = append(dst, routing.Pushed{
			Candidate: t.candidate(pushID(k), st.names[wk.idx], s.epoch),
			At:        s.epoch.Add(t.pushedAt),
			Offered:   t.confirmAt > now,
		})
	}
	return dst
}

// requeued is a give-back landing: the task is in the queue again, in its
// old place (its key is kept), still hinted to the worker it was pushed
// to, whose steal grace has passed: anyone may take it.
func (s *sim) requeued(t *task) {
	st := s.st[t.stage]
	s.hold(st, st.workers[t.pushTo], -1)
	t.claimed, t.pushTo, t.handedOn, t.assigned = false, -1, false, false
	s.requeueTask(st, t)
	s.watchDue(t)
	s.stageEvent(st, 1) // the dispatcher's ledger (the claim's deletion: the inbox takes puts only)
}

// stageEvent is a transaction that changes st's task or claim keys, seen
// by n watches: the task's dispatcher's (jobs.Fed follows the task's one
// key) and the inboxes of the workers whose claims it writes or deletes
// (jobs.Inbox follows a node's own claim keys); nobody follows a whole
// stage. It wakes st's idle workers (a model of their inboxes and grants
// moving; waking costs etcd nothing).
func (s *sim) stageEvent(st *stage, n int) {
	now := s.clk.now
	s.etcd.event(now, n)
	if len(st.waiting) > 0 {
		s.requestWake(st, now+s.etcd.watchLat(now))
	}
}

// requestWake schedules st's waiters to wake at t, unless a wake is due by
// then: that wake sees the state at its time, which includes this change.
func (s *sim) requestWake(st *stage, t time.Duration) {
	if st.wakeAt >= 0 && st.wakeAt <= t {
		return
	}
	st.wakeAt = t
	s.clk.at(t, event{kind: evWake, stage: int8(st.i)})
}

// addWaiting is worker w idle: asleep on its views, waiting (it may
// start a task), or held back by admission until a task it fed is done
// (holdBack, fedDone).
func (s *sim) addWaiting(st *stage, w int32) {
	wk := st.workers[w]
	if !s.admitted(st, wk) {
		s.holdBack(st, w)
		return
	}
	wk.waitPos = int32(len(st.waiting))
	st.waiting = append(st.waiting, w)
	s.updateReady(st, wk)
}

func (s *sim) removeWaiting(st *stage, w int32) {
	p := st.workers[w].waitPos
	last := st.waiting[len(st.waiting)-1]
	st.waiting[p] = last
	st.workers[last].waitPos = p
	st.waiting = st.waiting[:len(st.waiting)-1]
	st.workers[w].waitPos = -1
	s.updateReady(st, st.workers[w])
}

func (s *sim) setFree(st *stage, delta int) { st.free += delta }

// freeInGossip reports whether worker w looked free GossipDelay ago.
func (s *sim) freeInGossip(w *worker) bool {
	t := s.clk.now - s.cfg.GossipDelay
	if w.busy {
		return w.busySince > t
	}
	return w.idleSince <= t
}

// pickHint names the preferred worker of st for a new task, as a producer
// with no grant from st does (agent.pickHint): routing.PickHint over
// workers gossip shows with a free slot, else with queue credit (room).
// Every worker has one slot and none shares a host, so PickHint's choice
// is uniform among the free ones; it is given a uniform sample of them,
// not all 10,000.
func (s *sim) pickHint(st *stage) int32 {
	var targets [2]routing.Target
	var idx [2]int32
	n := 0
	var roomy [2]routing.Target
	var ridx [2]int32
	r := 0
	for try := 0; try < 64 && n < len(targets); try++ {
		w := st.workers[s.rng.IntN(len(st.workers))]
		switch {
		case s.heldInGossip(w):
			// Its gossip leaves the stage out of its roles (agent.takesWork).
		case s.freeInGossip(w):
			if n == 0 || idx[0] != w.idx {
				targets[n], idx[n] = routing.Target{Node: st.names[w.idx], Free: 1}, w.idx
				n++
			}
		case r < len(roomy) && (r == 0 || ridx[0] != w.idx):
			if room := s.roomInGossip(st, w); room > 0 {
				roomy[r], ridx[r] = routing.Target{Node: st.names[w.idx], Room: room}, w.idx
				r++
			}
		}
	}
	cands, cidx := targets[:n], idx[:n]
	if n == 0 {
		cands, cidx = roomy[:r], ridx[:r]
	}
	name := routing.PickHint(cands, s.rng)
	for i, t := range cands {
		if t.Node == name {
			return cidx[i]
		}
	}
	return -1
}

// roomInGossip is busy worker w's queue credit as gossip shows it, a
// GossipDelay late (routing.SlotBook.Room): the tasks that would start
// within the hold after its running one, less the claims pushed to it
// that gossip has caught up with. Pushes since then are not seen yet,
// which is how gossip's queue credit overbooks a worker.
func (s *sim) roomInGossip(st *stage, w *worker) int {
	now := s.clk.now
	seen := s.pushesInGossip(w)
	if w.busy {
		return w.book.Room(seen, s.cfg.Queue.HoldFor, s.epoch.Add(now))
	}
	// Idle, but not for a GossipDelay: gossip shows it busy, as it last
	// published, with the room it had as its task started.
	n := 0
	for k := seen; n < routing.MaxRoom && time.Duration(k+1)*st.compute <= s.cfg.Queue.HoldFor; k++ {
		n++
	}
	return n
}

// pushesInGossip counts the claims pushed to w that gossip has caught up
// with.
func (s *sim) pushesInGossip(w *worker) int {
	n := 0
	for _, t := range w.pushed {
		if t.pushedAt <= s.clk.now-s.cfg.GossipDelay {
			n++
		}
	}
	return n
}

// wake is a stage's waiting workers (admitted: held-back ones are not
// waiting, holdBack) waking at once. Each with claims in its inbox (pushed
// to it, or handed on) starts its first choice of them
// (routing.QueuePolicy.Pick) with no transaction. The rest are handed
// waiting tasks by their dispatchers (agent.dispatch), in order
// (routing.QueuePolicy.Order; one claim txn each after the grant's
// message, which nobody races: only a task's dispatcher hands it on): a
// worker that granted them its slot (grants.go), and, once tasks went
// nowhere for grantWait, one that gossip shows free and settled, whoever
// its slot is promised to. None of it reads etcd.
func (s *sim) wake(st *stage) {
	st.wakeAt = -1
	now := s.clk.now
	if len(st.waiting) == 0 {
		return // none idle, or admission holds every idle one back
	}
	tnow := s.epoch.Add(now)
	s.ready = append(s.ready[:0], st.ready...)
	for _, h := range s.ready {
		if st.workers[h].waitPos >= 0 {
			s.takeOwn(st, h, tnow)
		}
	}
	if st.queued > 0 {
		s.handOn(st, tnow)
	}
	if s.cfg.Steal && st.queued == 0 {
		for _, w := range st.waiting {
			if wk := st.workers[w]; len(wk.pushed) == 0 && !wk.stealing {
				s.stealFor(st, wk)
			}
		}
	}
}

// handOn is each dispatcher with tasks of st waiting handing them on in
// its own order (routing.QueuePolicy.Order over its ledger): to the
// waiting workers whose credit its ledger holds, and, once it handed
// nothing on for grantWait, to workers gossip shows free and settled
// (agent.dispatch, byGossip). It wakes the stage again when the latter
// may apply.
func (s *sim) handOn(st *stage, tnow time.Time) {
	now := s.clk.now
	// Against credit: the ledgers a grant reached while they had work.
	s.dispW = append(s.dispW[:0], st.credited...)
	st.credited = st.credited[:0]
	for _, d := range s.dispW {
		l := st.ledgers[d]
		l.credited = false
		// Its credits of idle workers with nothing in their inbox.
		granted := s.grantedW[:0]
		for _, w := range st.granted[d] {
			if wk := st.workers[w]; s.holds(d, wk) && wk.waitPos >= 0 && len(wk.pushed) == 0 {
				granted = append(granted, w)
			}
		}
		s.grantedW = granted
		if l.q.queued > 0 && len(granted) > 0 {
			s.handFrom(st, l, tnow, granted, nil)
		}
	}
	// By gossip, to workers shown free and settled: only while some are,
	// from the ledgers that handed nothing on for grantWait.
	settled := s.settledWorkers(st, s.settledW[:0])
	var fallback time.Duration = -1 // when a gossip hand-on may next apply
	if st.settleAt > 0 {
		fallback = st.settleAt
	}
	if len(settled) > 0 {
		keep := st.waitingD[:0]
		for _, d := range st.waitingD {
			if l := st.ledgers[d]; l.on {
				keep = append(keep, d)
			} else {
				l.listed = false
			}
		}
		st.waitingD = keep
		s.dispW = append(s.dispW[:0], st.waitingD...)
		for _, d := range s.dispW {
			l := st.ledgers[d]
			switch {
			case l.q.queued == 0:
			case now-l.progressAt < grantWait:
				if at := l.progressAt + grantWait; fallback < 0 || at < fallback {
					fallback = at
				}
			default:
				settled = s.handFrom(st, l, tnow, nil, settled)
			}
			if len(settled) == 0 {
				break
			}
		}
	}
	s.settledW = settled
	if st.queued > 0 && fallback >= 0 {
		s.requestWake(st, fallback)
	}
}

// handFrom is ledger l's dispatcher handing its first choices on, one to
// each worker of granted (whose credit it spends, at random), then of
// settled, while it has tasks (one claim txn each, one after another); it
// returns what is left of settled. A worker handed a task meanwhile is
// passed over.
func (s *sim) handFrom(st *stage, l *ledger, tnow time.Time, granted, settled []int32) []int32 {
	now := s.clk.now
	n := len(granted) + len(settled)
	s.cands, s.tasks = l.q.scan(min(s.cfg.ScanPerClass, n), s.epoch, s.cands, s.tasks)
	ordered, retry := s.cfg.Queue.Order(s.cands, l.name, tnow)
	at := now + s.etcd.writeLat(now)
	sent := now + s.cfg.NetDelay
	for _, c := range ordered[:min(n, len(ordered))] {
		w := int32(-1)
		for w < 0 && len(granted) > 0 {
			i := s.rng.IntN(len(granted))
			w, granted[i] = granted[i], granted[len(granted)-1]
			granted = granted[:len(granted)-1]
			if st.workers[w].waitPos < 0 {
				w = -1
			} else {
				st.workers[w].grantTo = -1 // spent
			}
		}
		for w < 0 && len(settled) > 0 {
			w, settled = settled[len(settled)-1], settled[:len(settled)-1]
			if st.workers[w].waitPos < 0 {
				w = -1
			}
		}
		if w < 0 {
			break
		}
		s.etcd.write(now, 1) // jobs.Store.Assign
		s.claimTxns++
		s.removeWaiting(st, w)
		s.claim(st, w, s.tasks[idIndex(c.ID)], sent, sent+(at-now))
		sent += at - now // its Assigns go one after another
		l.progressAt = now
	}
	if !retry.IsZero() {
		s.requestWake(st, retry.Sub(s.epoch))
	}
	return settled
}

// settledWorkers appends to dst the waiting workers of st, with nothing
// in their inbox, that gossip has shown free for gossipSettled, and sets
// st.settleAt to when the next of the rest settles (0: none); it looks
// again only from then (a worker that goes idle meanwhile settles later
// still).
func (s *sim) settledWorkers(st *stage, dst []int32) []int32 {
	now := s.clk.now
	if now < st.settleAt {
		return dst
	}
	st.settleAt = 0
	for _, w := range st.waiting {
		wk := st.workers[w]
		if len(wk.pushed) > 0 {
			continue // its inbox's claims take its slot
		}
		if at := wk.idleSince + s.cfg.GossipDelay + gossipSettled; at <= now {
			dst = append(dst, w)
		} else if st.settleAt == 0 || at < st.settleAt {
			st.settleAt = at
		}
	}
	return dst
}

// takeOwn is waiting worker h starting one of the claims in its inbox
// (jobs.Inbox.Take, no transaction), chosen as the agent's worker chooses
// (routing.QueuePolicy.Pick).
func (s *sim) takeOwn(st *stage, h int32, tnow time.Time) {
	wk := st.workers[h]
	s.inbox = s.inboxOf(st, wk, s.inbox[:0])
	k, _, _ := s.cfg.Queue.Pick(s.inbox, st.names[h], tnow, nil)
	if k < 0 {
		return
	}
	t := wk.pushed[k]
	s.unpush(st, wk, t)
	t.fromPush = true
	s.removeWaiting(st, h)
	s.occupy(wk)
	s.setFree(st, -1)
	s.clk.at(s.clk.now, event{kind: evClaimed, stage: int8(st.i), worker: h, task: t})
}

// pushID names the k-th claim pushed to a worker among its candidates
// (indexID names the scanned tasks).
func pushID(k int) string { return "p" + strconv.Itoa(k) }

// claim is a dispatcher's hand-on of unclaimed task t to worker w (mesh:
// its claim txn sent at sent, landing at lands; with offers the worker
// has it one message after it was sent), or the dispatcher assigning t to
// GPU w (central: at lands).
func (s *sim) claim(st *stage, w int32, t *task, sent, lands time.Duration) {
	t.claimed = true
	s.unqueue(st, t)
	wk := st.workers[w]
	s.occupy(wk)
	s.setFree(st, -1)
	at := lands
	if s.offers() {
		at = sent + s.cfg.NetDelay
		t.confirmAt = lands + s.etcd.watchLat(sent)
	}
	s.clk.at(at, event{kind: evClaimed, stage: int8(st.i), worker: w, task: t})
}

// occupy is worker wk's slot taken by a task, now: a grant of it still
// out is taken back (agent.revokeGrant), and its slot clock starts.
func (s *sim) occupy(wk *worker) {
	wk.busy, wk.busySince, wk.grantTo = true, s.clk.now, -1
	_, wk.slotDone = wk.book.Take("", s.epoch.Add(s.clk.now))
}

// release is worker wk's slot freed by its task, now: learn, when the
// task ran to its end, so that its slot clock learns how long the stage
// takes (a stopped run says nothing of that).
func (s *sim) release(wk *worker, learn bool) {
	wk.busy, wk.idleSince = false, s.clk.now
	wk.slotDone(s.epoch.Add(s.clk.now), learn)
	wk.slotDone = nil
}

// start is a worker holding its task: the claim landed or it took a
// pushed one (mesh), or the assignment arrived (central).
func (s *sim) start(st *stage, w int32, t *task) {
	now := s.clk.now
	wk := st.workers[w]
	wk.running = t
	if s.admits(st) && !s.cfg.Admission.Off && s.mine(wk) > int(wk.quota) {
		s.overQuota++ // started past its share (TestAdmissionPerWorker: never)
	}
	ready := max(t.avail, wk.freeAt)
	t.job.queueing += now - t.avail
	t.job.overhead += now - ready
	setup := time.Duration(0)
	if !s.central() {
		// A running task learns of a cancel from its view
		// (jobs.Queue.TaskGone): no watch of its own.
		switch {
		case t.fromPush && t.byDispatcher():
			// Handed on by its dispatcher: to a worker that gives way
			// (preemptDue), or against queue credit (assignQueued, a
			// claim txn as any other hand-on). Its claim is in the inbox,
			// and the producer checks it before it issues the ticket (one
			// read).
			if t.handedOn {
				s.pushedStarts[st.i]++
				s.handOnStarts++
			} else {
				s.claimedStarts[st.i]++
			}
			if st.inBytes > 0 {
				s.etcd.read(now, 1)
				setup += s.etcd.readLat(now)
			}
		case t.fromPush:
			// Claimed by its creator, with the ticket for its input issued
			// to this worker (transfer.Service.Issue): no transaction, no
			// ticket request.
			s.pushedStarts[st.i]++
		default:
			// The dispatcher's claim txn put the claim key (the worker's
			// inbox sees it) and rewrote the task key (the dispatcher's
			// ledger sees it). For a pulled input the producer checks the
			// claim before it issues a ticket (ClaimHolder, one read).
			s.claimedStarts[st.i]++
			s.hold(st, wk, 1)
			s.stageEvent(st, 2)
			if st.inBytes > 0 {
				s.etcd.read(now, 1)
				setup += s.etcd.readLat(now)
			}
		}
		if st.i == 1 && s.hints() {
			// Denoise names decode's worker before its sampler runs
			// (agent.denoise); a push picks again at the commit.
			t.nextHint = s.pickHint(s.st[2])
		}
		s.grantQueue(st, wk, t) // agent.grantQueue, as its claim is taken
	}
	if st.inBytes > 0 {
		setup += 2*s.cfg.NetDelay + time.Duration(float64(st.inBytes)/s.cfg.Bandwidth*float64(time.Second))
	}
	compute := st.compute
	if t.left > 0 {
		compute = t.left // resumed from its checkpoint
	}
	t.run++
	t.runStart, t.runEnd = now+setup, now+setup+compute
	s.clk.at(t.runEnd, event{kind: evDone, stage: int8(st.i), worker: w, task: t, run: t.run})
}

func (s *sim) done(st *stage, w int32, t *task) {
	now := s.clk.now
	s.computed(t.runStart, now)
	wk := st.workers[w]
	wk.freeAt, wk.running = now, nil
	t.avail = now // the next stage's task could run from here
	if s.central() {
		s.clk.at(now+s.cfg.NetDelay, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
		return
	}
	// Denoise progress costs etcd nothing (agent/progress): no write here.
	t.doneAt = now
	if st.i < 2 && s.hints() {
		next := s.st[st.i+1]
		if st.i == 0 {
			t.nextHint = s.pickHint(next) // encode names denoise's worker once its work is done
		}
		if s.cfg.Queue.Push {
			// agent.commit: pushTarget picks the next stage's worker now; a
			// free one gets the task with its claim.
			t.nextPush = s.pushTarget(next, w)
		}
	}
	// Commit: the fenced txn, on the job record. A claim pushed by the
	// transaction that wrote the record (a submit, a commit) carries it;
	// a dispatcher's later hand-on does not, so that commit reads it first.
	// An offered claim's commit waits for the write that confirms it.
	sent := max(t.confirmAt, now)
	if !t.fromPush || t.byDispatcher() {
		s.etcd.read(now, 1)
		sent += s.etcd.readLat(now)
	}
	lands := sent + s.etcd.writeLat(now)
	s.clk.at(lands, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
	if t.nextPush >= 0 && s.offers() {
		// Offered as the commit goes: the next stage's worker starts it
		// before the commit lands (agent/jobs offer.go).
		t.next = s.nextTask(t, w)
		s.offer(t.next, sent, lands)
	}
	// The credit goes back now, before the commit (agent.execute): the
	// worker's loop looks for its next task at once. Admission counts this
	// task until its commit lands, and the views count its claim.
	s.release(wk, true)
	s.setFree(st, +1)
	st.committing++
	wk.committing++
	s.addWaiting(st, w)
	s.requestWake(st, now)
	s.grantFreed(st, w, t)
}

func (s *sim) committed(st *stage, w int32, t *task) {
	now := s.clk.now
	if s.central() {
		// The dispatcher handles the report in turn.
		if !t.reported {
			t.reported = true
			at := s.decide()
			s.clk.at(at, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
			return
		}
		// The dispatcher records the stage durably in the job record,
		// which the client's long poll watches. The dispatcher holds the
		// state, so the record, for recovery, does not hold up the next
		// assignment.
		s.etcd.write(now, 1)
		if st.i == 2 {
			s.etcd.event(now, 1) // the ended key: the client's long poll
			s.keepResult(now)
		}
	} else {
		s.etcd.write(now, 1)
		// The task and its claim deleted: the task's dispatcher's ledger
		// sees it (the worker's inbox takes puts only).
		s.stageEvent(st, 1)
		if st.i > 1 || st.i == 1 && !s.cfg.CondCached {
			// The consumed input's payload record is deleted: its
			// producer's release watch (payloads/<producer>/) alone sees
			// it. The new output's record is a put, which that watch
			// filters out. A cache entry is no payload: it outlives its
			// consumers.
			s.etcd.event(now, 1)
		}
		if st.i == 2 {
			// The finishing commit writes the job's ended key, which the
			// client's long poll watches (jobs.Store.Wait): one event a
			// job, whichever design.
			s.etcd.event(now, 1)
			s.keepResult(now) // its record is written by this commit
		}
		s.hold(st, st.workers[w], -1)
		st.committing--
		st.workers[w].committing--
		s.fedDone(st, t)
		s.creditReturned(st, w, t)
	}
	t.gone = true
	if st.i < 2 {
		next := t.next // offered as the commit went
		if next == nil {
			next = s.nextTask(t, w)
		}
		if !s.central() {
			st.workers[w].fed++ // in its ledger from the commit (agent.committedOutput)
		}
		s.enqueue(next)
	} else {
		s.finish(t.job)
	}
	if s.central() {
		wk := st.workers[w]
		s.release(wk, true)
		s.setFree(st, +1)
		s.addWaiting(st, w)
		s.requestDispatch()
	}
	// Mesh: the worker took up its next task at done.
}

// nextTask is the next stage's task that t's commit creates (t ran on w),
// pushed with it when t's worker chose a worker to push to.
func (s *sim) nextTask(t *task, w int32) *task {
	next := newTask(t.job, t.stage+1, t.avail)
	next.producer = w
	next.hint = t.nextHint
	if t.nextPush >= 0 {
		// Pushed in this commit: the claim was written as the commit
		// began.
		next.hint, next.pushTo, next.pushedAt = t.nextPush, t.nextPush, t.doneAt
	}
	return next
}

// keepResult is the Store taking a job's result in: its object record,
// with a marker for each of its two holders, written with the decode's
// commit (the mesh) or the dispatcher's record of it (central); each
// holder's Store watches its own markers (holders/<node>/) and takes the
// record from the marker, which carries it; it follows a result by its
// marker alone, with no watch of the record (cache/follow.go). Both
// designs keep results in the Store alike: where the result lives is not
// the dispatcher's choice.
func (s *sim) keepResult(now time.Duration) {
	s.etcd.event(now, 2)
}

func (s *sim) finish(j *job) {
	j.completed++
	s.completed++
	if s.clk.now <= s.cfg.Duration {
		s.completedInWindow++
	}
	if s.seen != nil {
		s.seen[j.id]++
	}
	s.overhead += j.overhead
	s.overheads.add(j.overhead)
	s.queueing.add(j.queueing)
	s.queueingBy[j.class].add(j.queueing)
}

// decide is one decision of the central dispatcher, which takes them one
// at a time: it returns when the decision is made.
func (s *sim) decide() time.Duration {
	s.dispBusy += s.cfg.DispatchCost
	s.dispBusyUntil = max(s.clk.now, s.dispBusyUntil) + s.cfg.DispatchCost
	return s.dispBusyUntil
}

func (s *sim) requestDispatch() {
	if s.dispPending {
		return
	}
	s.dispPending = true
	s.clk.at(max(s.clk.now, s.dispBusyUntil), event{kind: evDispatch})
}

// dispatch is the central dispatcher matching queued tasks to free GPUs,
// each stage's queue ordered by the same routing.QueuePolicy (no hints).
func (s *sim) dispatch() {
	s.dispPending = false
	now := s.clk.now
	more := false
	for _, st := range s.st {
		if len(st.waiting) == 0 || st.queued == 0 {
			continue
		}
		// g free GPUs take Order's first g choices: among the oldest g
		// of each class.
		s.cands, s.tasks = st.ledgers[0].q.scan(min(s.cfg.ScanPerClass, len(st.waiting)), s.epoch, s.cands, s.tasks)
		ordered, _ := s.cfg.Queue.Order(s.cands, "", s.epoch.Add(now))
		for _, c := range ordered {
			if len(st.waiting) == 0 {
				break
			}
			t := s.tasks[idIndex(c.ID)]
			g := st.waiting[len(st.waiting)-1]
			s.removeWaiting(st, g)
			at := s.decide()
			s.claim(st, g, t, at, at+s.cfg.NetDelay) // central: no offers
		}
		if len(st.waiting) > 0 && st.queued > 0 {
			more = true // the scan's limit left some
		}
	}
	if more {
		s.requestDispatch()
	}
}
