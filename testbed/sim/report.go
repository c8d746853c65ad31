package sim

import (
	"context"
	"fmt"
	"io"
	"math"
	"runtime"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Report is `latentmesh-dev sim`'s answer: the etcd model used, a run per
// cluster size and mode, and where one etcd saturates.
type Report struct {
	Etcd EtcdCosts `json:"etcd"`
	Runs []Result  `json:"runs"`
	// Sweep is some modes at more sizes (shorter runs), for etcd load
	// against cluster size: by mode (in Modes order), then size.
	Sweep []Result `json:"sweep"`
	// SaturatesAt is, per mode swept, where its etcd load reaches one etcd's
	// measured capacity; every mode's load is summed the same way.
	SaturatesAt []ModeSaturation `json:"etcd_saturates_at"`
}

// ModeSaturation is the cluster size at which a mode's modelled etcd load
// reaches one etcd's measured capacity, interpolated between the sweep's
// sizes; 0 when no size in the sweep reached it, -1 when the smallest
// already had.
type ModeSaturation struct {
	Mode string  `json:"mode"`
	GPUs float64 `json:"gpus"`
}

// SetSweep files the sweep's runs by mode and size and finds where each
// mode saturates.
func (rep *Report) SetSweep(runs []Result) {
	rep.Sweep, rep.SaturatesAt = nil, nil
	for _, m := range Modes() {
		var of []Result
		for _, r := range runs {
			if r.Mode == m.String() {
				of = append(of, r)
			}
		}
		if len(of) == 0 {
			continue
		}
		sort.SliceStable(of, func(i, j int) bool { return of[i].GPUs < of[j].GPUs })
		rep.Sweep = append(rep.Sweep, of...)
		rep.SaturatesAt = append(rep.SaturatesAt, ModeSaturation{Mode: m.String(), GPUs: Saturation(of)})
	}
}

// Saturation finds where load first reaches 1 among runs of one mode in
// ascending size, interpolating log load on log size.
func Saturation(runs []Result) float64 {
	for i, r := range runs {
		if r.EtcdLoad < 1 {
			continue
		}
		if i == 0 {
			return -1
		}
		p := runs[i-1]
		x0, x1 := math.Log(float64(p.GPUs)), math.Log(float64(r.GPUs))
		y0, y1 := math.Log(max(p.EtcdLoad, 1e-9)), math.Log(r.EtcdLoad)
		return math.Round(math.Exp(x0 + (x1-x0)*(0-y0)/(y1-y0)))
	}
	return 0
}

// Text writes the report as tables.
func (rep Report) Text(w io.Writer) {
	e := rep.Etcd
	fmt.Fprintf(w, "etcd (%s):\n", e.Source)
	fmt.Fprintf(w, "  write txn %v, read txn %v, watch delivery %v (idle)\n", e.WriteLatency.Round(time.Microsecond), e.ReadLatency.Round(time.Microsecond), e.WatchDelay.Round(time.Microsecond))
	fmt.Fprintf(w, "  capacity: %.0f write txns/s, %.0f read txns/s, %.0f watch creations/s, %.0f watch events/s, %.0f lease keepalives/s\n\n", e.WriteCap, e.ReadCap, e.WatchCreateCap, e.EventCap, e.KeepAliveCap)
	if len(rep.Runs) > 0 {
		table(w, rep.Runs)
	}
	if len(rep.Sweep) > 0 {
		fmt.Fprintf(w, "\netcd load against cluster size (%v each):\n", rep.Sweep[0].Duration)
		table(w, rep.Sweep)
	}
	sat := make([]string, 0, len(rep.SaturatesAt))
	for _, m := range rep.SaturatesAt {
		sat = append(sat, m.Mode+" "+satText(m.GPUs))
	}
	fmt.Fprintf(w, "\none etcd saturates (load 1) at: %s\n", strings.Join(sat, "; "))
}

func satText(g float64) string {
	switch {
	case g < 0:
		return "below the smallest size simulated"
	case g == 0:
		return "no size simulated"
	}
	return fmt.Sprintf("about %.0f GPUs", g)
}

func table(w io.Writer, runs []Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join([]string{"gpus", "pools", "mode", "jobs/s", "dispatch ms/job", "p50", "pushed", "claim txns/job", "conflicts/job", "give-backs/job", "etcd ops/job", "etcd ops/s", "watch events/s", "etcd load", "gpu util", "queue p50 ms", "queue p99 ms", "unfinished", "wall s", ""}, "\t"))
	for _, r := range runs {
		load := fmt.Sprintf("%.2f", r.EtcdLoad)
		if r.Mode == Central.String() {
			load += fmt.Sprintf(" (disp %.2f)", r.DispatcherLoad)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t%.2f\t%.3f\t%.1f\t%.0f\t%.0f\t%s\t%.3f\t%.1f\t%.1f\t%d\t%.1f\t\n",
			r.GPUs, r.Pools, r.Mode, r.JobsPerSec, r.DispatchOverheadMs, r.DispatchOverheadP50Ms, r.PushedShare, r.ClaimTxnsPerJob, r.ConflictsPerJob, r.GiveBacksPerJob, r.EtcdOpsPerJob, r.EtcdOpsPerSec, r.EtcdEventsPerSec, load, r.Utilisation, r.QueueP50Ms, r.QueueP99Ms, r.Unfinished, r.WallSeconds)
	}
	tw.Flush()
}

// RunAll runs configurations in parallel, one per core (each run is
// single-threaded and deterministic), and returns their results in order.
// done, when not nil, is called as each finishes, from one goroutine at a
// time.
func RunAll(ctx context.Context, cfgs []Config, done func(Result)) ([]Result, error) {
	out := make([]Result, len(cfgs))
	errs := make([]error, len(cfgs))
	next := make(chan int)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(cfgs)) {
		wg.Go(func() {
			for i := range next {
				out[i], errs[i] = Run(cfgs[i])
				if errs[i] == nil && done != nil {
					mu.Lock()
					done(out[i])
					mu.Unlock()
				}
			}
		})
	}
	// Longest first, so the biggest run does not start last.
	order := make([]int, len(cfgs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		return cfgs[order[a]].GPUs*int(cfgs[order[a]].Duration/time.Second) > cfgs[order[b]].GPUs*int(cfgs[order[b]].Duration/time.Second)
	})
feed:
	for _, i := range order {
		select {
		case next <- i:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}
