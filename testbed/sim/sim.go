package sim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
)

// Per-agent background etcd traffic that does not depend on jobs
// (docs/benchmarks.md, "Idle etcd load": 0.2 requests/s, two reads each 10 s).
const (
	safetyNetEvery = 10 * time.Second     // cache.DefaultConfig.MaintainEvery and the membership's pass
	safetyNetReads = 2                    // the Store's read of the object records, the membership's of the members
	keepAliveEvery = 10 * time.Second / 3 // gossip: lease TTL 10 s, renewed about every third
)

// Result is what one run measured.
type Result struct {
	Mode     string          `json:"mode"`
	Model    string          `json:"model"`
	GPUs     int             `json:"gpus"`
	Pools    costmodel.Pools `json:"pools"`
	Duration time.Duration   `json:"duration"`
	Load     float64         `json:"load"`
	Seed     uint64          `json:"seed"`

	Submitted  int     `json:"submitted"`
	Completed  int     `json:"completed"`
	Unfinished int     `json:"unfinished"` // still queued or running when the drain ended
	JobsPerSec float64 `json:"jobs_per_s"` // completed within Duration, per second

	// DispatchOverhead is the mean per job, summed over its stages, of the
	// time from a task being runnable with a GPU free for it until that GPU
	// has it: commit and claim latency, watch delay, scans, lost claim
	// races, held-back hints (mesh); messages and decisions (central).
	DispatchOverheadMs float64 `json:"dispatch_overhead_ms"`
	Conflicts          uint64  `json:"claim_conflicts"`
	ConflictsPerJob    float64 `json:"claim_conflicts_per_job"`

	EtcdWritesPerJob  float64 `json:"etcd_writes_per_job"`
	EtcdReadsPerJob   float64 `json:"etcd_reads_per_job"`
	EtcdWatchesPerJob float64 `json:"etcd_watch_creates_per_job"`
	EtcdEventsPerJob  float64 `json:"etcd_watch_events_per_job"`
	EtcdOpsPerJob     float64 `json:"etcd_ops_per_job"` // writes + reads + watch creations
	EtcdOpsPerSec     float64 `json:"etcd_ops_per_s"`
	EtcdEventsPerSec  float64 `json:"etcd_watch_events_per_s"`
	// EtcdLoad is the mean share of one etcd's measured capacity used while
	// jobs arrived (1 = saturated); EtcdPeakLoad the busiest second.
	EtcdLoad     float64 `json:"etcd_load"`
	EtcdPeakLoad float64 `json:"etcd_peak_load"`
	// DispatcherLoad is the central dispatcher's busy share (central only).
	DispatcherLoad float64 `json:"dispatcher_load,omitempty"`

	Utilisation float64 `json:"gpu_utilisation"` // compute time / GPU time while jobs arrived
	QueueP50Ms  float64 `json:"queue_p50_ms"`    // per job, summed over stages
	QueueP99Ms  float64 `json:"queue_p99_ms"`

	SimSeconds  float64 `json:"sim_s"` // simulated time including the drain
	Events      uint64  `json:"events"`
	WallSeconds float64 `json:"wall_s"`
}

type worker struct {
	idx       int32
	busy      bool
	waitPos   int32         // index in its stage's waiting list, -1 when not waiting
	idleSince time.Duration // last change to idle
	busySince time.Duration // last change to busy
	freeAt    time.Duration // its last compute ended
}

type stage struct {
	i       int
	compute time.Duration
	inBytes int64 // the input pulled from the previous stage
	workers []*worker
	names   []string
	waiting []int32 // mesh: idle workers asleep on a watch; central: free GPUs
	q       stageQueue
	wakeAt  time.Duration // mesh: the pending wake, -1 when none
	blocked bool          // mesh: waiters watch the next stage (admission refused)
	free    int
}

type sim struct {
	cfg    Config
	model  costmodel.Model
	plan   costmodel.Plan
	rng    *rand.Rand
	clk    clock
	etcd   *etcdModel
	st     [3]*stage
	epoch  time.Time
	rate   float64
	cands  []routing.Candidate
	small  []routing.Candidate
	tasks  []*task
	taken  []bool
	nextID int
	seen   map[int]int // job id -> completions (CheckJobs)

	submitted, completed, completedInWindow int
	conflicts                               uint64
	overhead                                time.Duration
	queueing                                histogram
	busy                                    time.Duration // compute inside [0, Duration]
	progressWrites                          int

	snap          etcdModel // the counters when arrivals stop
	snapped       bool
	dispBusyUntil time.Duration
	dispBusy      time.Duration
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
	plan, err := costmodel.PlanPools(m, cfg.GPUs, 0)
	if err != nil {
		return nil, err
	}
	s := &sim{
		cfg:   cfg,
		model: m,
		plan:  plan,
		rng:   rand.New(rand.NewPCG(cfg.Seed, 0x6c6d)),
		etcd:  newEtcdModel(cfg.Etcd),
		epoch: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		rate:  cfg.Load * plan.Capacity,
		taken: make([]bool, 0, 3*cfg.ScanPerClass),
	}
	if cfg.CheckJobs {
		s.seen = map[int]int{}
	}
	sizes := [3]int{plan.Pools.Encode, plan.Pools.Denoise, plan.Pools.Decode}
	inBytes := [3]int64{0, m.Cond.Bytes(), m.Latent.Bytes()}
	for i, name := range costmodel.Stages {
		st := &stage{i: i, compute: m.StageTime(name), inBytes: inBytes[i], wakeAt: -1, free: sizes[i]}
		for w := range sizes[i] {
			st.workers = append(st.workers, &worker{idx: int32(w), waitPos: -1})
			st.names = append(st.names, fmt.Sprintf("%s-%d", name, w))
		}
		for w := range st.workers {
			s.addWaiting(st, int32(w))
		}
		s.st[i] = st
	}
	for k := time.Duration(0); k < cfg.Duration; k += time.Second {
		s.clk.at(k, event{kind: evTick})
	}
	s.clk.at(s.interarrival(), event{kind: evArrive})
	return s, nil
}

func (s *sim) run() Result {
	start := time.Now()
	cfg := s.cfg
	drainEnd := 2 * cfg.Duration
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
}

func (s *sim) interarrival() time.Duration {
	return time.Duration(s.rng.ExpFloat64() / s.rate * float64(time.Second))
}

func (s *sim) class() routing.Class {
	mix := s.cfg.ClassMix
	x := s.rng.Float64() * (mix[0] + mix[1] + mix[2])
	for c, f := range mix {
		if x < f {
			return routing.Class(c)
		}
		x -= f
	}
	return routing.Batch
}

func (s *sim) central() bool { return s.cfg.Mode == Central }

func (s *sim) handle(e event) {
	now := s.clk.now
	switch e.kind {
	case evTick:
		if !s.central() {
			// Every agent's safety-net reads (the Store's and the
			// membership's, each safetyNetEvery) and its lease renewals
			// (each keepAliveEvery). Its queue views cost nothing idle.
			n := s.cfg.GPUs
			s.etcd.read(now, int(float64(n*safetyNetReads)*time.Second.Seconds()/safetyNetEvery.Seconds()+0.5))
			s.etcd.read(now, int(float64(n)*time.Second.Seconds()/keepAliveEvery.Seconds()+0.5))
		}
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
		s.done(s.st[e.stage], e.worker, e.task)
	case evCommitted:
		s.committed(s.st[e.stage], e.worker, e.task)
	case evDispatch:
		s.dispatch()
	}
}

func (s *sim) arrive() {
	now := s.clk.now
	if now < s.cfg.Duration {
		s.clk.at(now+s.interarrival(), event{kind: evArrive})
	} else {
		return
	}
	j := &job{id: s.nextID, class: s.class(), arrive: now}
	s.nextID++
	s.submitted++
	t := &task{job: j, stage: 0, avail: now, hint: -1}
	if s.central() {
		// The dispatcher records the job durably (one write) and queues it.
		s.etcd.write(now, 1)
		s.clk.at(now+s.cfg.NetDelay, event{kind: evEnqueue, task: t})
		return
	}
	// Submit: job record and encode task in one txn; the client long-polls
	// the job (httpapi wait, Store.Wait: a watch, then a read).
	s.etcd.write(now, 1)
	s.etcd.watch(now, 1)
	s.etcd.read(now, 1)
	s.clk.at(now+s.etcd.writeLat(now), event{kind: evEnqueue, task: t})
}

func (s *sim) enqueue(t *task) {
	now := s.clk.now
	st := s.st[t.stage]
	t.enq = now
	st.q.push(t)
	if s.central() {
		s.requestDispatch()
		return
	}
	s.stageEvent(st, 1)
}

// stageEvent is a change of st's task or claim keys (n events per
// follower: a claim or a commit changes both, one event on each of a view's
// two watches). It reaches every agent whose queue view follows st, idle or
// busy: st's workers and the previous stage's agents, whose admission reads
// st's view (jobs.Queue). It wakes st's idle workers, and the previous
// stage's when admission held them back; waking costs etcd nothing, they
// scan their views in memory.
func (s *sim) stageEvent(st *stage, n int) {
	now := s.clk.now
	followers := len(st.workers)
	if st.i > 0 {
		followers += len(s.st[st.i-1].workers)
	}
	s.etcd.event(now, n*followers)
	if len(st.waiting) > 0 {
		s.requestWake(st, now+s.etcd.watchLat(now))
	}
	if st.i > 0 {
		if up := s.st[st.i-1]; up.blocked && len(up.waiting) > 0 {
			s.requestWake(up, now+s.etcd.watchLat(now))
		}
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

func (s *sim) addWaiting(st *stage, w int32) {
	st.workers[w].waitPos = int32(len(st.waiting))
	st.waiting = append(st.waiting, w)
}

func (s *sim) removeWaiting(st *stage, w int32) {
	p := st.workers[w].waitPos
	last := st.waiting[len(st.waiting)-1]
	st.waiting[p] = last
	st.workers[last].waitPos = p
	st.waiting = st.waiting[:len(st.waiting)-1]
	st.workers[w].waitPos = -1
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

// pickHint names the preferred worker of st for a new task, as the
// producer does: routing.PickHint over workers with credit in gossip. Every
// worker has one credit and none shares a host, so PickHint's choice is
// uniform among them; it is given a uniform sample of them, not all 10,000.
func (s *sim) pickHint(st *stage) int32 {
	var targets [2]routing.Target
	var idx [2]int32
	n := 0
	for try := 0; try < 64 && n < len(targets); try++ {
		w := st.workers[s.rng.IntN(len(st.workers))]
		if s.freeInGossip(w) && (n == 0 || idx[0] != w.idx) {
			targets[n], idx[n] = routing.Target{Node: st.names[w.idx], Free: 1}, w.idx
			n++
		}
	}
	name := routing.PickHint(targets[:n], s.rng)
	for i, t := range targets[:n] {
		if t.Node == name {
			return idx[i]
		}
	}
	return -1
}

// wake is a stage's waiting workers waking at once (their views changed):
// each checks admission on the next stage's view, orders its own view's
// unclaimed tasks with routing.QueuePolicy, and claims its first choice;
// losers of a race (ErrTaken: the views lag etcd by a watch delivery) try
// their next choice, as claimNext does. None of it reads etcd: only the
// claims (one txn each, won or lost) reach it. Every non-hinted worker
// orders the same queue the same way, so Order is called once for them and
// once per waiting worker that a task is hinted to.
func (s *sim) wake(st *stage) {
	st.wakeAt = -1
	now := s.clk.now
	w := len(st.waiting)
	if w == 0 {
		return
	}
	if st.i < 2 {
		down := s.st[st.i+1]
		// routing's per-producer quotas add up to the downstream budget
		// (its credits plus slack), or to one per producer where there are
		// more producers; the pool as a whole admits while its backlog
		// (running here, queued downstream) is under their sum.
		budget := s.cfg.Admission.Budget(len(down.workers))
		sum := 0
		if budget > 0 {
			sum = max(budget, len(st.workers))
		}
		if !s.cfg.Admission.Admit(down.q.queued+len(st.workers)-st.free, sum) {
			// Wait for the next stage's view to move, at most a second.
			st.blocked = true
			s.requestWake(st, now+time.Second)
			return
		}
	}
	st.blocked = false
	// w workers claim at most w tasks, Order's first w choices: among the
	// oldest w of each class.
	s.cands, s.tasks = st.q.scan(min(s.cfg.ScanPerClass, w), s.epoch, st.names, s.cands, s.tasks)
	if len(s.cands) == 0 {
		return
	}
	tnow := s.epoch.Add(now)
	ordered, retry := s.cfg.Queue.Order(s.cands, "", tnow)
	s.taken = s.taken[:0]
	for range s.tasks {
		s.taken = append(s.taken, false)
	}
	base := now
	wlat := s.etcd.writeLat(now)
	// Workers a task is hinted to take their own first choice. Their
	// order differs from the common one only by their own hinted tasks, so
	// Order is given those and the common order's first untaken task: the
	// same first choice as from the whole queue, at a fraction of the cost.
	for _, t := range s.tasks {
		if t.hint < 0 || st.workers[t.hint].waitPos < 0 || t.claimed {
			continue
		}
		h := t.hint
		s.small = s.small[:0]
		for i, u := range s.tasks {
			if u.hint == h && !s.taken[i] {
				s.small = append(s.small, s.cands[i])
			}
		}
		for _, c := range ordered {
			if i := idIndex(c.ID); !s.taken[i] {
				if s.tasks[i].hint != h {
					s.small = append(s.small, c)
				}
				break
			}
		}
		own, _ := s.cfg.Queue.Order(s.small, st.names[h], tnow)
		if len(own) == 0 {
			continue
		}
		i := idIndex(own[0].ID)
		s.taken[i] = true
		s.etcd.write(now, 1)
		s.removeWaiting(st, h)
		s.claim(st, h, s.tasks[i], base+wlat)
	}
	// The rest race down the common order.
	g, k := len(st.waiting), 0
	for _, c := range ordered {
		if g == 0 {
			break
		}
		i := idIndex(c.ID)
		if s.taken[i] {
			continue
		}
		s.taken[i] = true
		s.etcd.write(now, g) // every racer's TryClaim is a txn through raft
		s.conflicts += uint64(g - 1)
		winner := st.waiting[s.rng.IntN(g)]
		s.removeWaiting(st, winner)
		k++
		s.claim(st, winner, s.tasks[i], base+time.Duration(k)*wlat)
		g--
	}
	// Workers that lost every race wait on their views again: no etcd op.
	if !retry.IsZero() {
		s.requestWake(st, retry.Sub(s.epoch))
	}
}

func (s *sim) claim(st *stage, w int32, t *task, at time.Duration) {
	t.claimed = true
	st.q.queued--
	wk := st.workers[w]
	wk.busy, wk.busySince = true, s.clk.now
	s.setFree(st, -1)
	s.clk.at(at, event{kind: evClaimed, stage: int8(st.i), worker: w, task: t})
}

// start is a worker holding its task: the claim landed (mesh) or the
// assignment arrived (central).
func (s *sim) start(st *stage, w int32, t *task) {
	now := s.clk.now
	wk := st.workers[w]
	ready := max(t.avail, wk.freeAt)
	t.job.queueing += now - t.avail
	t.job.overhead += now - ready
	setup := time.Duration(0)
	if !s.central() {
		// The claim txn put the claim key and rewrote the task key (the
		// progress key and the job record's read are in it too): an event
		// on each of the views' two watches. Then the cancel watch
		// (watchCancel: Store.Wait, a watch, then a read), and for a
		// pulled input the producer's ticket check (ClaimHolder, one read).
		s.stageEvent(st, 2)
		s.etcd.read(now, 1)
		s.etcd.watch(now, 1)
		if st.inBytes > 0 {
			s.etcd.read(now, 1)
			setup += s.etcd.readLat(now)
		}
	}
	if st.inBytes > 0 {
		setup += 2*s.cfg.NetDelay + time.Duration(float64(st.inBytes)/s.cfg.Bandwidth*float64(time.Second))
	}
	s.clk.at(now+setup+st.compute, event{kind: evDone, stage: int8(st.i), worker: w, task: t})
}

func (s *sim) done(st *stage, w int32, t *task) {
	now := s.clk.now
	begin := now - st.compute
	if lo, hi := max(begin, 0), min(now, s.cfg.Duration); hi > lo {
		s.busy += hi - lo
	}
	st.workers[w].freeAt = now
	t.avail = now // the next stage's task could run from here
	if s.central() {
		s.clk.at(now+s.cfg.NetDelay, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
		return
	}
	if st.i == 1 {
		n := s.progressWritesPerDenoise()
		s.progressWrites += n
		s.etcd.write(now, n)
	}
	// Commit: the fenced txn, on the job record the claim read.
	lat := s.etcd.writeLat(now)
	s.clk.at(now+lat, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
}

// progressWritesPerDenoise counts agent.progress's writes for one denoise:
// the first step, then one each ProgressEvery, and the last step.
func (s *sim) progressWritesPerDenoise() int {
	step := time.Duration(s.model.StepMs * float64(time.Millisecond))
	every := int(math.Ceil(float64(s.cfg.ProgressEvery) / float64(step)))
	every = max(every, 1)
	n := 1 + (s.model.Steps-1)/every
	if (s.model.Steps-1)%every != 0 {
		n++
	}
	return n
}

func (s *sim) committed(st *stage, w int32, t *task) {
	now := s.clk.now
	if s.central() {
		// The dispatcher handles the report in turn.
		if !t.reported {
			t.reported = true
			at := max(now, s.dispBusyUntil) + s.cfg.DispatchCost
			s.dispBusy += s.cfg.DispatchCost
			s.dispBusyUntil = at
			s.clk.at(at, event{kind: evCommitted, stage: int8(st.i), worker: w, task: t})
			return
		}
		s.etcd.write(now, 1) // the dispatcher records the stage durably
	} else {
		s.etcd.write(now, 1)
		// The job record changed: the client's and the worker's watches.
		s.etcd.event(now, 2)
		// Deleted task and claim reach the stage's view followers.
		s.stageEvent(st, 2)
		if st.i > 0 {
			// The consumed input's payload record is deleted: every agent
			// watches payloads/ for releases (WatchReleases).
			s.etcd.event(now, s.cfg.GPUs)
		}
		if st.i == 2 {
			// The result's object record: every Store watches objects/.
			s.etcd.event(now, s.cfg.GPUs)
		}
	}
	t.gone = true
	wk := st.workers[w]
	wk.busy, wk.idleSince = false, now
	s.setFree(st, +1)
	if st.i < 2 {
		next := &task{job: t.job, stage: st.i + 1, avail: t.avail, hint: -1}
		if s.cfg.Mode == Mesh {
			next.hint = s.pickHint(s.st[st.i+1])
		}
		s.enqueue(next)
	} else {
		s.finish(t.job)
	}
	s.addWaiting(st, w)
	if s.central() {
		s.requestDispatch()
		return
	}
	// The worker's loop scans at once for its next task.
	s.requestWake(st, now)
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
	s.queueing.add(j.queueing)
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
		if len(st.waiting) == 0 || st.q.queued == 0 {
			continue
		}
		s.cands, s.tasks = st.q.scan(s.cfg.ScanPerClass, s.epoch, st.names, s.cands, s.tasks)
		ordered, _ := s.cfg.Queue.Order(s.cands, "", s.epoch.Add(now))
		for _, c := range ordered {
			if len(st.waiting) == 0 {
				break
			}
			t := s.tasks[idIndex(c.ID)]
			g := st.waiting[len(st.waiting)-1]
			s.removeWaiting(st, g)
			at := max(now, s.dispBusyUntil) + s.cfg.DispatchCost
			s.dispBusy += s.cfg.DispatchCost
			s.dispBusyUntil = at
			s.claim(st, g, t, at+s.cfg.NetDelay)
		}
		if len(st.waiting) > 0 && st.q.queued > 0 {
			more = true // the scan's limit left some
		}
	}
	if more {
		s.requestDispatch()
	}
}

func (s *sim) result(wall time.Duration) Result {
	cfg := s.cfg
	r := Result{
		Mode: cfg.Mode.String(), Model: cfg.Model, GPUs: cfg.GPUs, Pools: s.plan.Pools,
		Duration: cfg.Duration, Load: cfg.Load, Seed: cfg.Seed,
		Submitted: s.submitted, Completed: s.completed, Unfinished: s.submitted - s.completed,
		JobsPerSec: float64(s.completedInWindow) / cfg.Duration.Seconds(),
		Conflicts:  s.conflicts,
		SimSeconds: s.clk.now.Seconds(), Events: s.clk.count, WallSeconds: wall.Seconds(),
		Utilisation: s.busy.Seconds() / (float64(cfg.GPUs) * cfg.Duration.Seconds()),
		QueueP50Ms:  ms(s.queueing.quantile(0.50)),
		QueueP99Ms:  ms(s.queueing.quantile(0.99)),
	}
	if n := float64(s.completed); n > 0 {
		r.DispatchOverheadMs = ms(s.overhead) / n
		r.ConflictsPerJob = float64(s.conflicts) / n
		r.EtcdWritesPerJob = float64(s.etcd.writes) / n
		r.EtcdReadsPerJob = float64(s.etcd.reads) / n
		r.EtcdWatchesPerJob = float64(s.etcd.watches) / n
		r.EtcdEventsPerJob = float64(s.etcd.events) / n
		r.EtcdOpsPerJob = r.EtcdWritesPerJob + r.EtcdReadsPerJob + r.EtcdWatchesPerJob
	}
	secs := cfg.Duration.Seconds()
	r.EtcdOpsPerSec = float64(s.snap.writes+s.snap.reads+s.snap.watches) / secs
	r.EtcdEventsPerSec = float64(s.snap.events) / secs
	r.EtcdLoad = s.snap.totalLoad / secs
	r.EtcdPeakLoad = s.snap.peakLoad
	if s.central() {
		r.DispatcherLoad = s.dispBusy.Seconds() / s.clk.now.Seconds()
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
