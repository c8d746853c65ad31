package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/testbed"
	"github.com/latentmesh/latentmesh/testbed/simgpu"
)

// Report is a run's outcome. Times are simulated seconds: wall time
// multiplied by the compression.
type Report struct {
	Topology    testbed.Topology `json:"topology"`
	GPUs        int              `json:"gpus"`
	Pools       string           `json:"pools,omitempty"`
	Compression float64          `json:"compression"`
	ByteScale   float64          `json:"byte_scale"`
	Tiling      float64          `json:"tiling"`
	// Scheduler is the queue order (priority or fifo); PreemptAfter the
	// simulated wait before preemption (0: none); Slack the agents'
	// backpressure slack.
	Scheduler    string  `json:"scheduler"`
	PreemptAfter float64 `json:"preempt_after_s"`
	Slack        int     `json:"backpressure_slack"`
	// CheckpointEvery is the agents' step checkpoint period (0: only where
	// a preemption stops a denoise); NoCheckpoints that the GPUs could not
	// checkpoint at all (a preempted denoise starts over).
	CheckpointEvery int       `json:"checkpoint_every"`
	NoCheckpoints   bool      `json:"no_checkpoints,omitempty"`
	Agents          []Agent   `json:"agents"`
	Payloads        []Payload `json:"payloads"`
	// Prompts is the text mix the prompts were drawn from (nil: the trace
	// named them); Reuse how often this trace's texts repeat, what an
	// unbounded conditioning cache could hit.
	Prompts *Prompts  `json:"prompts,omitempty"`
	Reuse   TextReuse `json:"text_reuse"`
	// CondCache is what the conditioning cache did in this run, from the
	// finished jobs' encode stage records and the GPUs' encode spans.
	CondCache CondCacheStats `json:"cond_cache"`
	// Makespan is first submission to last completion.
	Makespan float64      `json:"makespan_s"`
	Classes  []ClassStats `json:"classes"`
	All      ClassStats   `json:"all"`
	// VideoTTFF is submission to the first decoded video frame.
	VideoTTFF Percentiles `json:"video_ttff_s"`
	// PeakWaiting is the most stage inputs (conditioning for denoise,
	// latents for decode) produced but not yet started on, at once.
	PeakWaiting map[jobs.Stage]int `json:"peak_waiting"`
	// GPUBusy is the share of each pool's GPU time spent running stages.
	GPUBusy map[string]float64 `json:"gpu_busy"`
	// GPUOverlaps counts spans that overlapped another on the same GPU:
	// always 0 unless the GPU model is broken.
	GPUOverlaps int `json:"gpu_overlaps"`
	// RedoneStages counts stages that ran work again after a preemption
	// or requeue, and RedoneGPU the GPU time thrown away: every earlier
	// attempt's span of an encode or decode, and of a denoise the steps a
	// later attempt ran again (all of them unless it resumed from a
	// checkpoint). ResumedStages counts denoises that resumed from a step
	// checkpoint, KeptGPU the earlier attempts' GPU time they kept.
	RedoneStages  int     `json:"redone_stages"`
	RedoneGPU     float64 `json:"redone_gpu_s"`
	ResumedStages int     `json:"resumed_stages"`
	KeptGPU       float64 `json:"kept_gpu_s"`
	// Checkpoints counts step checkpoints recorded (etcd transactions of
	// jobs.Store.SaveCheckpoint that succeeded).
	Checkpoints int64 `json:"checkpoints"`
	// ResumeMismatches counts denoises whose committed attempt's first
	// step is not the one after its ResumedFrom: always 0 unless the
	// resume or this accounting is broken.
	ResumeMismatches int `json:"resume_mismatches"`
	// Claims is how the stages were claimed, from the agents' counters.
	Claims        ClaimStats       `json:"claims"`
	EtcdOps       map[string]int64 `json:"etcd_ops"`
	EtcdOpsPerJob float64          `json:"etcd_ops_per_job"`
	// Breakdown is, per class, the median of each part of a job's time.
	Breakdown []Breakdown `json:"breakdown"`
	Jobs      []JobRecord `json:"jobs"`

	spans []simgpu.Span
	// attempts sums the finished jobs' stage records' Attempt (claims
	// taken, pushed or won, on each stage's task), by stage.
	attempts map[jobs.Stage]int64
}

// ClaimStats is how a run's stage tasks were claimed: the agents' own
// counters (agent.Agent.Claims, the latentmesh_claim_txns_total,
// latentmesh_claim_conflicts_total and latentmesh_pushed_claims_total
// series) read before the first arrival and after the last job, summed
// over agents. Every claim a job's stage takes is pushed to its worker,
// with its task or by its dispatcher's hand-on later (a transaction, Txns,
// refused as a conflict when the task changed first), and then started
// or given back to its dispatcher.
type ClaimStats struct {
	Stages []StageClaims `json:"stages"` // encode, denoise, decode
	All    StageClaims   `json:"all"`
}

// StageClaims are one stage's claim counts, the mesh's sums, and the same
// per submitted job. PushedShare is the share of the claims made with
// their task, as it was created, rather than handed on by its dispatcher
// later: 1 less hand-ons won (txns less conflicts) over claims (pushed
// started plus given back).
type StageClaims struct {
	Stage string `json:"stage"`
	httpapi.ClaimCounts
	TxnsPerJob      float64 `json:"txns_per_job"`
	ConflictsPerJob float64 `json:"conflicts_per_job"`
	GiveBacksPerJob float64 `json:"give_backs_per_job"`
	HandOversPerJob float64 `json:"hand_overs_per_job"`
	PushedShare     float64 `json:"pushed_share"`
}

func stageClaims(name string, c httpapi.ClaimCounts, submitted int) StageClaims {
	s := StageClaims{Stage: name, ClaimCounts: c}
	if submitted > 0 {
		n := float64(submitted)
		s.TxnsPerJob, s.ConflictsPerJob, s.GiveBacksPerJob = float64(c.Txns)/n, float64(c.Conflicts)/n, float64(c.GivenBack)/n
		s.HandOversPerJob = float64(c.HandedOver) / n
	}
	if claims := c.PushedStarted + c.GivenBack; claims > 0 {
		s.PushedShare = max(0, 1-float64(c.Txns-c.Conflicts)/float64(claims))
	}
	return s
}

// CondCacheStats is the conditioning cache's effect on a run.
type CondCacheStats struct {
	Off bool `json:"off,omitempty"` // the agents ran without it
	// Jobs counts finished jobs; Skipped those that had no encode (both
	// texts found at submission); PromptHits and NegativeHits the jobs
	// whose prompt or negative prompt came from the cache, skipped ones
	// included.
	Jobs         int `json:"jobs"`
	Skipped      int `json:"skipped_encode"`
	PromptHits   int `json:"prompt_hits"`
	NegativeHits int `json:"negative_hits"`
	// EncodeGPU is the simulated GPU time of every encode span of the run.
	EncodeGPU float64 `json:"encode_gpu_s"`
}

// Payload is what one model's stages hand on, as simulated.
type Payload struct {
	Model       string `json:"model"`
	CondBytes   int64  `json:"cond_bytes"`
	LatentBytes int64  `json:"latent_bytes"`
}

// ClassStats is one class's figures.
type ClassStats struct {
	Name      string  `json:"name"`
	SLO       float64 `json:"slo_s"`
	Submitted int     `json:"submitted"`
	Finished  int     `json:"finished"`
	Failed    int     `json:"failed"`
	// Unfinished jobs were still running when the drain ran out.
	Unfinished int         `json:"unfinished"`
	MetSLO     int         `json:"met_slo"`
	Through    float64     `json:"throughput_per_min"`
	Goodput    float64     `json:"goodput_per_min"`
	Latency    Percentiles `json:"latency_s"`
}

// Percentiles of a set of simulated seconds.
type Percentiles struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
}

func percentiles(xs []float64) Percentiles {
	if len(xs) == 0 {
		return Percentiles{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	q := func(p float64) float64 { return s[min(len(s)-1, int(math.Ceil(p*float64(len(s))))-1)] }
	return Percentiles{N: len(s), P50: q(0.5), P90: q(0.9), P99: q(0.99)}
}

// StageTimes is where one stage of a job spent its time, from the job
// record (claim and commit times) and the GPU spans.
type StageTimes struct {
	Queue     float64 `json:"queue_s"`      // ready (previous commit) to the last attempt's claim
	ClaimPull float64 `json:"claim_pull_s"` // claimed to asking for the GPU: claim, progress key, pull
	GPUWait   float64 `json:"gpu_wait_s"`   // waiting for this GPU's other work
	Run       float64 `json:"run_s"`        // GPU time
	Commit    float64 `json:"commit_s"`     // last GPU span to the commit (decode: storing the file)
	// Wall is the committed attempt's claim to commit: its GPU time and
	// the control plane's (claim, pull, GPU wait, checkpoint writes,
	// commit).
	Wall float64 `json:"wall_s"`
	// Redone is the GPU time of earlier attempts (a preempted batch task,
	// a requeue) that a later attempt did again; Kept what of theirs a
	// resume from a step checkpoint kept. Queue includes both.
	Redone float64 `json:"redone_s,omitempty"`
	Kept   float64 `json:"kept_s,omitempty"`
	// Attempt, ResumedFrom and Checkpoints are the stage record's: claims
	// taken, the step the committed attempt resumed from, and the
	// checkpoints it wrote.
	Attempt     int `json:"attempt"`
	ResumedFrom int `json:"resumed_from,omitempty"`
	Checkpoints int `json:"checkpoints,omitempty"`
}

// JobRecord is one job's breakdown.
type JobRecord struct {
	ID      string                    `json:"id"`
	Class   string                    `json:"class"`
	Submit  float64                   `json:"submit_s"` // the submit call
	Stages  map[jobs.Stage]StageTimes `json:"stages"`
	Notify  float64                   `json:"notify_s"` // commit of decode to the client's wait returning
	Latency float64                   `json:"latency_s"`
	TTFF    float64                   `json:"ttff_s,omitempty"`
	Nodes   map[jobs.Stage]string     `json:"nodes"`
	Error   string                    `json:"error,omitempty"`

	job    spanJob   // the request's prompt and seed, naming its GPU spans
	t0, t1 time.Time // submitted, and the client's wait returned
}

// spanJob names a job's GPU spans: its request's prompt and seed.
type spanJob struct {
	prompt string
	seed   int64
}

func jobOfSpan(s simgpu.Span) spanJob { return spanJob{s.Tag, s.Seed} }

// attempts splits one job's spans of one stage, sorted by start, into
// those of earlier attempts (asked for before the committed attempt's
// claim) and the committed attempt's.
func attempts(sp []simgpu.Span, claimed time.Time) (earlier, last []simgpu.Span) {
	for _, s := range sp {
		if s.Queued.Before(claimed) {
			earlier = append(earlier, s)
		} else {
			last = append(last, s)
		}
	}
	if len(last) == 0 && len(earlier) > 0 { // clocks disagree: the latest is the committed one
		earlier, last = earlier[:len(earlier)-1], earlier[len(earlier)-1:]
	}
	return earlier, last
}

// redone splits earlier attempts' GPU time into what was thrown away and
// what a resume kept. A denoise span is kept when no later span (of any
// attempt) ran its step again: the chain of resumes that ended in the
// commit ran on from it. So an attempt's steps up to the checkpoint the
// next one resumed from are kept and the steps after it redone, and a
// denoise that started over (no checkpoint) redid them all. An encode or
// decode span (no step) of an earlier attempt is always redone.
func redone(earlier, last []simgpu.Span) (thrown, kept time.Duration) {
	latest := map[int]time.Time{} // step -> the last start of a span that ran it
	for _, sp := range [][]simgpu.Span{earlier, last} {
		for _, s := range sp {
			if t, ok := latest[s.Step]; s.Step > 0 && (!ok || s.Start.After(t)) {
				latest[s.Step] = s.Start
			}
		}
	}
	for _, s := range earlier {
		d := s.End.Sub(s.Start)
		if s.Step > 0 && latest[s.Step].Equal(s.Start) {
			kept += d
		} else {
			thrown += d
		}
	}
	return thrown, kept
}

// Breakdown is a class's median StageTimes and submit/notify.
type Breakdown struct {
	Class  string                    `json:"class"`
	Submit float64                   `json:"submit_s"`
	Stages map[jobs.Stage]StageTimes `json:"stages"`
	Notify float64                   `json:"notify_s"`
}

func (r *run) report(results []*result) *Report {
	f := r.cfg.Compression
	sim := func(d time.Duration) float64 { return d.Seconds() * f }
	spans := r.spans.all()
	rep := &Report{Topology: r.cfg.Topology, GPUs: r.cfg.GPUs, Compression: f, ByteScale: r.cfg.ByteScale, Tiling: r.cfg.Tiling,
		Scheduler: r.cfg.Queue.Scheduler.String(), PreemptAfter: r.cfg.Queue.PreemptAfter.Seconds(), Slack: r.slack(),
		CheckpointEvery: r.cfg.CheckpointEvery, NoCheckpoints: r.cfg.NoCheckpoints, Prompts: r.cfg.Prompts, Reuse: Reuse(r.cfg.Arrivals),
		CondCache: CondCacheStats{Off: r.cfg.NoCondCache},
		Agents:    r.agents, PeakWaiting: map[jobs.Stage]int{}, GPUBusy: map[string]float64{}, spans: spans, attempts: map[jobs.Stage]int64{}}
	if r.cfg.Topology == testbed.Disaggregated {
		rep.Pools = r.cfg.Pools.String()
	}
	for _, c := range r.cfg.Mix {
		m, _ := r.models.Model(c.Model)
		sm, _ := simModel(m, r.cfg, false)
		dup := false
		for _, p := range rep.Payloads {
			dup = dup || p.Model == c.Model
		}
		if !dup {
			rep.Payloads = append(rep.Payloads, Payload{Model: c.Model, CondBytes: sm.Cond.Bytes(), LatentBytes: sm.Latent.Bytes()})
		}
	}

	// GPU spans by request and stage.
	type key struct {
		job spanJob
		st  jobs.Stage
	}
	byJob := map[key][]simgpu.Span{}
	for _, s := range spans {
		k := key{jobOfSpan(s), s.Stage}
		byJob[k] = append(byJob[k], s)
	}

	var first, last time.Time
	lat := map[string][]float64{}
	var all []float64
	var ttff []float64
	stats := map[string]*ClassStats{}
	var order []string
	for _, c := range r.cfg.Mix {
		stats[c.Name()] = &ClassStats{Name: c.Name(), SLO: c.SLO.Seconds()}
		order = append(order, c.Name())
	}
	type interval struct{ from, to time.Time }
	waiting := map[jobs.Stage][]interval{}
	for i, res := range results {
		cs := stats[classOf(res)]
		cs.Submitted++
		if first.IsZero() || res.Submit.Before(first) {
			first = res.Submit
		}
		rec := JobRecord{ID: res.ID, Class: classOf(res), Submit: sim(res.Accepted.Sub(res.Submit)),
			Stages: map[jobs.Stage]StageTimes{}, Nodes: map[jobs.Stage]string{}, job: spanJob{PromptOf(i, res.Arrival), res.Seed}, t0: res.Submit, t1: res.End}
		if res.Err != nil {
			if errors.Is(res.Err, context.DeadlineExceeded) {
				cs.Unfinished++
			} else {
				cs.Failed++
			}
			rec.Error = res.Err.Error()
			rep.Jobs = append(rep.Jobs, rec)
			continue
		}
		cs.Finished++
		rep.CondCache.count(res.Job)
		for st, sr := range res.Job.Stages {
			rep.attempts[st] += int64(sr.Attempt)
		}
		if res.End.After(last) {
			last = res.End
		}
		rec.Latency = sim(res.End.Sub(res.Submit))
		if rec.Latency <= res.Class.SLO.Seconds() {
			cs.MetSLO++
		}
		lat[cs.Name] = append(lat[cs.Name], rec.Latency)
		all = append(all, rec.Latency)
		ready := res.Job.CreatedAt
		var prevEnd time.Time
		for _, st := range jobs.Stages() {
			sr := res.Job.Stages[st]
			sp := byJob[key{rec.job, st}]
			if sr == nil || len(sp) == 0 {
				continue
			}
			sort.Slice(sp, func(a, b int) bool { return sp[a].Start.Before(sp[b].Start) })
			t := StageTimes{Queue: sim(sr.StartedAt.Sub(ready)), Wall: sim(sr.FinishedAt.Sub(sr.StartedAt)),
				Attempt: sr.Attempt, ResumedFrom: sr.ResumedFrom, Checkpoints: sr.Checkpoints}
			earlier, sp := attempts(sp, sr.StartedAt)
			thrown, kept := redone(earlier, sp)
			t.Redone, t.Kept = sim(thrown), sim(kept)
			if st == jobs.Denoise && sp[0].Step > 0 && sp[0].Step != sr.ResumedFrom+1 {
				rep.ResumeMismatches++
			}
			if sr.ResumedFrom > 0 {
				rep.ResumedStages++
			}
			rep.KeptGPU += t.Kept
			t.ClaimPull = sim(sp[0].Queued.Sub(sr.StartedAt))
			for _, s := range sp {
				t.GPUWait += sim(s.Start.Sub(s.Queued))
				t.Run += sim(s.End.Sub(s.Start))
				if st == jobs.Decode && s.Frame == 0 && res.Job.Spec.Frames > 1 {
					rec.TTFF = sim(s.End.Sub(res.Submit))
					ttff = append(ttff, rec.TTFF)
				}
			}
			end := sp[len(sp)-1].End
			t.Commit = sim(sr.FinishedAt.Sub(end))
			rec.Stages[st], rec.Nodes[st] = t, sr.Node
			if t.Redone > 0 {
				rep.RedoneStages++
				rep.RedoneGPU += t.Redone
			}
			if st != jobs.Encode && !prevEnd.IsZero() {
				waiting[st] = append(waiting[st], interval{prevEnd, sp[0].Start})
			}
			prevEnd, ready = end, sr.FinishedAt
		}
		rec.Notify = sim(res.End.Sub(ready))
		rep.Jobs = append(rep.Jobs, rec)
	}
	if !last.IsZero() {
		rep.Makespan = sim(last.Sub(first))
	}
	perMin := func(n int) float64 {
		if rep.Makespan <= 0 {
			return 0
		}
		return float64(n) / rep.Makespan * 60
	}
	var tot ClassStats
	tot.Name = "all"
	for _, name := range order {
		cs := stats[name]
		cs.Latency = percentiles(lat[name])
		cs.Through, cs.Goodput = perMin(cs.Finished), perMin(cs.MetSLO)
		rep.Classes = append(rep.Classes, *cs)
		tot.Submitted += cs.Submitted
		tot.Finished += cs.Finished
		tot.Failed += cs.Failed
		tot.Unfinished += cs.Unfinished
		tot.MetSLO += cs.MetSLO
	}
	tot.Latency = percentiles(all)
	tot.Through, tot.Goodput = perMin(tot.Finished), perMin(tot.MetSLO)
	rep.All = tot
	rep.VideoTTFF = percentiles(ttff)

	for st, ivs := range waiting {
		type ev struct {
			t time.Time
			d int
		}
		var evs []ev
		for _, iv := range ivs {
			evs = append(evs, ev{iv.from, 1}, ev{iv.to, -1})
		}
		sort.Slice(evs, func(a, b int) bool {
			if evs[a].t.Equal(evs[b].t) {
				return evs[a].d < evs[b].d
			}
			return evs[a].t.Before(evs[b].t)
		})
		n, peak := 0, 0
		for _, e := range evs {
			n += e.d
			peak = max(peak, n)
		}
		rep.PeakWaiting[st] = peak
	}

	// The GPU model's own accounting: no two spans overlap on one GPU.
	byNode := map[string][]simgpu.Span{}
	for _, s := range spans {
		byNode[s.Node] = append(byNode[s.Node], s)
	}
	busy := map[string]time.Duration{}
	gpus := map[string]int{}
	for _, a := range r.agents {
		gpus[poolOf(a)]++
	}
	for node, sp := range byNode {
		sort.Slice(sp, func(a, b int) bool { return sp[a].Start.Before(sp[b].Start) })
		for k := 1; k < len(sp); k++ {
			if sp[k].Start.Before(sp[k-1].End) {
				rep.GPUOverlaps++
			}
		}
		pool := "all"
		for _, a := range r.agents {
			if a.Node == node {
				pool = poolOf(a)
			}
		}
		for _, s := range sp {
			busy[pool] += s.End.Sub(s.Start)
		}
	}
	if !last.IsZero() {
		for pool, b := range busy {
			rep.GPUBusy[pool] = b.Seconds() / (last.Sub(first).Seconds() * float64(gpus[pool]))
		}
	}

	for _, s := range spans {
		if s.Stage == jobs.Encode {
			rep.CondCache.EncodeGPU += sim(s.End.Sub(s.Start))
		}
	}
	ops := r.ops.snapshot()
	rep.EtcdOps = ops
	var n int64
	for _, v := range ops {
		n += v
	}
	if tot.Submitted > 0 {
		rep.EtcdOpsPerJob = float64(n) / float64(tot.Submitted)
	}
	var claims httpapi.ClaimCounts
	for _, st := range jobs.Stages() {
		rep.Claims.Stages = append(rep.Claims.Stages, stageClaims(string(st), r.claims[st], tot.Submitted))
		claims = claims.Add(r.claims[st])
	}
	rep.Claims.All = stageClaims("all", claims, tot.Submitted)
	rep.Checkpoints = r.ops.checkpoints.Load()

	for _, name := range order {
		b := Breakdown{Class: name, Stages: map[jobs.Stage]StageTimes{}}
		var sub, not []float64
		parts := map[jobs.Stage]map[string][]float64{}
		for _, j := range rep.Jobs {
			if j.Class != name || j.Error != "" {
				continue
			}
			sub, not = append(sub, j.Submit), append(not, j.Notify)
			for st, t := range j.Stages {
				if parts[st] == nil {
					parts[st] = map[string][]float64{}
				}
				p := parts[st]
				p["q"], p["c"], p["w"], p["r"], p["m"] = append(p["q"], t.Queue), append(p["c"], t.ClaimPull), append(p["w"], t.GPUWait), append(p["r"], t.Run), append(p["m"], t.Commit)
			}
		}
		b.Submit, b.Notify = percentiles(sub).P50, percentiles(not).P50
		for st, p := range parts {
			b.Stages[st] = StageTimes{Queue: percentiles(p["q"]).P50, ClaimPull: percentiles(p["c"]).P50, GPUWait: percentiles(p["w"]).P50,
				Run: percentiles(p["r"]).P50, Commit: percentiles(p["m"]).P50}
		}
		rep.Breakdown = append(rep.Breakdown, b)
	}
	return rep
}

func poolOf(a Agent) string {
	if len(a.Roles) == 3 {
		return "all"
	}
	return string(a.Roles[0])
}

// Text writes the report for a person.
func (rep *Report) Text(w io.Writer, sampleJobs int) {
	fmt.Fprintf(w, "bench serve: %s, %d simulated GPUs", rep.Topology, rep.GPUs)
	if rep.Pools != "" {
		fmt.Fprintf(w, ", pools E:D:V %s", rep.Pools)
	}
	fmt.Fprintf(w, "; time compressed %gx (reported times are simulated: wall x %g)", rep.Compression, rep.Compression)
	if rep.Topology == testbed.Colocated {
		fmt.Fprintf(w, "; colocated video decode tiling x%.2f", rep.Tiling)
	}
	fmt.Fprintf(w, "; scheduler %s, backpressure slack %d", rep.Scheduler, rep.Slack)
	if rep.Scheduler != "fifo" && rep.PreemptAfter > 0 {
		fmt.Fprintf(w, ", preempting batch work after %gs", rep.PreemptAfter)
	}
	fmt.Fprintln(w)
	switch {
	case rep.NoCheckpoints:
		fmt.Fprintln(w, "  step checkpoints: none (the GPUs cannot checkpoint: a preempted denoise is cancelled and starts over)")
	case rep.CheckpointEvery > 0:
		fmt.Fprintf(w, "  step checkpoints: every %d denoise steps, and where a preemption stops a denoise\n", rep.CheckpointEvery)
	default:
		fmt.Fprintln(w, "  step checkpoints: where a preemption stops a denoise (a preempted denoise resumes from its step)")
	}
	if rep.Prompts != nil {
		fmt.Fprintf(w, "  texts: %s (bench serve --help says why)\n", rep.Prompts)
	}
	fmt.Fprintf(w, "  text reuse in this trace: %.0f%% of prompts and %.0f%% of negative prompts an earlier request of the model had (an unbounded conditioning cache's hit rate)\n",
		100*rep.Reuse.Prompt, 100*rep.Reuse.Negative)
	fmt.Fprintf(w, "  conditioning cache: %s\n", rep.CondCache)
	for _, p := range rep.Payloads {
		fmt.Fprintf(w, "  payloads %-16s cond %s, latent %s", p.Model, size(p.CondBytes), size(p.LatentBytes))
		if rep.ByteScale > 1 {
			fmt.Fprintf(w, " (real sizes / %g)", rep.ByteScale)
		} else {
			fmt.Fprint(w, " (the model's real sizes)")
		}
		fmt.Fprintln(w)
	}
	weights := map[string]float64{}
	for _, a := range rep.Agents {
		weights[poolOf(a)] = a.WeightsGB
	}
	var pools []string
	for p, gb := range weights {
		pools = append(pools, fmt.Sprintf("%s %.1f GB", p, gb))
	}
	sort.Strings(pools)
	fmt.Fprintf(w, "  resident weights per GPU: %s\n", strings.Join(pools, ", "))
	fmt.Fprintf(w, "  makespan %.1f s\n\n", rep.Makespan)
	fmt.Fprintf(w, "%-28s %6s %5s %5s %6s %6s %9s %9s %7s %7s %7s\n", "class", "slo s", "jobs", "done", "in slo", "undone", "thru/min", "good/min", "p50 s", "p90 s", "p99 s")
	for _, c := range append(append([]ClassStats(nil), rep.Classes...), rep.All) {
		slo := fmt.Sprintf("%.0f", c.SLO)
		if c.Name == "all" {
			slo = ""
		}
		fmt.Fprintf(w, "%-28s %6s %5d %5d %6d %6d %9.2f %9.2f %7.1f %7.1f %7.1f\n", c.Name, slo, c.Submitted, c.Finished, c.MetSLO, c.Unfinished+c.Failed, c.Through, c.Goodput, c.Latency.P50, c.Latency.P90, c.Latency.P99)
	}
	if rep.VideoTTFF.N > 0 {
		fmt.Fprintf(w, "video time to first frame: p50 %.1f s, p90 %.1f s, p99 %.1f s\n", rep.VideoTTFF.P50, rep.VideoTTFF.P90, rep.VideoTTFF.P99)
	}
	fmt.Fprintf(w, "peak inputs waiting: denoise %d, decode %d\n", rep.PeakWaiting[jobs.Denoise], rep.PeakWaiting[jobs.Decode])
	var busy []string
	for p, b := range rep.GPUBusy {
		busy = append(busy, fmt.Sprintf("%s %.0f%%", p, 100*b))
	}
	sort.Strings(busy)
	fmt.Fprintf(w, "GPU busy: %s; overlapping spans on one GPU: %d\n", strings.Join(busy, ", "), rep.GPUOverlaps)
	fmt.Fprintf(w, "stages redone after a preemption or requeue: %d, %.1f GPU-s thrown away; %d denoises resumed from a step checkpoint, keeping %.1f GPU-s; %d checkpoints written",
		rep.RedoneStages, rep.RedoneGPU, rep.ResumedStages, rep.KeptGPU, rep.Checkpoints)
	if rep.ResumeMismatches > 0 {
		fmt.Fprintf(w, "; %d resumes did not start at their checkpoint's next step", rep.ResumeMismatches)
	}
	fmt.Fprintln(w)
	rep.Claims.Text(w)
	fmt.Fprintf(w, "etcd requests per job %.1f (%s)\n\n", rep.EtcdOpsPerJob, opsText(rep.EtcdOps))

	fmt.Fprintf(w, "per-job breakdown, class medians, simulated s (queue / claim+pull / gpu wait / run / commit per stage)\n")
	for _, b := range rep.Breakdown {
		fmt.Fprintf(w, "  %-26s submit %.3f  %s  notify %.3f\n", b.Class, b.Submit, stagesText(b.Stages), b.Notify)
	}
	if sampleJobs > 0 {
		fmt.Fprintf(w, "sample jobs:\n")
		step := max(1, len(rep.Jobs)/sampleJobs)
		for k := 0; k < len(rep.Jobs) && k/step < sampleJobs; k += step {
			j := rep.Jobs[k]
			if j.Error != "" {
				fmt.Fprintf(w, "  %-20s %-26s error: %s\n", j.ID, j.Class, j.Error)
				continue
			}
			fmt.Fprintf(w, "  %-20s %-26s total %.2f  submit %.3f  %s  notify %.3f\n", j.ID, j.Class, j.Latency, j.Submit, stagesText(j.Stages), j.Notify)
		}
	}
}

// Text writes the claims as a table, a row a stage.
func (c ClaimStats) Text(w io.Writer) {
	fmt.Fprintf(w, "claims, from the agents' counters (per job: per submitted job; txns: dispatchers' hand-ons of waiting tasks; pushed: share of the claims made with their task, not handed on later)\n")
	fmt.Fprintf(w, "  %-8s %6s %9s %7s %10s %11s %9s %13s %14s %14s %7s\n", "stage", "txns", "conflicts", "pushed", "given back", "handed over", "txns/job", "conflicts/job", "give-backs/job", "hand-overs/job", "pushed")
	for _, s := range append(append([]StageClaims(nil), c.Stages...), c.All) {
		fmt.Fprintf(w, "  %-8s %6d %9d %7d %10d %11d %9.2f %13.2f %14.2f %14.2f %6.0f%%\n", s.Stage, s.Txns, s.Conflicts, s.PushedStarted, s.GivenBack, s.HandedOver,
			s.TxnsPerJob, s.ConflictsPerJob, s.GiveBacksPerJob, s.HandOversPerJob, 100*s.PushedShare)
	}
}

func stagesText(m map[jobs.Stage]StageTimes) string {
	var parts []string
	for _, st := range jobs.Stages() {
		t, ok := m[st]
		if !ok {
			continue
		}
		part := fmt.Sprintf("%s %.3f/%.3f/%.3f/%.3f/%.3f", st, t.Queue, t.ClaimPull, t.GPUWait, t.Run, t.Commit)
		if t.Redone > 0 {
			part += fmt.Sprintf(" (redone %.3f)", t.Redone)
		}
		if t.ResumedFrom > 0 {
			part += fmt.Sprintf(" (resumed at step %d)", t.ResumedFrom)
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, "  ")
}

func opsText(ops map[string]int64) string {
	var keys []string
	for k := range ops {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, ops[k]))
	}
	return strings.Join(parts, ", ")
}

func size(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// count adds finished job j's encode to the figures.
func (c *CondCacheStats) count(j jobs.Job) {
	c.Jobs++
	enc := j.Stages[jobs.Encode]
	if enc == nil {
		return
	}
	if enc.Cached {
		c.Skipped++
		c.PromptHits++
		c.NegativeHits++
		return
	}
	for _, h := range enc.CacheHits {
		switch h {
		case "prompt":
			c.PromptHits++
		case "negative":
			c.NegativeHits++
		case "conditioning":
			c.PromptHits++
			c.NegativeHits++
		}
	}
}

func (c CondCacheStats) String() string {
	pct := func(n int) float64 { return 100 * float64(n) / float64(max(c.Jobs, 1)) }
	on := "on"
	if c.Off {
		on = "off"
	}
	return fmt.Sprintf("%s: %d of %d finished jobs skipped encode, %.0f%% prompt hits, %.0f%% negative-prompt hits; encode GPU time %.1f s",
		on, c.Skipped, c.Jobs, pct(c.PromptHits), pct(c.NegativeHits), c.EncodeGPU)
}
