package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// FaultKind names one kind of fault a chaos run injects.
type FaultKind string

// The faults of a chaos run. Each is undone after a random while.
const (
	FaultKill       FaultKind = "kill"             // kill -9 an agent; start it again under the same node id
	FaultPause      FaultKind = "pause"            // SIGSTOP an agent, then SIGCONT
	FaultPartition  FaultKind = "partition"        // drop every packet of an agent's host, then heal
	FaultShape      FaultKind = "shape"            // slow an agent's host's link, then unshape
	FaultEtcdKill   FaultKind = "etcd_kill"        // kill -9 an etcd member, then restart it
	FaultEtcdLeader FaultKind = "etcd_leader_kill" // kill -9 the etcd leader, then restart it
)

// FaultKinds lists every fault kind.
func FaultKinds() []FaultKind {
	return []FaultKind{FaultKill, FaultPause, FaultPartition, FaultShape, FaultEtcdKill, FaultEtcdLeader}
}

// takesDown reports whether a fault makes its agent unable to work (a
// shaped link only slows it).
func (k FaultKind) takesDown() bool { return k == FaultKill || k == FaultPause || k == FaultPartition }

// faultTimes bound how long each fault lasts before it is undone.
var faultTimes = map[FaultKind][2]time.Duration{
	FaultKill:       {time.Second, 6 * time.Second},
	FaultPause:      {500 * time.Millisecond, 5 * time.Second}, // past the 2 s lease TTL about two times in three
	FaultPartition:  {time.Second, 8 * time.Second},
	FaultShape:      {2 * time.Second, 10 * time.Second},
	FaultEtcdKill:   {time.Second, 6 * time.Second},
	FaultEtcdLeader: {time.Second, 6 * time.Second},
}

// shapeRates are the link rates a shaped host gets.
var shapeRates = []string{"1mbit", "8mbit", "50mbit"}

// injector injects random faults, seeded, under two rules: at most one
// etcd member is down at a time (the cluster keeps its quorum), and an
// agent is taken down only while every role keeps another agent up, so
// the load can always complete. One fault holds an agent at a time.
type injector struct {
	agents []*HostAgent
	etcd   *EtcdCluster
	rng    *rand.Rand // owned by the run loop
	every  time.Duration
	log    io.Writer
	start  time.Time

	// stop ends every fault early (they are undone at once).
	stop chan struct{}
	wg   sync.WaitGroup

	mu sync.Mutex
	// mu guards the fields below.
	busy     map[int]FaultKind // agents held by a fault
	etcdBusy bool
	counts   map[FaultKind]int
	n        int
	errs     []error
}

func newInjector(agents []*HostAgent, etcd *EtcdCluster, seed int64, every time.Duration, log io.Writer, start time.Time) *injector {
	return &injector{
		agents: agents, etcd: etcd, every: every, log: log, start: start,
		rng:  rand.New(rand.NewPCG(uint64(seed), 0x6c6d6368616f73)), // "lmchaos"
		stop: make(chan struct{}), busy: map[int]FaultKind{}, counts: map[FaultKind]int{},
	}
}

func (in *injector) logf(format string, a ...any) {
	fmt.Fprintf(in.log, "chaos %6.1fs  "+format+"\n", append([]any{time.Since(in.start).Seconds()}, a...)...)
}

// between is a uniform random duration in [lo, hi].
func (in *injector) between(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(in.rng.Int64N(int64(hi-lo)+1))
}

// run injects faults until ctx is done, then undoes every fault still in
// force and waits for them to be undone.
func (in *injector) run(ctx context.Context) {
	defer func() {
		close(in.stop)
		in.wg.Wait()
	}()
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(in.between(in.every/2, in.every*3/2)):
		}
		in.injectOne()
	}
}

// candidates lists the agents a fault of kind k may take now.
func (in *injector) candidatesLocked(k FaultKind) []int {
	var out []int
	for i, a := range in.agents {
		if _, held := in.busy[i]; held {
			continue
		}
		if k.takesDown() && !in.rolesSurviveLocked(i) {
			continue
		}
		if !a.Running() {
			continue
		}
		out = append(out, i)
	}
	return out
}

// rolesSurviveLocked reports whether every role keeps an agent up when
// agent i goes down too.
func (in *injector) rolesSurviveLocked(i int) bool {
	for _, role := range in.agents[i].Roles() {
		up := 0
		for j, a := range in.agents {
			if j == i {
				continue
			}
			if k, held := in.busy[j]; held && k.takesDown() {
				continue
			}
			if slices.Contains(a.Roles(), role) {
				up++
			}
		}
		if up == 0 {
			return false
		}
	}
	return true
}

// injectOne picks a fault kind at random among those possible now, and a
// target, starts the fault and schedules its undoing.
func (in *injector) injectOne() {
	in.mu.Lock()
	var kinds []FaultKind
	for _, k := range FaultKinds() {
		switch k {
		case FaultEtcdKill, FaultEtcdLeader:
			if !in.etcdBusy {
				kinds = append(kinds, k)
			}
		default:
			if len(in.candidatesLocked(k)) > 0 {
				kinds = append(kinds, k)
			}
		}
	}
	if len(kinds) == 0 {
		in.mu.Unlock()
		return
	}
	k := kinds[in.rng.IntN(len(kinds))]
	d := in.between(faultTimes[k][0], faultTimes[k][1])
	target := -1
	if k == FaultEtcdKill || k == FaultEtcdLeader {
		in.etcdBusy = true
	} else {
		c := in.candidatesLocked(k)
		target = c[in.rng.IntN(len(c))]
		in.busy[target] = k
	}
	member := in.rng.IntN(in.etcd.Len()) // used by FaultEtcdKill
	rate := shapeRates[in.rng.IntN(len(shapeRates))]
	in.mu.Unlock()

	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		err := in.apply(k, target, member, rate, d)
		in.mu.Lock()
		defer in.mu.Unlock()
		if target >= 0 {
			delete(in.busy, target)
		} else {
			in.etcdBusy = false
		}
		if err != nil {
			in.errs = append(in.errs, fmt.Errorf("%s: %w", k, err))
		}
	}()
}

// hold waits d, or less when the run stops.
func (in *injector) hold(d time.Duration) {
	select {
	case <-time.After(d):
	case <-in.stop:
	}
}

// count records an injected fault.
func (in *injector) count(k FaultKind) {
	in.mu.Lock()
	in.counts[k]++
	in.n++
	in.mu.Unlock()
}

// apply runs one fault: inject, hold for d, undo. An undo waits until the
// target is serving again (an agent registered, the etcd cluster healthy)
// before the target can take another fault.
func (in *injector) apply(k FaultKind, target, member int, rate string, d time.Duration) error {
	undo := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), time.Minute)
	}
	if k == FaultEtcdKill || k == FaultEtcdLeader {
		if k == FaultEtcdLeader {
			ctx, cancel := undo()
			l, err := in.etcd.Leader(ctx)
			cancel()
			if err != nil {
				return err
			}
			member = l
		}
		in.etcd.Kill(member)
		in.count(k)
		in.logf("fault %-16s etcd-%d for %v", k, member, d.Round(100*time.Millisecond))
		in.hold(d)
		if err := in.etcd.Restart(member); err != nil {
			return err
		}
		ctx, cancel := undo()
		defer cancel()
		if err := in.etcd.WaitHealthy(ctx); err != nil {
			return err
		}
		in.logf("undone %-15s etcd-%d is back", k, member)
		return nil
	}
	a := in.agents[target]
	desc := fmt.Sprintf("%s (%s on %s)", a.ID(), joinRoles(a.Roles()), a.Host().Name)
	switch k {
	case FaultKill:
		a.Kill()
		in.count(k)
		in.logf("fault %-16s %s for %v", k, desc, d.Round(100*time.Millisecond))
		in.hold(d)
		ctx, cancel := undo()
		defer cancel()
		if err := a.Start(ctx); err != nil {
			return err
		}
	case FaultPause:
		if err := a.Pause(); err != nil {
			return err
		}
		in.count(k)
		in.logf("fault %-16s %s for %v", k, desc, d.Round(100*time.Millisecond))
		in.hold(d)
		if err := a.Resume(); err != nil {
			return err
		}
	case FaultPartition:
		if err := a.Host().Partition(); err != nil {
			return err
		}
		in.count(k)
		in.logf("fault %-16s %s for %v", k, desc, d.Round(100*time.Millisecond))
		in.hold(d)
		if err := a.Host().Heal(); err != nil {
			return err
		}
	case FaultShape:
		if err := a.Host().Shape(rate); err != nil {
			return err
		}
		in.count(k)
		in.logf("fault %-16s %s to %s for %v", k, desc, rate, d.Round(100*time.Millisecond))
		in.hold(d)
		if err := a.Host().Unshape(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown fault kind %q", k)
	}
	in.logf("undone %-15s %s", k, a.ID())
	return nil
}

func joinRoles(r []string) string {
	if len(r) == len(jobs.Stages()) {
		return "all roles"
	}
	return strings.Join(r, ",")
}

// result is what the injector did: faults by kind, the total, and any
// fault it could not inject or undo.
func (in *injector) result() (map[FaultKind]int, int, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	counts := make(map[FaultKind]int, len(in.counts))
	for k, v := range in.counts {
		counts[k] = v
	}
	return counts, in.n, errors.Join(in.errs...)
}
