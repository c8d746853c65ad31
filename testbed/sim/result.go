package sim

import (
	"time"

	"github.com/latentmesh/latentmesh/testbed/costmodel"
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
	// has it: the offer's message (mesh with Queue.Offer), or commit and
	// claim latency and watch delay (without), scans, lost claim races,
	// held-back hints, pushes waiting on a busy worker until given back
	// (mesh); messages and decisions (central).
	DispatchOverheadMs float64 `json:"dispatch_overhead_ms"`
	// DispatchOverheadP50Ms is the median job's dispatch overhead, as
	// DispatchOverheadMs sums it: most jobs pay the commits' and watches'
	// latency alone, and the mean is the tail's (a task given back waits
	// out the steal grace and a gossip round).
	DispatchOverheadP50Ms float64 `json:"dispatch_overhead_p50_ms"`
	// ClaimTxns counts the claim transactions workers sent (TryClaim, won
	// or lost); Conflicts the lost ones (ErrTaken).
	ClaimTxns       uint64  `json:"claim_txns"`
	ClaimTxnsPerJob float64 `json:"claim_txns_per_job"`
	Conflicts       uint64  `json:"claim_conflicts"`
	ConflictsPerJob float64 `json:"claim_conflicts_per_job"`
	// PushedShare is the share of tasks started from a claim pushed with
	// them (no claim transaction); GiveBacks counts pushed claims their
	// worker gave back to their dispatcher (routing.QueuePolicy.GiveBack).
	PushedShare     float64 `json:"pushed_share"`
	GiveBacks       uint64  `json:"give_backs"`
	GiveBacksPerJob float64 `json:"give_backs_per_job"`
	// GiveBacksByStage splits GiveBacks by stage (encode, denoise,
	// decode); HeldGiveBacks counts those whose worker admission held
	// back (its share of the next stage's budget was full), the rest were
	// busy.
	GiveBacksByStage [3]uint64 `json:"give_backs_by_stage"`
	HeldGiveBacks    uint64    `json:"held_give_backs"`
	// Preemptions counts the batch denoise tasks stopped for interactive
	// work (routing.QueuePolicy.Preempt, Victims), each resumed later
	// from the checkpoint it stopped at.
	Preemptions       uint64  `json:"preemptions"`
	PreemptionsPerJob float64 `json:"preemptions_per_job"`
	// Steals counts the claims idle workers took from busy ones
	// (Config.Steal, a proposal; 0 otherwise).
	Steals uint64 `json:"steals,omitempty"`
	// QueueCreditHandOns counts the waiting tasks dispatchers handed to
	// busy workers against their queue credit (routing.GrantQueue), each
	// one claim txn.
	QueueCreditHandOns uint64 `json:"queue_credit_hand_ons"`
	// GrantMessagesPerJob is the credit grants workers sent
	// (libp2p messages, no etcd op), per job.
	GrantMessagesPerJob float64 `json:"grant_messages_per_job"`

	EtcdWritesPerJob  float64 `json:"etcd_writes_per_job"`
	EtcdReadsPerJob   float64 `json:"etcd_reads_per_job"`
	EtcdWatchesPerJob float64 `json:"etcd_watch_creates_per_job"`
	EtcdEventsPerJob  float64 `json:"etcd_watch_events_per_job"`
	EtcdOpsPerJob     float64 `json:"etcd_ops_per_job"` // writes + reads + watch creations
	EtcdOpsPerSec     float64 `json:"etcd_ops_per_s"`   // the same, per second
	EtcdEventsPerSec  float64 `json:"etcd_watch_events_per_s"`
	// EtcdKeepAlivesPerSec is the agents' lease renewals, which no job
	// causes: not in the ops above, in the load below.
	EtcdKeepAlivesPerSec float64 `json:"etcd_keepalives_per_s"`
	// EtcdLoad is the mean share of one etcd's measured capacity used while
	// jobs arrived (1 = saturated), summed over the kinds of operation in
	// EtcdLoadBy, the same way in every mode; EtcdPeakLoad the busiest
	// second.
	EtcdLoad     float64       `json:"etcd_load"`
	EtcdLoadBy   EtcdLoadParts `json:"etcd_load_by"`
	EtcdPeakLoad float64       `json:"etcd_peak_load"`
	// DispatcherLoad is the central dispatcher's busy share while jobs
	// arrived, as EtcdLoad is (central only; 1 = saturated).
	DispatcherLoad float64 `json:"dispatcher_load,omitempty"`

	Utilisation float64 `json:"gpu_utilisation"` // compute time / GPU time while jobs arrived
	QueueP50Ms  float64 `json:"queue_p50_ms"`    // per job, summed over stages
	QueueP99Ms  float64 `json:"queue_p99_ms"`
	// By class (interactive, standard, batch): the priority order serves
	// the classes unalike, and preemption serves interactive work.
	QueueP50ByClassMs [3]float64 `json:"queue_p50_by_class_ms"`
	QueueP99ByClassMs [3]float64 `json:"queue_p99_by_class_ms"`

	SimSeconds  float64 `json:"sim_s"` // simulated time including the drain
	Events      uint64  `json:"events"`
	WallSeconds float64 `json:"wall_s"`
}

// EtcdLoadParts is a run's mean etcd load by kind of operation: each
// kind's ops a second over its capacity.
type EtcdLoadParts struct {
	Writes       float64 `json:"writes"`
	Reads        float64 `json:"reads"`
	WatchCreates float64 `json:"watch_creates"`
	WatchEvents  float64 `json:"watch_events"`
	KeepAlives   float64 `json:"keepalives"`
}

func (s *sim) result(wall time.Duration) Result {
	cfg := s.cfg
	r := Result{
		Mode: cfg.Mode.String(), Model: cfg.Model, GPUs: cfg.GPUs, Pools: s.plan.Pools,
		Duration: cfg.Duration, Load: cfg.Load, Seed: cfg.Seed,
		Submitted: s.submitted, Completed: s.completed, Unfinished: s.submitted - s.completed,
		JobsPerSec: float64(s.completedInWindow) / cfg.Duration.Seconds(),
		ClaimTxns:  s.claimTxns, Conflicts: s.conflicts, GiveBacks: s.giveBacks,
		GiveBacksByStage: s.giveBacksBy, HeldGiveBacks: s.heldGiveBacks, Preemptions: s.preemptions, Steals: s.steals, QueueCreditHandOns: s.assigns,
		SimSeconds: s.clk.now.Seconds(), Events: s.clk.count, WallSeconds: wall.Seconds(),
		Utilisation: s.busy.Seconds() / (float64(cfg.GPUs) * cfg.Duration.Seconds()),
		QueueP50Ms:  ms(s.queueing.quantile(0.50)),
		QueueP99Ms:  ms(s.queueing.quantile(0.99)),
	}
	for c := range s.queueingBy {
		r.QueueP50ByClassMs[c] = ms(s.queueingBy[c].quantile(0.50))
		r.QueueP99ByClassMs[c] = ms(s.queueingBy[c].quantile(0.99))
	}
	if n := float64(s.completed); n > 0 {
		r.DispatchOverheadMs = ms(s.overhead) / n
		r.DispatchOverheadP50Ms = ms(s.overheads.quantile(0.50))
		r.ClaimTxnsPerJob = float64(s.claimTxns) / n
		r.ConflictsPerJob = float64(s.conflicts) / n
		r.GiveBacksPerJob = float64(s.giveBacks) / n
		r.PreemptionsPerJob = float64(s.preemptions) / n
		r.GrantMessagesPerJob = float64(s.grantMsgs) / n
		r.EtcdWritesPerJob = float64(s.etcd.writes) / n
		r.EtcdReadsPerJob = float64(s.etcd.reads) / n
		r.EtcdWatchesPerJob = float64(s.etcd.watches) / n
		r.EtcdEventsPerJob = float64(s.etcd.events) / n
		r.EtcdOpsPerJob = r.EtcdWritesPerJob + r.EtcdReadsPerJob + r.EtcdWatchesPerJob
	}
	var pushed, started uint64
	for i := range s.st {
		pushed += s.pushedStarts[i]
		started += s.pushedStarts[i] + s.claimedStarts[i]
	}
	if started > 0 {
		r.PushedShare = float64(pushed) / float64(started)
	}
	secs := cfg.Duration.Seconds()
	r.EtcdOpsPerSec = float64(s.snap.writes+s.snap.reads+s.snap.watches) / secs
	r.EtcdEventsPerSec = float64(s.snap.events) / secs
	r.EtcdKeepAlivesPerSec = float64(s.snap.keepalives) / secs
	r.EtcdLoad = s.snap.totalLoad / secs
	e := cfg.Etcd
	r.EtcdLoadBy = EtcdLoadParts{
		Writes:       float64(s.snap.writes) / e.WriteCap / secs,
		Reads:        float64(s.snap.reads) / e.ReadCap / secs,
		WatchCreates: float64(s.snap.watches) / e.WatchCreateCap / secs,
		WatchEvents:  float64(s.snap.events) / e.EventCap / secs,
		KeepAlives:   float64(s.snap.keepalives) / e.KeepAliveCap / secs,
	}
	r.EtcdPeakLoad = s.snap.peakLoad
	if s.central() {
		r.DispatcherLoad = s.snapDispBusy.Seconds() / secs
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
