package sim

import (
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
	"math"
	"testing"
	"time"
)

func smallConfig(m Mode) Config {
	c := DefaultConfig()
	c.Mode = m
	c.GPUs = 100
	c.Duration = 10 * time.Minute
	c.CheckJobs = true
	// An etcd far from saturation, so the throughput check holds; the
	// measured figures saturate it at this size (docs/benchmarks.md).
	c.Etcd.WriteCap, c.Etcd.ReadCap, c.Etcd.WatchCreateCap, c.Etcd.EventCap, c.Etcd.KeepAliveCap = 1e6, 1e6, 1e6, 1e7, 1e6
	return c
}

// A small run of every mode: every job completes exactly once, nothing is
// lost or made up, utilisation is a share, and a seed gives the same run.
func TestInvariants(t *testing.T) {
	for _, m := range Modes() {
		t.Run(m.String(), func(t *testing.T) {
			cfg := smallConfig(m)
			s, r := runSim(t, cfg)
			checkDrained(t, s, r)
			if !(r.Utilisation > 0.5 && r.Utilisation <= 1) {
				t.Fatalf("utilisation %v", r.Utilisation)
			}
			want := cfg.Load * s.plan.Capacity
			if r.JobsPerSec < 0.9*want || r.JobsPerSec > 1.1*want {
				t.Fatalf("%.2f jobs/s, offered %.2f", r.JobsPerSec, want)
			}
			if m == Central && r.Conflicts != 0 {
				t.Fatalf("central dispatcher had %d claim conflicts", r.Conflicts)
			}
			by := r.EtcdLoadBy
			if sum := by.Writes + by.Reads + by.WatchCreates + by.WatchEvents + by.KeepAlives; math.Abs(sum-r.EtcdLoad) > 1e-9*r.EtcdLoad {
				t.Fatalf("etcd load %v, its parts add up to %v", r.EtcdLoad, sum)
			}
			if m != Mesh && (r.PushedShare != 0 || r.GiveBacks != 0) {
				t.Fatalf("%v pushed %.2f of its tasks and gave %d back; only the mesh mode pushes", m, r.PushedShare, r.GiveBacks)
			}
			_, r2 := runSim(t, cfg)
			r.WallSeconds, r2.WallSeconds = 0, 0
			if r != r2 {
				t.Fatalf("same seed, different runs:\n%+v\n%+v", r, r2)
			}
			t.Logf("%+v", r)
		})
	}
}

// checkDrained checks that every job of a run completed exactly once,
// nothing was lost or made up, and every worker's slot and claim is back.
func checkDrained(t *testing.T, s *sim, r Result) {
	t.Helper()
	if r.Submitted == 0 || r.Completed != r.Submitted || r.Unfinished != 0 {
		t.Fatalf("submitted %d completed %d unfinished %d", r.Submitted, r.Completed, r.Unfinished)
	}
	if len(s.seen) != r.Submitted {
		t.Fatalf("%d distinct jobs completed, %d submitted", len(s.seen), r.Submitted)
	}
	for id, n := range s.seen {
		if n != 1 {
			t.Fatalf("job %d completed %d times", id, n)
		}
	}
	for _, st := range s.st {
		if st.free != len(st.workers) || len(st.waiting) != len(st.workers) || st.queued != 0 {
			t.Fatalf("stage %d not drained: free %d waiting %d queued %d of %d", st.i, st.free, len(st.waiting), st.queued, len(st.workers))
		}
		for _, l := range st.ledgers {
			if l.q.queued != 0 {
				t.Fatalf("stage %d: %d tasks still wait in %s's ledger", st.i, l.q.queued, l.name)
			}
		}
		for _, wk := range st.workers {
			if wk.slotDone != nil || wk.running != nil || wk.stopping {
				t.Fatalf("stage %d: worker %d still holds a slot in its slot clock, or a task", st.i, wk.idx)
			}
		}
		if len(st.heldBack) != 0 {
			t.Fatalf("stage %d: %d workers still held back by admission", st.i, len(st.heldBack))
		}
		for _, wk := range st.workers {
			if wk.committing != 0 || wk.fed != 0 || wk.held {
				t.Fatalf("stage %d: worker %d still counts %d commits and %d tasks it fed (held %v)", st.i, wk.idx, wk.committing, wk.fed, wk.held)
			}
		}
		if !s.central() && (st.viewFree != len(st.workers) || st.pushWaiting != 0 || st.committing != 0 || len(st.ready) != 0) {
			t.Fatalf("stage %d: claims left: %d of %d workers hold none, %d pushed waiting, %d committing, %d ready", st.i, st.viewFree, len(st.workers), st.pushWaiting, st.committing, len(st.ready))
		}
	}
}

// Preemption, in both designs: with the denoise pool busy with batch
// video, interactive work that has waited PreemptAfter makes a worker
// stop its batch task (routing's choice: QueuePolicy.Preempt on the mesh,
// Victims for the central dispatcher), which resumes later from its
// checkpoint. Ten GPUs of 6.9 s Wan denoise free a slot every 0.7 s or so,
// so the test waits 500 ms, not the default 2 s, to have tens of
// preemptions. Interactive jobs' queueing P99 then falls well below what
// it is with preemption off, every job still completes exactly once, and
// on the mesh every preemption costs etcd what the agent's does
// (checkMeshOps).
func TestPreemption(t *testing.T) {
	for _, m := range []Mode{Mesh, Central} {
		t.Run(m.String(), func(t *testing.T) {
			cfg := smallConfig(m)
			cfg.Model, cfg.GPUs = "wan2.1-t2v-1.3b", 16
			cfg.Pools = costmodel.Pools{Encode: 3, Denoise: 10, Decode: 3}
			cfg.Load, cfg.ClassMix = 1, [3]float64{0.2, 0, 0.8}
			cfg.Queue.PreemptAfter = 500 * time.Millisecond
			s, r := runSim(t, cfg)
			checkDrained(t, s, r)
			if m == Mesh {
				checkMeshOps(t, s, r)
			} else if want := 4*uint64(r.Completed) + 2*r.Preemptions; s.etcd.writes != want {
				t.Fatalf("%d writes, want %d: a job's 4 and a preemption's 2 (its checkpoint's record, its task back in the ledger)", s.etcd.writes, want)
			}
			off := cfg
			off.Queue.PreemptAfter = 0
			s0, r0 := runSim(t, off)
			checkDrained(t, s0, r0)
			if r.Preemptions < 10 || r0.Preemptions != 0 {
				t.Fatalf("%d preemptions with PreemptAfter %v, %d with it off", r.Preemptions, cfg.Queue.PreemptAfter, r0.Preemptions)
			}
			if with, without := r.QueueP99ByClassMs[0], r0.QueueP99ByClassMs[0]; with > 0.75*without {
				t.Fatalf("interactive queueing P99 %.0f ms with preemption, %.0f ms without", with, without)
			}
			t.Logf("%d preemptions (%.3f a job); interactive queueing P99 %.0f ms, %.0f ms with preemption off", r.Preemptions, r.PreemptionsPerJob, r.QueueP99ByClassMs[0], r0.QueueP99ByClassMs[0])
		})
	}
}

// Admission per worker, as the agent admits: at 2 encode, 13 denoise and 1
// decode GPU with a pool-wide slack of 1 and no share a producer (the
// agents' default before PerProducer), each denoise worker's share of the
// decode budget (one slot plus the slack) is one, so it is held back
// while its last latent waits or decodes, and the encoders' share of the
// denoise budget counts the denoise tasks they fed until those are done.
// No worker ever starts a task past its share, pushes that land on a held
// worker go back, and every job completes once; the default (two a
// producer) gives back fewer in all, and a fifth as many or fewer held.
func TestAdmissionPerWorker(t *testing.T) {
	cfg := smallConfig(Mesh)
	cfg.Model, cfg.GPUs = "wan2.1-t2v-1.3b", 16
	cfg.Pools = costmodel.Pools{Encode: 2, Denoise: 13, Decode: 1}
	cfg.ClassMix = [3]float64{0, 1, 0}
	tight := cfg
	tight.Admission = routing.Admission{Slack: 1}
	s, r := runSim(t, tight)
	checkDrained(t, s, r)
	checkMeshOps(t, s, r)
	if s.overQuota != 0 || r.HeldGiveBacks == 0 {
		t.Fatalf("slack 1 alone: %d tasks started past their worker's share, %d give-backs by held workers (want 0, some)", s.overQuota, r.HeldGiveBacks)
	}
	s2, r2 := runSim(t, cfg)
	checkDrained(t, s2, r2)
	if s2.overQuota != 0 || r2.HeldGiveBacks*5 > r.HeldGiveBacks || r2.GiveBacksPerJob >= r.GiveBacksPerJob {
		t.Fatalf("default admission: %d past their share, %d held give-backs (against %d), %.3f give-backs a job (against %.3f)", s2.overQuota, r2.HeldGiveBacks, r.HeldGiveBacks, r2.GiveBacksPerJob, r.GiveBacksPerJob)
	}
	t.Logf("slack 1 alone: %.3f give-backs a job (%d by held workers), queueing P50 %.0f ms; default (%+v): %.3f (%d), P50 %.0f ms",
		r.GiveBacksPerJob, r.HeldGiveBacks, r.QueueP50Ms, cfg.Admission, r2.GiveBacksPerJob, r2.HeldGiveBacks, r2.QueueP50Ms)
}

// Stealing (Config.Steal, a proposal the agent does not make yet): idle
// Wan workers at 300 GPUs take the claims busy encode and decode workers
// would start last, and the queueing P99 falls by more than 30% (39%
// with the dispatchers' own ledgers; more than half with one pooled
// queue), every job once, each steal one hand-over write.
func TestStealProposal(t *testing.T) {
	cfg := smallConfig(Mesh)
	cfg.Etcd = DefaultEtcdCosts()
	cfg.Model, cfg.GPUs, cfg.Duration = "wan2.1-t2v-1.3b", 300, 5*time.Minute
	s0, r0 := runSim(t, cfg)
	checkDrained(t, s0, r0)
	cfg.Steal = true
	s, r := runSim(t, cfg)
	checkDrained(t, s, r)
	checkMeshOps(t, s, r)
	if r0.Steals != 0 || r.Steals == 0 || r.QueueP99Ms > 0.7*r0.QueueP99Ms {
		t.Fatalf("%d steals, queueing P99 %.0f ms; without stealing %d, %.0f ms", r.Steals, r.QueueP99Ms, r0.Steals, r0.QueueP99Ms)
	}
	t.Logf("stealing: %.2f steals a job, queueing P50 / P99 %.0f / %.0f ms against %.0f / %.0f, %.2f writes a job against %.2f",
		float64(r.Steals)/float64(r.Completed), r.QueueP50Ms, r.QueueP99Ms, r0.QueueP50Ms, r0.QueueP99Ms, r.EtcdWritesPerJob, r0.EtcdWritesPerJob)
}

// A replayed trace (Config.Arrivals) is exactly the jobs of the run: as
// many, at their times, of their classes.
func TestArrivals(t *testing.T) {
	cfg := smallConfig(Mesh)
	cfg.Duration = time.Minute
	cfg.Arrivals = []Arrival{{At: 0, Class: routing.Batch}, {At: 10 * time.Second, Class: routing.Interactive}, {At: 10 * time.Second, Class: routing.Batch}, {At: 59 * time.Second, Class: routing.Standard}}
	s, r := runSim(t, cfg)
	checkDrained(t, s, r)
	if r.Submitted != 4 {
		t.Fatalf("%d jobs, want the trace's 4", r.Submitted)
	}
	if got := [3]uint64{s.queueingBy[0].n, s.queueingBy[1].n, s.queueingBy[2].n}; got != [3]uint64{1, 1, 2} {
		t.Fatalf("jobs by class %v, want [1 1 2]", got)
	}
	bad := cfg
	bad.Arrivals = []Arrival{{At: 2 * time.Minute}}
	if _, err := newSim(bad); err == nil {
		t.Fatal("an arrival past the duration was accepted")
	}
}

func runSim(t *testing.T, cfg Config) (*sim, Result) {
	t.Helper()
	s, err := newSim(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, s.run()
}

// The mesh's etcd ops per job are the agent's (docs/benchmarks.md, "What
// a job costs etcd"): waking workers reads nothing and opens no watch, a
// running task hears of a cancel from its inbox, and a dispatcher's ledger
// watches the prefix of the tasks its node creates from its start, and a
// result's holders follow its record by their markers, so the one watch a
// job makes is the client's long poll; every write is the submit, a commit
// per stage, a claim txn per task not started from a pushed claim and per conflict, and
// a give-back or hand-over per pushed claim returned (progress and idle agents write
// nothing); every read is the long poll's, the commit's read of its job
// record for a task a dispatcher handed on (a claim pushed by the
// transaction that wrote the record carries it) and a ticket check per
// pulled input claimed with a txn (the result's two holders take its
// record from their markers). Lease keepalives are counted on their own (TestKeepAlives).
func TestMeshEtcdOpsPerJob(t *testing.T) {
	for _, m := range []Mode{Mesh, MeshNoPush, MeshNoHints} {
		t.Run(m.String(), func(t *testing.T) {
			s, r := runSim(t, smallConfig(m))
			checkMeshOps(t, s, r)
		})
	}
}

// checkMeshOps checks a mesh run's etcd ops against what each step of a
// job costs (TestMeshEtcdOpsPerJob). A preemption restarts a task (one
// start more) and writes its checkpoint's record and its Yield; the
// dispatcher's hand-on of interactive work to a worker that gives way is
// a claim txn for a task its worker starts from its inbox (or gives back),
// whose ticket check and commit read as any handed-on task's do. A steal
// (Config.Steal) is one hand-over.
func checkMeshOps(t *testing.T, s *sim, r Result) {
	t.Helper()
	jobs := uint64(r.Completed)
	if s.etcd.watches != jobs {
		t.Fatalf("%d watches for %d jobs, want 1 per job (the long poll; the result's holders follow it by their markers)", s.etcd.watches, jobs)
	}
	var pushed, claimed uint64
	for i := range s.st {
		pushed += s.pushedStarts[i]
		claimed += s.claimedStarts[i]
	}
	if pushed+claimed != 3*jobs+r.Preemptions {
		t.Fatalf("%d tasks started from a push and %d from a claim, for %d jobs and %d preemptions", pushed, claimed, jobs, r.Preemptions)
	}
	if r.ClaimTxns != claimed+r.Conflicts+s.handOns+s.assignsBack {
		t.Fatalf("%d claim txns, want %d won + %d conflicts + %d hand-ons to a worker that gives way + %d against queue credit given back", r.ClaimTxns, claimed, r.Conflicts, s.handOns, s.assignsBack)
	}
	want := jobs*(1+3) + r.ClaimTxns + r.GiveBacks + 2*r.Preemptions + r.Steals
	if s.etcd.writes != want {
		t.Fatalf("%d writes, want %d (%d jobs, %d claim txns, %d give-backs, %d preemptions)", s.etcd.writes, want, jobs, r.ClaimTxns, r.GiveBacks, r.Preemptions)
	}
	// The client's read, a handed-on task's commit's read of its job
	// record, and its ticket check (the result's holders take its record
	// from their markers).
	// A run stopped before its commit reads nothing there.
	if want := jobs + claimed + s.claimedStarts[1] + s.claimedStarts[2] + 2*s.handOnStarts - s.stoppedClaimed; s.etcd.reads != want {
		t.Fatalf("%d reads, want %d", s.etcd.reads, want)
	}
}

// The central baseline pays what the mesh pays outside its claim loop:
// the client's submit is the job record's write and its long poll a watch
// and a read, as on the mesh; each stage's record is a write, as a mesh
// commit is, and the last one's ended key an event for that long poll; the
// Store keeps the result as on the mesh (its record in the decode's record
// write, an event for each of its two holders' markers); nothing else.
func TestCentralEtcdOpsPerJob(t *testing.T) {
	s, r := runSim(t, smallConfig(Central))
	jobs := uint64(r.Completed)
	e := s.etcd
	if e.writes != 4*jobs || e.reads != 1*jobs || e.watches != 1*jobs || e.events != 3*jobs {
		t.Fatalf("%d jobs: %d writes (want 4 a job), %d reads (1), %d watches (1), %d events (3)", jobs, e.writes, e.reads, e.watches, e.events)
	}
}

// Every agent renews its lease 0.3 times a second in both designs, and
// the renewals are keepalives, against their own capacity: no read, no
// write, and the same count and load whichever design dispatches.
func TestKeepAlives(t *testing.T) {
	var load float64
	for _, m := range []Mode{Mesh, Central} {
		cfg := smallConfig(m)
		cfg.Load = 0.02 // few jobs: the keepalives are most of the load
		cfg.Etcd = DefaultEtcdCosts()
		s, r := runSim(t, cfg)
		perAgentPerSec := float64(s.etcd.keepalives) / float64(r.GPUs) / r.Duration.Seconds()
		if perAgentPerSec < 0.299 || perAgentPerSec > 0.301 {
			t.Fatalf("%v: %.4f keepalives per agent per second, want 0.3", m, perAgentPerSec)
		}
		want := perAgentPerSec * float64(r.GPUs) / cfg.Etcd.KeepAliveCap
		if got := r.EtcdLoadBy.KeepAlives; math.Abs(got-want) > 1e-9 {
			t.Fatalf("%v: keepalive load %v, want %v (their rate over KeepAliveCap)", m, got, want)
		}
		if m == Mesh {
			load = r.EtcdLoadBy.KeepAlives
		} else if r.EtcdLoadBy.KeepAlives != load {
			t.Fatalf("keepalive load: central %v, mesh %v", r.EtcdLoadBy.KeepAlives, load)
		}
	}
}

// Pushed claims take the claim transaction out of a handoff. On an idle
// pool every task finds a free worker when it is created and is pushed to
// it: none costs a claim txn, none is raced for, none is given back; the
// same pool without pushes has every task handed on by its dispatcher
// with a txn, and nobody races for one, hints or none. Under load, a
// producer pushes against the slot a worker granted it alone, or to a busy
// short-stage worker's queue credit, and gossip, a round late, sends a few
// pushes where they wait too long and are given back; every pushed task
// started is a claim txn saved.
func TestPushedClaims(t *testing.T) {
	idle := func(m Mode) Config {
		c := smallConfig(m)
		c.Load = 0.02
		c.GossipDelay = 0 // gossip shows who is free: a push never meets a busy worker
		return c
	}
	s, r := runSim(t, idle(Mesh))
	jobs := uint64(r.Completed)
	if jobs < 100 {
		t.Fatalf("only %d jobs", jobs)
	}
	var pushed uint64
	for i := range s.st {
		pushed += s.pushedStarts[i]
	}
	// A task created while its stage's only encoder or decoder runs
	// another is queued; it costs one claim txn and no race.
	if r.Conflicts != 0 || r.GiveBacks != 0 || pushed != s.pushes || r.ClaimTxns != 3*jobs-pushed || r.PushedShare < 0.99 {
		t.Fatalf("idle pool, pushes: %d of %d tasks pushed, %d started so, %d claim txns, %d conflicts, %d give-backs",
			s.pushes, 3*jobs, pushed, r.ClaimTxns, r.Conflicts, r.GiveBacks)
	}
	_, np := runSim(t, idle(MeshNoPush))
	if np.ClaimTxns < 3*uint64(np.Completed) || np.PushedShare != 0 {
		t.Fatalf("idle pool, no pushes: %d claim txns for %d jobs, pushed %.2f", np.ClaimTxns, np.Completed, np.PushedShare)
	}
	// Without hints nobody races either: a waiting task's dispatcher hands
	// it to one worker (it used to be a herd's race, 10 lost claims a job).
	if _, nh := runSim(t, idle(MeshNoHints)); nh.Conflicts != 0 || nh.Completed < 100 {
		t.Fatalf("idle pool, no hints: %d conflicts over %d jobs, want none", nh.Conflicts, nh.Completed)
	}

	_, push := runSim(t, smallConfig(Mesh))
	_, noPush := runSim(t, smallConfig(MeshNoPush))
	t.Logf("loaded: pushes %.2f claim txns/job, %.2f conflicts/job, %.2f pushed, %.2f give-backs/job; no pushes %.2f claim txns/job, %.2f conflicts/job",
		push.ClaimTxnsPerJob, push.ConflictsPerJob, push.PushedShare, push.GiveBacksPerJob, noPush.ClaimTxnsPerJob, noPush.ConflictsPerJob)
	// One encoder and one decoder among 100 GPUs: their tasks go to their
	// queue credit while they are busy (0 claim txns a job, from 1.7 when
	// a task waited for a grant and a hand-on instead).
	if push.PushedShare < 0.95 || push.ClaimTxnsPerJob > 0.1 || push.GiveBacksPerJob > 0.1 || push.Conflicts != 0 || noPush.Conflicts != 0 {
		t.Fatalf("loaded pool: pushes %.2f claim txns/job and %.2f conflicts/job (%.2f of tasks pushed), no pushes %.2f and %.2f",
			push.ClaimTxnsPerJob, push.ConflictsPerJob, push.PushedShare, noPush.ClaimTxnsPerJob, noPush.ConflictsPerJob)
	}
}

// A slot is granted to one producer at a time, and producers push against
// their grants before gossip's free slots, which every producer sees
// alike: at 3,000 GPUs (10 encoders feeding 2,985 denoisers) a push to a
// granted stage (denoise, decode) hardly ever meets a worker another
// producer filled. Before, with a freed slot granted to two producers and
// gossip's free slots used beside the grants, a third of the denoise
// pushes did: 0.48 give-backs a job. The encode tasks are the submits'
// pushes, by gossip alone: what goes back there is admission's (an
// encoder whose share of the denoise budget is full, counted with the
// denoise tasks it fed that still run), not the grants'.
func TestGrantedPushesMeetFreeSlots(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GPUs, cfg.Duration = 3000, time.Minute
	s, r := runSim(t, cfg)
	n := float64(r.Completed)
	by := func(st int) float64 { return float64(r.GiveBacksByStage[st]) / n }
	granted := by(1) + by(2)
	claimed := float64(s.claimedStarts[1]+s.claimedStarts[2]) / n
	pushed := float64(s.pushedStarts[1]+s.pushedStarts[2]) / float64(s.pushedStarts[1]+s.pushedStarts[2]+s.claimedStarts[1]+s.claimedStarts[2])
	t.Logf("%d jobs on %+v: %.3f give-backs a job (encode %.3f, denoise %.3f, decode %.3f), %.3f claim txns a job, %.2f of tasks pushed",
		r.Completed, s.plan.Pools, r.GiveBacksPerJob, by(0), by(1), by(2), r.ClaimTxnsPerJob, r.PushedShare)
	if granted > 0.05 || claimed > 0.05 || pushed < 0.98 {
		t.Fatalf("denoise and decode: %.3f give-backs and %.3f claimed starts a job, %.2f of tasks pushed; want at most 0.05, 0.05 and at least 0.98", granted, claimed, pushed)
	}
}

// A mesh of a real fleet's shape whose jobs' texts are all cached (bench
// control's): no encode task runs, every job completes once, and a job
// costs the submit and two commits, and per stage its inbox's and its
// ledger's events, the payload release of the latent alone (the cached
// entry is no payload), the ended key and the result's two holders.
func TestCondCachedPools(t *testing.T) {
	for _, m := range []Mode{Mesh, Central} {
		t.Run(m.String(), func(t *testing.T) {
			cfg := smallConfig(m)
			cfg.GPUs, cfg.Pools, cfg.CondCached, cfg.Load = 6, costmodel.Pools{Encode: 1, Denoise: 4, Decode: 1}, true, 0.3
			s, r := runSim(t, cfg)
			if r.Completed == 0 || r.Completed != r.Submitted || r.Pools != cfg.Pools {
				t.Fatalf("completed %d of %d on pools %s", r.Completed, r.Submitted, r.Pools)
			}
			if n := s.pushedStarts[0] + s.claimedStarts[0]; n != 0 {
				t.Errorf("%d encode tasks started, want none", n)
			}
			jobs := uint64(r.Completed)
			t.Logf("%d jobs: %.2f writes, %.2f events a job; %d claim txns, %d give-backs", jobs, r.EtcdWritesPerJob, r.EtcdEventsPerJob, r.ClaimTxns, r.GiveBacks)
			if m == Central {
				if s.etcd.writes != 3*jobs || s.etcd.events != 3*jobs {
					t.Errorf("%d writes and %d events for %d jobs, want 3 and 3 a job", s.etcd.writes, s.etcd.events, jobs)
				}
				return
			}
			if want := 3*jobs + r.ClaimTxns + r.GiveBacks; s.etcd.writes != want {
				t.Errorf("%d writes, want %d (%d jobs, %d claim txns, %d give-backs)", s.etcd.writes, want, jobs, r.ClaimTxns, r.GiveBacks)
			}
			if r.ClaimTxns == 0 && r.GiveBacks == 0 && s.etcd.events != 10*jobs {
				t.Errorf("%d events for %d jobs, every task pushed: want 10 a job", s.etcd.events, jobs)
			}
		})
	}
}

// Offered claims (agent/jobs offer.go): a pushed task starts one message
// after its writer's commit goes, not once the commit and its watch event
// land, so on an etcd stretched by its load the dispatch overhead no
// longer pays them; what etcd is sent is the same, and every job still
// completes once.
func TestOffersTakeEtcdOffTheHandoff(t *testing.T) {
	cfg := smallConfig(Mesh)
	cfg.Etcd.WriteLatency, cfg.Etcd.WatchDelay = 10*time.Millisecond, 10*time.Millisecond // a loaded etcd
	_, on := runSim(t, cfg)
	cfg.Queue.Offer = false
	_, off := runSim(t, cfg)
	t.Logf("dispatch overhead P50 %.1f ms with offers, %.1f without; mean %.1f and %.1f", on.DispatchOverheadP50Ms, off.DispatchOverheadP50Ms, on.DispatchOverheadMs, off.DispatchOverheadMs)
	if on.Completed != on.Submitted || off.Completed != off.Submitted {
		t.Fatalf("completed %d of %d with offers, %d of %d without", on.Completed, on.Submitted, off.Completed, off.Submitted)
	}
	// Without offers each of three handoffs waits a write and a watch
	// delivery: 60 ms; with them, a message each.
	if off.DispatchOverheadP50Ms < 40 || on.DispatchOverheadP50Ms > 5 {
		t.Fatalf("dispatch overhead P50 %.1f ms with offers, %.1f without: want under 5 and over 40", on.DispatchOverheadP50Ms, off.DispatchOverheadP50Ms)
	}
	if math.Abs(on.EtcdWritesPerJob-off.EtcdWritesPerJob) > 0.05 || math.Abs(on.EtcdEventsPerJob-off.EtcdEventsPerJob) > 0.1 {
		t.Fatalf("etcd per job: %.2f writes and %.2f events with offers, %.2f and %.2f without", on.EtcdWritesPerJob, on.EtcdEventsPerJob, off.EtcdWritesPerJob, off.EtcdEventsPerJob)
	}
}
