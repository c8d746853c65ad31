package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/httpapi"
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
	checkClaims(t, rep)
}

// checkClaims holds the agents' claim counters to the job records: every
// claim a stage's task took (its record's Attempt) was pushed, with its
// task or by its dispatcher's hand-on (a txn, won unless a conflict), and
// then started or given back, so per stage the attempts are pushed
// started + given back, of which txns - conflicts were hand-ons. A claim
// handed over to another worker is not an attempt of its own (the worker
// it went to starts it or gives it back in turn). A give-back left
// uncounted, or a start counted twice, breaks it.
func checkClaims(t *testing.T, rep *Report) {
	t.Helper()
	c := rep.Claims
	if len(c.Stages) != 3 {
		t.Fatalf("claims of %d stages, want encode, denoise and decode", len(c.Stages))
	}
	var sum httpapi.ClaimCounts
	for k, s := range c.Stages {
		st := jobs.Stages()[k]
		if s.Stage != string(st) {
			t.Fatalf("claims row %d is %q, want %s", k, s.Stage, st)
		}
		if s.Conflicts < 0 || s.Conflicts > s.Txns || s.PushedStarted < 0 || s.GivenBack < 0 || s.HandedOver < 0 || s.PushedShare < 0 || s.PushedShare > 1 {
			t.Fatalf("%s claims inconsistent: %+v", st, s)
		}
		if got, want := s.PushedStarted+s.GivenBack, rep.attempts[st]; got != want {
			t.Fatalf("%s: %d pushed started + %d given back = %d claims, but the job records count %d",
				st, s.PushedStarted, s.GivenBack, got, want)
		}
		if won := s.Txns - s.Conflicts; won > rep.attempts[st] {
			t.Fatalf("%s: %d hand-ons won, more than the %d claims the job records count", st, won, rep.attempts[st])
		}
		if rep.attempts[st] < int64(rep.All.Finished) && st != jobs.Encode { // an encode may be skipped (cached texts)
			t.Fatalf("%s: %d claims for %d finished jobs", st, rep.attempts[st], rep.All.Finished)
		}
		sum = sum.Add(s.ClaimCounts)
	}
	n := float64(rep.All.Submitted)
	if c.All.ClaimCounts != sum || math.Abs(c.All.TxnsPerJob-float64(sum.Txns)/n) > 1e-9 ||
		math.Abs(c.All.ConflictsPerJob-float64(sum.Conflicts)/n) > 1e-9 || math.Abs(c.All.GiveBacksPerJob-float64(sum.GivenBack)/n) > 1e-9 {
		t.Fatalf("all stages %+v, want the sum of the stages %+v, per job of %d", c.All, sum, rep.All.Submitted)
	}
}

// The claim counts are in the report, its text and its JSON, and agree
// with the job records (checkClaims). A colocated mesh's idle GPUs race
// for each task its pushes do not place, so some claims are won by
// transaction.
func TestClaimCounts(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a mesh")
	}
	cfg := shortConfig(t, testbed.Colocated, 3)
	cfg.Arrivals = cfg.Arrivals[:min(len(cfg.Arrivals), 16)]
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	checkAccounting(t, rep)
	if a := rep.Claims.All; a.PushedStarted+a.Txns == 0 {
		t.Fatalf("no claims counted: %+v", a)
	}
	var buf bytes.Buffer
	rep.Text(&buf, 0)
	for _, want := range []string{"claims, from the agents' counters", "conflicts/job", "give-backs/job", "\n  denoise ", "\n  all "} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("the text lacks %q:\n%s", want, buf.String())
		}
	}
	raw, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var back struct {
		Claims struct {
			All map[string]any `json:"all"`
		} `json:"claims"`
	}
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"txns", "conflicts", "pushed_started", "given_back", "handed_over", "txns_per_job", "conflicts_per_job", "give_backs_per_job", "pushed_share"} {
		if _, ok := back.Claims.All[k]; !ok {
			t.Errorf("the JSON's claims.all lacks %q: %v", k, back.Claims.All)
		}
	}
	t.Logf("\n%s", buf.String())
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

// Redone GPU time understands resumes: an earlier attempt's steps up to
// the checkpoint the next attempt resumed from are kept, the steps after
// it redone, and a denoise that started over redid every step.
func TestRedoneUnderstandsResumes(t *testing.T) {
	models, err := costmodel.Load()
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Compression = 1
	if cfg.Mix, err = ParseMix("wan2.1-t2v-1.3b:batch", models); err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	const stepMs = 100
	type attempt struct {
		claim      int // ms
		from, to   int // steps run, from+1 to to
		resumeFrom int // the step it resumed from (what the record of the committed one says)
	}
	tests := []struct {
		name         string
		attempts     []attempt // the last is committed
		redone, kept float64   // GPU-s
	}{
		{"one attempt", []attempt{{0, 0, 10, 0}}, 0, 0},
		{"started over", []attempt{{0, 0, 4, 0}, {1000, 0, 10, 0}}, 0.4, 0},
		// Stopped after step 4 and checkpointed it: nothing is redone.
		{"resumed at the stop", []attempt{{0, 0, 4, 0}, {1000, 4, 10, 4}}, 0, 0.4},
		// Cancelled after step 6, its newest checkpoint at 4: steps 5 and 6 again.
		{"resumed before the stop", []attempt{{0, 0, 6, 0}, {1000, 4, 10, 4}}, 0.2, 0.4},
		// The first ran 1-6 (checkpoint at 4, killed), the second resumed at
		// 4 and stopped at 8, the third resumed at 8: 5 and 6 were run twice.
		{"a chain of resumes", []attempt{{0, 0, 6, 0}, {1000, 4, 8, 4}, {2000, 8, 10, 8}}, 0.2, 0.8},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := &run{cfg: cfg, models: models}
			var spans []simgpu.Span
			for _, a := range tc.attempts {
				ms := a.claim + 10
				for step := a.from + 1; step <= a.to; step++ {
					spans = append(spans, simgpu.Span{Node: "gpu-1", Tag: "req-000000", Seed: 5, Stage: jobs.Denoise, Frame: -1, Step: step,
						Queued: at(ms), Start: at(ms), End: at(ms + stepMs)})
					ms += stepMs
				}
			}
			// Another request's spans with the same prompt are not this job's.
			spans = append(spans, simgpu.Span{Node: "gpu-2", Tag: "req-000000", Seed: 6, Stage: jobs.Denoise, Frame: -1, Step: 1, Queued: at(5), Start: at(5), End: at(500)})
			for _, s := range spans {
				r.spans.add(s)
			}
			last := tc.attempts[len(tc.attempts)-1]
			end := last.claim + 10 + stepMs*(last.to-last.from)
			job := jobs.Job{ID: "j", CreatedAt: at(0), Stages: map[jobs.Stage]*jobs.StageRecord{
				jobs.Denoise: {Node: "gpu-1", Attempt: len(tc.attempts), StartedAt: at(last.claim), FinishedAt: at(end + 5), ResumedFrom: last.resumeFrom},
			}}
			rep := r.report([]*result{{Arrival: Arrival{Seed: 5}, Class: cfg.Mix[0], ID: "j", Submit: at(0), Accepted: at(0), End: at(end + 10), Job: job}})
			got := rep.Jobs[0].Stages[jobs.Denoise]
			near := func(x, want float64) bool { return math.Abs(x-want) < 1e-9 }
			if !near(got.Redone, tc.redone) || !near(got.Kept, tc.kept) || !near(rep.RedoneGPU, tc.redone) || !near(rep.KeptGPU, tc.kept) {
				t.Fatalf("redone %.3f kept %.3f (report %.3f, %.3f), want %.3f and %.3f", got.Redone, got.Kept, rep.RedoneGPU, rep.KeptGPU, tc.redone, tc.kept)
			}
			if want := 0.1 * float64(last.to-last.from); !near(got.Run, want) || !near(got.Wall, float64(end+5-last.claim)/1000) {
				t.Fatalf("run %.3f wall %.3f, want run %.3f: the committed attempt's steps", got.Run, got.Wall, want)
			}
			if rep.ResumeMismatches != 0 || (last.resumeFrom > 0) != (rep.ResumedStages == 1) {
				t.Fatalf("%d resume mismatches, %d resumed stages", rep.ResumeMismatches, rep.ResumedStages)
			}
		})
	}
}

// The generated texts repeat as asked, deterministically, and a trace's
// own prompts are kept.
func TestAssignPrompts(t *testing.T) {
	models, _ := costmodel.Load()
	mix, _ := ParseMix("flux.1-dev:interactive,wan2.1-t2v-1.3b:batch", models)
	arr := Poisson(mix, 10, 200*time.Second, 4)
	arr[0].Prompt, arr[0].Negative = "a trace's own", "its own negative"
	again := append([]Arrival(nil), arr...)
	p := Prompts{Repeat: 0.5, Hot: 3, HotShare: 0.9}
	AssignPrompts(arr, p, 1)
	AssignPrompts(again, p, 1)
	hot := map[string]int{}
	for i := range arr {
		if arr[i] != again[i] {
			t.Fatalf("arrival %d: %+v then %+v from one seed", i, arr[i], again[i])
		}
		if strings.HasPrefix(arr[i].Negative, "negative-hot-") {
			hot[arr[i].Negative]++
		}
	}
	if arr[0].Prompt != "a trace's own" || arr[0].Negative != "its own negative" {
		t.Fatalf("the trace's texts were replaced: %+v", arr[0])
	}
	u := Reuse(arr)
	// About 2,000 arrivals: the shares are within a few points of the mix.
	if math.Abs(u.Prompt-0.5) > 0.05 || u.Negative < 0.85 || u.Negative > 0.92 || len(hot) != 3 || hot["negative-hot-1"] <= hot["negative-hot-3"] {
		t.Fatalf("reuse %+v, hot negatives %v: want about 50%% and 90%%, Zipf over 3", u, hot)
	}
	if err := (Prompts{Repeat: 1.5}).Check(); err == nil {
		t.Fatal("a repeat share of 1.5 accepted")
	}
	// Two arrivals that are one request (prompt and seed) cannot be told apart in the report.
	cfg := shortConfig(t, testbed.Disaggregated, 3)
	cfg.Arrivals = []Arrival{{Model: "flux.1-dev", Class: "interactive", Prompt: "x", Seed: 1}, {Model: "flux.1-dev", Class: "interactive", Prompt: "x", Seed: 1}}
	if err := cfg.check(models); err == nil || !strings.Contains(err.Error(), "one request") {
		t.Fatalf("duplicate request: %v", err)
	}
}

// The comparison runs one trace on GPUs that cannot checkpoint and then on
// GPUs that checkpoint every 10 steps: only the second writes checkpoints,
// and every resume starts after its checkpoint's step. The targets are reported, not asserted: whether a
// preemption happens depends on this machine's timing.
func TestCompareCheckpoints(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a mesh twice")
	}
	cfg := shortConfig(t, testbed.Disaggregated, 3)
	cfg.CheckpointEvery = 10
	c, err := CompareCheckpoints(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	checkAccounting(t, c.Without)
	checkAccounting(t, c.With)
	if !c.Without.NoCheckpoints || c.With.NoCheckpoints || c.Without.Checkpoints != 0 || c.Without.ResumedStages != 0 {
		t.Fatalf("without: no_checkpoints %v, %d checkpoints, %d resumes", c.Without.NoCheckpoints, c.Without.Checkpoints, c.Without.ResumedStages)
	}
	// A write still under way when the next checkpoint comes is replaced
	// by it, so a slow machine writes fewer than four, but never none.
	if c.With.Checkpoints < int64(c.With.All.Finished) {
		t.Fatalf("with: %d checkpoints written for %d jobs, want one a job at least", c.With.Checkpoints, c.With.All.Finished)
	}
	if c.Without.ResumeMismatches+c.With.ResumeMismatches != 0 || c.Paired == 0 {
		t.Fatalf("%d and %d resume mismatches, %d paired jobs", c.Without.ResumeMismatches, c.With.ResumeMismatches, c.Paired)
	}
	var buf bytes.Buffer
	c.Text(&buf)
	t.Logf("\n%s", buf.String())
}
