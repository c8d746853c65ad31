// Package sim is `latentmesh-dev sim`: a discrete-event simulation of the mesh's
// control plane at cluster sizes the testbed cannot reach (1,000 and 10,000
// GPUs), against a central-dispatcher baseline. It runs the same routing
// code as the agent: the queue order (routing.QueuePolicy.Order), a
// worker's turn over the claims pushed to it (QueuePolicy.Pick, Returns),
// preemption (QueuePolicy.Preempt on a mesh worker, Victims for the
// central dispatcher), admission (routing.Admission.Share, Admit:
// each worker on its own share and its own count, as agent.admit), hints
// (routing.PickHint) and slot clocks (routing.SlotBook), on modelled
// etcd latency and capacity, gossip delay and transfer bandwidth, with
// stage costs from testbed/costmodel, and counts the etcd operations a job
// costs as agent/worker.go, agent/execute.go, agent/push.go and agent/jobs
// issue them. When each decision is taken (a wake, a grant, a look over
// the inbox) it models. MeasureEtcd measures the etcd figures on this
// machine (embedded etcd), so the model's capacity is not a guess. Only
// cmd/latentmesh-dev uses it.
package sim

import (
	"errors"
	"fmt"
	"time"

	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
)

// Arrival is one job of a replayed trace (Config.Arrivals).
type Arrival struct {
	At    time.Duration // from the run's start
	Class routing.Class
}

// Mode is the control plane being simulated.
type Mode int

// Modes.
const (
	// Mesh: agents pull from per-stage queues in etcd with fenced claims.
	// A task's creator (the submit, or the previous stage's commit) hints
	// the next stage's worker (routing.PickHint) and, when
	// Config.Queue.Push is set (routing's default) and that worker has a
	// free slot, writes the worker's claim in the same transaction (a
	// pushed claim): the worker starts it with no claim transaction, and
	// gives it back (routing.QueuePolicy.GiveBack) when it cannot start it.
	Mesh Mode = iota
	// MeshNoPush: Mesh with Queue.Push off (the agent's --no-push): tasks
	// are hinted, and every worker claims its own, the hinted one first,
	// others after the steal grace.
	MeshNoPush
	// MeshNoHints: neither hints nor pushes, so every idle worker woken by
	// a task races for it (the claim-conflict worst case).
	MeshNoHints
	// Central: one dispatcher assigns tasks to free GPUs; no claims.
	Central
)

func (m Mode) String() string {
	switch m {
	case Mesh:
		return "mesh"
	case MeshNoPush:
		return "mesh-nopush"
	case MeshNoHints:
		return "mesh-nohints"
	case Central:
		return "central"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// ParseMode reads a mode by its String.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes() {
		if m.String() == s {
			return m, nil
		}
	}
	return 0, fmt.Errorf("sim: unknown mode %q (want mesh, mesh-nopush, mesh-nohints or central)", s)
}

// Modes lists every mode, in the order reports show them.
func Modes() []Mode { return []Mode{Mesh, MeshNoPush, MeshNoHints, Central} }

// EtcdCosts is the etcd model: latencies of an idle etcd and the rates at
// which it saturates, per kind of operation.
type EtcdCosts struct {
	WriteLatency time.Duration `json:"write_latency"` // one write txn through raft, idle etcd
	ReadLatency  time.Duration `json:"read_latency"`  // one linearizable read of a job record, idle etcd
	WatchDelay   time.Duration `json:"watch_delay"`   // a put until a watcher receives it
	// The rates one etcd sustains, each measured alone; the model's load is
	// the sum of each kind's ops/s over its rate (1 = saturated).
	WriteCap       float64 `json:"write_txns_per_s"`
	ReadCap        float64 `json:"read_txns_per_s"`
	WatchCreateCap float64 `json:"watch_creates_per_s"`
	EventCap       float64 `json:"watch_events_per_s"`
	// KeepAliveCap is lease renewals a second (LeaseKeepAlive requests on
	// long-lived streams, as every agent renews its lease): the leader
	// answers them from its lessor, no raft proposal, so they are an op
	// kind of their own, not reads.
	KeepAliveCap float64 `json:"keepalives_per_s"`
	// Source says where the figures come from.
	Source string `json:"source"`
}

// DefaultEtcdCosts are figures measured on the development machine
// (2 shared cores, embedded etcd, `latentmesh-dev sim --measure-etcd`), for runs
// that do not measure again. The keepalive capacity was measured later, on
// the same machine busier and noisier (its write capacity then 1,200 to
// 4,900/s): it is the same-run ratio to the write capacity, whose median
// was 10, times the write capacity recorded here. The reads likewise: they
// were first measured as a queue listing (64 task records and their claim
// keys in one txn: 610/s, 0.46 ms idle), a read nothing makes any more;
// a read of one job record, which is every read a job costs now, does
// 1.42x to 2.18x the write capacity in the same run (median 1.92 over 7
// runs, when the machine did 6,900 to 9,900 writes/s) and takes 0.35x a
// write's idle latency.
func DefaultEtcdCosts() EtcdCosts {
	return EtcdCosts{
		WriteLatency:   800 * time.Microsecond,
		ReadLatency:    280 * time.Microsecond,
		WatchDelay:     1000 * time.Microsecond,
		WriteCap:       960,
		ReadCap:        1840, // 1.92x WriteCap: one job record a read
		WatchCreateCap: 1830,
		EventCap:       25700,
		KeepAliveCap:   9600, // 10x WriteCap: the median ratio over 17 runs here (5x to 22x, 7,500 to 52,000/s)
		Source:         "defaults, measured on the development machine (2 shared cores)",
	}
}

// Etcd profiles, by the names `latentmesh-dev sim --etcd-profile` takes.
const (
	// ProfileLocal is the etcd measured on this machine: DefaultEtcdCosts,
	// or MeasureEtcd's figures.
	ProfileLocal = "local"
	// ProfileDedicated is a dedicated etcd cluster with DedicatedScale
	// times every capacity of the local one and its idle latencies.
	ProfileDedicated = "dedicated"
)

// DedicatedScale is how many times the local etcd's capacities the
// dedicated profile has, an assumption: etcd's performance guide has a
// three-member cluster on cloud VMs doing "more than 30,000 requests per
// second under heavy load", of small requests, 30 times the 960
// claim-shaped write txns and 16 times the 1,840 one-record reads a second
// one etcd does on these 2 shared cores; 10x stays below that for larger
// txns.
const DedicatedScale = 10

// EtcdProfile is local as the named profile would serve: ProfileLocal is
// local itself; ProfileDedicated multiplies every capacity by
// DedicatedScale and keeps local's idle latencies, which are under a
// millisecond, as the guide has a three-member cluster finishing "a
// request in less than one millisecond under light load".
func EtcdProfile(name string, local EtcdCosts) (EtcdCosts, error) {
	switch name {
	case ProfileLocal:
		return local, nil
	case ProfileDedicated:
		d := local
		d.WriteCap *= DedicatedScale
		d.ReadCap *= DedicatedScale
		d.WatchCreateCap *= DedicatedScale
		d.EventCap *= DedicatedScale
		d.KeepAliveCap *= DedicatedScale
		d.Source = fmt.Sprintf("dedicated profile: %dx the capacities of %s, the same idle latencies", DedicatedScale, local.Source)
		return d, nil
	}
	return EtcdCosts{}, fmt.Errorf("sim: unknown etcd profile %q (want %s or %s)", name, ProfileLocal, ProfileDedicated)
}

func (e EtcdCosts) check() error {
	if e.WriteLatency <= 0 || e.ReadLatency <= 0 || e.WatchDelay <= 0 {
		return errors.New("sim: etcd latencies must be positive")
	}
	if !(e.WriteCap > 0 && e.ReadCap > 0 && e.WatchCreateCap > 0 && e.EventCap > 0 && e.KeepAliveCap > 0) {
		return errors.New("sim: etcd capacities must be positive")
	}
	return nil
}

// Config is one simulated run.
type Config struct {
	Mode  Mode
	Model string // a costmodel model
	GPUs  int    // split into encode:denoise:decode pools by costmodel.PlanPools
	// Pools, if set, are the pools instead (GPUs must be their sum): a
	// real mesh's shape, to compare counts with (testbed's bench control).
	Pools costmodel.Pools
	// CondCached has every job's texts in the conditioning cache: a job
	// has no encode task (the submit queues its denoise task, whose input
	// is the cache's entry, never released), as every job after the first
	// of a repeated prompt on a real mesh.
	CondCached bool
	// Duration is how long jobs arrive; the run then drains every job.
	Duration time.Duration
	// Load is the arrival rate as a fraction of the pools' capacity.
	Load float64
	Seed uint64
	// ClassMix is the share of interactive, standard and batch jobs.
	ClassMix [3]float64
	// Arrivals, when set, are the jobs instead of Poisson arrivals at
	// Load with ClassMix: a replayed trace (bench serve's, `sim --trace`),
	// sorted by time, all within Duration.
	Arrivals []Arrival

	// Queue is the agents' queue policy. Its Push applies in Mesh mode
	// only: the other modes never push.
	Queue     routing.QueuePolicy
	Admission routing.Admission
	Etcd      EtcdCosts

	// GossipDelay is how old a peer's free credits are when another agent
	// reads them (memberlist meta spreads in a few gossip rounds).
	GossipDelay time.Duration
	// NetDelay is one way between any two nodes.
	NetDelay time.Duration
	// Bandwidth is one pull's rate, bytes/s.
	Bandwidth float64
	// ScanPerClass bounds the unclaimed tasks a scan hands to
	// routing.QueuePolicy.Order, per class. The agent orders its whole
	// queue view (jobs.Queue); Order ranks by class, then age within a
	// class, so its first choices are among each class's oldest tasks and
	// this bound changes no choice a herd smaller than it makes (a scan by
	// w waking workers takes the oldest min(ScanPerClass, w) of each class).
	// It keeps a scan of a long backlog cheap for the simulator.
	ScanPerClass int
	// DispatchCost is the central dispatcher's time per decision (an
	// assignment or a completion); it handles one at a time.
	DispatchCost time.Duration
	// CheckJobs keeps a per-job record to check that every job completes
	// exactly once (tests; costs memory at 10,000 GPUs).
	CheckJobs bool
	// Steal (mesh): idle workers take claims pushed to busy peers
	// (steal.go). A proposal the agent does not make yet, to measure.
	Steal bool
}

// DefaultConfig is FLUX.1-dev (the shortest stages of the shipped models,
// so the most control-plane work per GPU-second) at 80% of capacity for one
// hour on the mesh.
func DefaultConfig() Config {
	return Config{
		Mode:         Mesh,
		Model:        "flux.1-dev",
		GPUs:         1000,
		Duration:     time.Hour,
		Load:         0.8,                       // busy but not saturated: queues stay short
		Seed:         1,                         // runs are deterministic per seed
		ClassMix:     [3]float64{0.3, 0.5, 0.2}, // mostly people waiting, some batch
		Queue:        routing.DefaultQueuePolicy(),
		Admission:    routing.DefaultAdmission(),
		Etcd:         DefaultEtcdCosts(),
		GossipDelay:  500 * time.Millisecond, // memberlist: 200 ms rounds, a few to spread
		NetDelay:     100 * time.Microsecond, // one datacentre
		Bandwidth:    12.5e9,                 // 100 Gbit/s per pull
		ScanPerClass: 256,                    // more than any herd below 30,000 GPUs races for
		DispatchCost: 50 * time.Microsecond,  // an in-memory decision plus its log line
		CheckJobs:    false,
	}
}

func (c Config) check() error {
	if c.GPUs < 3 {
		return fmt.Errorf("sim: %d GPUs: need at least one per stage", c.GPUs)
	}
	if p := c.Pools; p != (costmodel.Pools{}) && (p.Encode < 1 || p.Denoise < 1 || p.Decode < 1 || p.Encode+p.Denoise+p.Decode != c.GPUs) {
		return fmt.Errorf("sim: pools %s: want at least one GPU a stage, %d in all", p, c.GPUs)
	}
	if c.Duration <= 0 || !(c.Load > 0) {
		return errors.New("sim: duration and load must be positive")
	}
	if c.Bandwidth <= 0 || c.ScanPerClass <= 0 || c.DispatchCost <= 0 || c.GossipDelay < 0 || c.NetDelay < 0 {
		return errors.New("sim: bandwidth, scan bound and dispatch cost must be positive")
	}
	for i, a := range c.Arrivals {
		if a.At < 0 || a.At >= c.Duration || i > 0 && a.At < c.Arrivals[i-1].At || !a.Class.Valid() {
			return fmt.Errorf("sim: arrival %d at %v (%v): want them sorted, within the duration %v", i, a.At, a.Class, c.Duration)
		}
	}
	sum := 0.0
	for _, f := range c.ClassMix {
		if f < 0 {
			return errors.New("sim: class shares must not be negative")
		}
		sum += f
	}
	if !(sum > 0) {
		return errors.New("sim: class mix is empty")
	}
	return c.Etcd.check()
}
