package serve

import (
	"bytes"
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/testbed"
	"github.com/latentmesh/latentmesh/testbed/costmodel"
	"github.com/latentmesh/latentmesh/testbed/simgpu"
)

// shortConfig is a small, fast run: images and videos on a few GPUs, time
// compressed 20x, payloads a sixteenth of their real size.
func shortConfig(t *testing.T, topo testbed.Topology, gpus int) Config {
	t.Helper()
	models, err := costmodel.Load()
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Topology, cfg.GPUs = topo, gpus
	cfg.Compression, cfg.ByteScale = 20, 16
	cfg.Drain = 2 * time.Minute
	if cfg.Mix, err = ParseMix("flux.1-dev:interactive:1:30s,wan2.1-t2v-1.3b:batch:1:90s", models); err != nil {
		t.Fatal(err)
	}
	// About 60% of what the GPUs can do: every job should meet its SLO.
	rate := 0.6 * float64(gpus) / MixModel(models, cfg.Mix).Total().Seconds()
	cfg.Arrivals = Poisson(cfg.Mix, rate, 60*time.Second, 3)
	return cfg
}

func checkAccounting(t *testing.T, rep *Report) {
	t.Helper()
	if rep.All.Finished != rep.All.Submitted || rep.All.Failed+rep.All.Unfinished != 0 {
		t.Fatalf("%d submitted, %d finished, %d failed, %d unfinished", rep.All.Submitted, rep.All.Finished, rep.All.Failed, rep.All.Unfinished)
	}
	if rep.GPUOverlaps != 0 {
		t.Fatalf("%d GPU spans overlapped another on the same GPU", rep.GPUOverlaps)
	}
	for _, j := range rep.Jobs {
		for _, st := range jobs.Stages() {
			if _, ok := j.Stages[st]; !ok {
				t.Fatalf("job %s has no %s breakdown", j.ID, st)
			}
		}
	}
}

// Two runs of one trace and seed each account for every job, and no GPU
// runs two stages at once. How close their goodputs are is logged, not
// asserted: it depends on how busy this machine's CPUs are, and CI checks
// behaviour, not speed (docs/benchmarks.md has the measured figure, from
// two runs of the command on one trace).
func TestServeReproduces(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a mesh twice")
	}
	ctx := context.Background()
	cfg := shortConfig(t, testbed.Disaggregated, 3)
	var good []float64
	for range 2 {
		rep, err := Run(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		checkAccounting(t, rep)
		good = append(good, rep.All.Goodput)
		var buf bytes.Buffer
		rep.Text(&buf, 3)
		t.Logf("\n%s", buf.String())
	}
	if good[0] > 0 {
		t.Logf("goodput %.2f then %.2f jobs/min: %.1f%% apart", good[0], good[1], 100*math.Abs(good[0]-good[1])/good[0])
	}
}

// A colocated GPU runs every stage, one at a time, and holds every
// stage's weights.
func TestColocatedSharesOneGPU(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a mesh")
	}
	cfg := shortConfig(t, testbed.Colocated, 2)
	cfg.Arrivals = cfg.Arrivals[:min(len(cfg.Arrivals), 12)]
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	checkAccounting(t, rep)
	stages := map[string]map[jobs.Stage]bool{}
	for _, s := range rep.spans {
		if stages[s.Node] == nil {
			stages[s.Node] = map[jobs.Stage]bool{}
		}
		stages[s.Node][s.Stage] = true
	}
	ran := false
	for _, m := range stages {
		ran = ran || len(m) == 3
	}
	if !ran {
		t.Fatalf("no colocated GPU ran all three stages: %v", stages)
	}
	if w := rep.Agents[0].WeightsGB; math.Abs(w-(34+14.5)) > 0.01 {
		t.Fatalf("colocated GPU holds %.1f GB of weights, want FLUX's 34 + Wan 1.3B's 14.5", w)
	}
}

// A colocated GPU that cannot hold every model's weights is refused.
func TestColocatedWeightsMustFit(t *testing.T) {
	models, _ := costmodel.Load()
	cfg := shortConfig(t, testbed.Colocated, 1)
	cfg.Mix, _ = ParseMix("flux.1-dev:interactive,qwen-image:standard,wan2.1-t2v-1.3b:batch", models)
	cfg.Arrivals = Poisson(cfg.Mix, 1, 10*time.Second, 1)
	if _, err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "GB of weights") {
		t.Fatalf("106 GB of weights on an 80 GB GPU: %v", err)
	}
}

func TestTraceRoundTrip(t *testing.T) {
	models, _ := costmodel.Load()
	mix, err := ParseMix("flux.1-dev:interactive:2,wan2.1-t2v-1.3b:batch", models)
	if err != nil {
		t.Fatal(err)
	}
	arr := Poisson(mix, 2, time.Minute, 9)
	if again := Poisson(mix, 2, time.Minute, 9); len(again) != len(arr) || again[len(again)-1] != arr[len(arr)-1] {
		t.Fatal("the same seed drew different arrivals")
	}
	var buf bytes.Buffer
	if err := WriteTrace(&buf, arr); err != nil {
		t.Fatal(err)
	}
	back, err := ReadTrace(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(back) != len(arr) || back[3].Model != arr[3].Model || back[3].At != arr[3].At {
		t.Fatalf("trace round trip: %d arrivals, want %d", len(back), len(arr))
	}
	for _, bad := range []string{"nosuch", "flux.1-dev:vip", "flux.1-dev:batch:-1", "flux.1-dev:batch:1:soon"} {
		if _, err := ParseMix(bad, models); err == nil {
			t.Errorf("mix %q accepted", bad)
		}
	}
}

// An agent's queue times are the policy's simulated times compressed like
// the GPU's (a 2 s preemption wait at 10x is 200 ms of wall time); the
// steal grace is the control plane's and stays as it is.
func TestQueuePolicyCompressed(t *testing.T) {
	models, _ := costmodel.Load()
	cfg := shortConfig(t, testbed.Disaggregated, 3)
	cfg.Compression = 10
	cfg.Queue.Scheduler = routing.FIFO
	r := &run{cfg: cfg, models: models}
	ac, _, err := r.agentConfig(0, []jobs.Stage{jobs.Denoise})
	if err != nil {
		t.Fatal(err)
	}
	q := ac.Queue
	if q.Scheduler != routing.FIFO || q.PreemptAfter != cfg.Queue.PreemptAfter/10 || q.AgingStep != cfg.Queue.AgingStep/10 || q.StealGrace != cfg.Queue.StealGrace {
		t.Fatalf("agent queue policy %+v from %+v at 10x", q, cfg.Queue)
	}
	if ac.Admission.Slack != 2*cfg.GPUs {
		t.Fatalf("default slack %d on %d GPUs, want two per GPU", ac.Admission.Slack, cfg.GPUs)
	}
}

// A stage that was preempted and ran again reports the earlier attempt's
// GPU time as redone, and its claim+pull from the last claim: never a
// negative time.
func TestBreakdownOfRedoneStage(t *testing.T) {
	models, err := costmodel.Load()
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Compression = 1
	if cfg.Mix, err = ParseMix("flux.1-dev:batch", models); err != nil {
		t.Fatal(err)
	}
	r := &run{cfg: cfg, models: models}
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	span := func(st jobs.Stage, q, s, e int) {
		r.spans.add(simgpu.Span{Node: "gpu-0", Tag: "req-000000", Stage: st, Frame: -1, Queued: at(q), Start: at(s), End: at(e)})
	}
	span(jobs.Encode, 2, 2, 22)
	span(jobs.Denoise, 30, 30, 530)      // first attempt: preempted after 500 ms
	span(jobs.Denoise, 1040, 1040, 7540) // second attempt, claimed at 1,000 ms
	span(jobs.Decode, 7560, 7560, 7570)
	job := jobs.Job{ID: "j", CreatedAt: at(0), Stages: map[jobs.Stage]*jobs.StageRecord{
		jobs.Encode:  {Node: "gpu-0", StartedAt: at(1), FinishedAt: at(25)},
		jobs.Denoise: {Node: "gpu-0", Attempt: 2, StartedAt: at(1000), FinishedAt: at(7550)},
		jobs.Decode:  {Node: "gpu-0", StartedAt: at(7555), FinishedAt: at(7580)},
	}}
	rep := r.report([]*result{{Class: cfg.Mix[0], ID: "j", Submit: at(0), Accepted: at(1), End: at(7590), Job: job}})
	got := rep.Jobs[0].Stages[jobs.Denoise]
	near := func(x, want float64) bool { return math.Abs(x-want) < 1e-9 }
	if !near(got.Redone, 0.5) || !near(got.ClaimPull, 0.04) || !near(got.Run, 6.5) || !near(got.Queue, 0.975) {
		t.Fatalf("denoise breakdown %+v: want redone 0.5, claim+pull 0.04, run 6.5, queue 0.975", got)
	}
	if e := rep.Jobs[0].Stages[jobs.Encode]; e.Redone != 0 || !near(e.Run, 0.02) || rep.RedoneStages != 1 || !near(rep.RedoneGPU, 0.5) {
		t.Fatalf("encode breakdown %+v", e)
	}
}
