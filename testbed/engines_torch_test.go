package testbed

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"image/color"
	"image/png"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

const torchModel = "latentmesh-tiny-torch"

// torchWeights writes the tiny pipeline's seeded weights (a safetensors
// file) and returns its path; it skips the test where torch is missing.
func torchWeights(t testing.TB) string {
	t.Helper()
	if why := PythonWorkerMissing("torch"); why != "" {
		t.Skip(why)
	}
	path := filepath.Join(t.TempDir(), "tiny.safetensors")
	out, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--write-weights", path).CombinedOutput()
	if err != nil {
		t.Fatalf("write weights: %v\n%s", err, out)
	}
	return path
}

// torchMesh starts agents whose stages the torch worker serves, one worker
// process per agent (each serving its agent's roles).
func torchMesh(t testing.TB, ctx context.Context, weights string, stepMS int, ids map[string]jobs.Stage) (*Cluster, map[string]*agent.Agent, map[string]*Worker) {
	t.Helper()
	return torchMeshOut(t, ctx, weights, stepMS, ids, func(string) io.Writer { return workerLog{t} })
}

// torchMeshOut is torchMesh with each worker's output going to out(id).
func torchMeshOut(t testing.TB, ctx context.Context, weights string, stepMS int, ids map[string]jobs.Stage, out func(id string) io.Writer) (*Cluster, map[string]*agent.Agent, map[string]*Worker) {
	t.Helper()
	return torchMeshArgs(t, ctx, weights, stepMS, ids, out, nil)
}

// torchMeshArgs is torchMeshOut with more arguments for some workers.
func torchMeshArgs(t testing.TB, ctx context.Context, weights string, stepMS int, ids map[string]jobs.Stage, out func(id string) io.Writer, args map[string][]string) (*Cluster, map[string]*agent.Agent, map[string]*Worker) {
	t.Helper()
	return torchMeshConfig(t, ctx, weights, stepMS, ids, out, args, func(*agent.Config) {})
}

// torchMeshConfig is torchMeshArgs with each agent's config changed by
// tweak.
func torchMeshConfig(t testing.TB, ctx context.Context, weights string, stepMS int, ids map[string]jobs.Stage, out func(id string) io.Writer, args map[string][]string, tweak func(*agent.Config)) (*Cluster, map[string]*agent.Agent, map[string]*Worker) {
	t.Helper()
	cfg := DefaultClusterConfig()
	cfg.Topology = ""
	cfg.Logger = testLogger(t)
	cfg.Agent.TransferMode = jobs.P2P
	c, err := StartCluster(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	dir := t.TempDir()
	agents, workers := map[string]*agent.Agent{}, map[string]*Worker{}
	for id, st := range ids {
		ac := c.cfg.Agent
		ac.NodeID, ac.Roles, ac.Logger = id, []jobs.Stage{st}, c.cfg.Logger
		ac.External.Socket = filepath.Join(dir, id+".sock")
		tweak(&ac)
		a, err := c.AddAgentConfig(ctx, ac)
		if err != nil {
			t.Fatal(err)
		}
		agents[id] = a
		workers[id] = startEngineOut(t, ctx, a, out(id), WorkerScript("torch_pipeline.py"),
			append([]string{"--weights", weights, "--stages", string(st), "--step-ms", fmt.Sprint(stepMS)}, args[id]...)...)
	}
	eventually(t, 30*time.Second, func() error {
		for id, a := range agents {
			if !a.ModelServed(torchModel) {
				return fmt.Errorf("%s does not see every stage of %s served yet", id, torchModel)
			}
		}
		return nil
	})
	return c, agents, workers
}

type imageReq struct {
	Model  string `json:"model"`
	Prompt string `json:"prompt"`
	Size   string `json:"size"`
	Seed   int64  `json:"seed"`
	Steps  int    `json:"num_inference_steps,omitempty"` // 0: the model's registered default
}

// generate posts one OpenAI images request and returns the PNG.
func generate(ctx context.Context, addr string, q imageReq) ([]byte, string, error) {
	body, _ := json.Marshal(q)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/images/generations", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	var r httpapi.ImagesResponse
	if resp.StatusCode != http.StatusOK {
		var e bytes.Buffer
		e.ReadFrom(resp.Body)
		return nil, "", fmt.Errorf("status %d: %s", resp.StatusCode, e.String())
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || len(r.Data) != 1 {
		return nil, "", fmt.Errorf("response: %v (%d images)", err, len(r.Data))
	}
	png, err := base64.StdEncoding.DecodeString(r.Data[0].B64JSON)
	return png, r.Data[0].Latentmesh.JobID, err
}

// rgba decodes a PNG into RGBA bytes, row by row.
func rgba(t *testing.T, b []byte) []byte {
	t.Helper()
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("not a valid PNG: %v", err)
	}
	r := img.Bounds()
	out := make([]byte, 0, 4*r.Dx()*r.Dy())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			c := color.NRGBAModel.Convert(img.At(x, y))
			cr, cg, cb, ca := c.RGBA()
			out = append(out, byte(cr>>8), byte(cg>>8), byte(cb>>8), byte(ca>>8))
		}
	}
	return out
}

// Criterion: a mesh of three agents whose stages the PyTorch worker
// serves (one worker process per agent) completes 20 jobs through the
// OpenAI images API; each output is a valid PNG, deterministic for its
// seed, and pixel-for-pixel equal (max abs difference 0) to the same torch
// pipeline run in one Python process without latentmesh.
func TestTorchMeshMatchesSingleProcess(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, agents, _ := torchMesh(t, ctx, weights, 0, map[string]jobs.Stage{"encode-t": jobs.Encode, "denoise-t": jobs.Denoise, "decode-t": jobs.Decode})
	entry := agents["encode-t"].HTTPAddr()

	const jobsN, distinct = 20, 5 // seeds repeat, so determinism is checked across jobs
	prompts := []string{"a red fox in a snowy forest", "a lighthouse at dusk", "ocean waves", "a bowl of fruit", "mountains"}
	start := time.Now()
	got := make([][]byte, jobsN)
	for i := range jobsN {
		q := imageReq{Model: torchModel, Prompt: prompts[i%distinct], Size: "64x64", Seed: int64(100 + i%distinct), Steps: 10}
		png, _, err := generate(ctx, entry, q)
		if err != nil {
			t.Fatalf("job %d: %v", i, err)
		}
		got[i] = rgba(t, png)
	}
	t.Logf("%d jobs through the mesh in %v", jobsN, time.Since(start).Round(time.Millisecond))

	// A request without steps gets the model's default as the engine
	// registered it (12), not the built-in model's (20).
	_, id, err := generate(ctx, entry, imageReq{Model: torchModel, Prompt: "a default", Size: "64x64", Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	job, err := (&httpapi.Client{BaseURL: "http://" + entry}).Get(ctx, id)
	if err != nil || job.Spec.Steps != 12 {
		t.Fatalf("job without steps ran %d steps (%v), want the model's default 12", job.Spec.Steps, err)
	}
	for i := distinct; i < jobsN; i++ {
		if !bytes.Equal(got[i], got[i%distinct]) {
			t.Errorf("job %d and job %d (same spec and seed) differ", i, i%distinct)
		}
	}

	// The same pipeline in one process, without latentmesh.
	var specs []map[string]any
	for i := range distinct {
		specs = append(specs, map[string]any{"prompt": prompts[i], "seed": 100 + i, "width": 64, "height": 64, "steps": 10, "guidance_scale": 5.0})
	}
	js, _ := json.Marshal(specs)
	ref := filepath.Join(t.TempDir(), "ref.rgba")
	if out, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--reference", string(js), ref).CombinedOutput(); err != nil {
		t.Fatalf("reference run: %v\n%s", err, out)
	}
	want, err := os.ReadFile(ref)
	if err != nil {
		t.Fatal(err)
	}
	n := 64 * 64 * 4
	if len(want) != distinct*n {
		t.Fatalf("reference wrote %d bytes, want %d", len(want), distinct*n)
	}
	for i := range distinct {
		maxDiff := 0
		for k, b := range got[i] {
			maxDiff = max(maxDiff, absDiff(b, want[i*n+k]))
		}
		if maxDiff != 0 {
			t.Errorf("job %d (%q): max abs pixel difference %d from the single-process pipeline, want 0", i, prompts[i], maxDiff)
		}
	}
	if varied := bytes.Count(got[0], got[0][:4]); varied == n/4 {
		t.Error("the image is one flat colour: the pipeline drew nothing")
	}
}

func absDiff(a, b byte) int {
	if a > b {
		return int(a - b)
	}
	return int(b - a)
}

// Criteria: `engine check` passes against both reference workers (the
// torch worker stopping a 50-step denoise within one step of a cancel
// after step 10, and its video model passing the shape checks; the numpy
// decoder as a protocol v1 engine), and fails, with a clear line, against
// a worker that ignores cancellation.
func TestEngineCheck(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	run := func(name string, command ...string) ([]extengine.CheckResult, bool, string) {
		cfg := extengine.DefaultCheckConfig(filepath.Join(t.TempDir(), "check.sock"))
		cfg.Command = command
		cfg.Logger = testLogger(t)
		var out bytes.Buffer
		res, ok, err := extengine.Check(ctx, cfg, &out)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s:\n%s", name, out.String())
		return res, ok, out.String()
	}
	find := func(res []extengine.CheckResult, name string) extengine.CheckResult {
		for _, r := range res {
			if r.Name == name {
				return r
			}
		}
		t.Fatalf("no %q check in %v", name, res)
		return extengine.CheckResult{}
	}

	// The numpy decoder is a protocol v1 engine: it passes as before.
	res, ok, _ := run("numpy decoder", SystemPython, WorkerScript("numpy_decoder.py"))
	if !ok || !find(res, "crash restart").Pass || !find(res, "malformed input").Pass {
		t.Errorf("numpy decoder fails the check: %v", res)
	}
	if reg, v2 := find(res, "register"), find(res, "protocol v2"); !strings.Contains(reg.Detail, "protocol v1") || !v2.Skip {
		t.Errorf("numpy decoder: %s; %s; want a v1 session and the v2 checks skipped", reg, v2)
	}

	res, ok, _ = run("torch pipeline", SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--step-ms", "20")
	if !ok {
		t.Errorf("torch worker fails the check: %v", res)
	}
	c := find(res, "cancel mid-denoise")
	if !c.Pass || c.CancelStep != 10 || c.LastStep > c.CancelStep+1 {
		t.Errorf("50-step torch denoise cancelled after step %d stopped at step %d; want step 10 and at most 11 (%s)", c.CancelStep, c.LastStep, c.Detail)
	}
	// Protocol v2: the torch worker checkpoints, resumes, stops and caches
	// its negative branch, and resumes a killed process's checkpoint.
	for _, name := range []string{"checkpoint", "resume", "stop", "tensor cache"} {
		if r := find(res, name); !r.Pass {
			t.Errorf("torch worker, v2: %s", r)
		}
	}
	// Its video model's shapes (issue 20): named tensors, a temporal
	// latent decoded chunk by chunk, a reference image, a parameter.
	for _, name := range []string{"named conditioning", "temporal latent", "image input", "params"} {
		if r := find(res, name); !r.Pass {
			t.Errorf("torch worker, model shapes: %s", r)
		}
	}
	if r := find(res, "crash restart"); !strings.Contains(r.Detail, "resumed the killed process's checkpoint") {
		t.Errorf("torch worker: %s; want the restarted process to resume the killed one's checkpoint", r)
	}

	res, ok, out := run("broken worker", SystemPython, filepath.Join("testdata", "broken_worker.py"))
	if ok {
		t.Fatalf("the check passed a worker that ignores cancellation:\n%s", out)
	}
	if !strings.Contains(out, "FAIL  cancel mid-denoise: cancelled after step 10 of 50, but the engine went on to step 50 (it must stop within one step)") {
		t.Errorf("the broken worker's failure line is missing or unclear:\n%s", out)
	}
	_ = res
}

// failoverMesh is the torch mesh of the failover tests: an encode and a
// decode agent and two denoise agents, denoise-a and denoise-b, each with
// an engine of its own at 100 ms a step (time to kill one mid-denoise).
func failoverMesh(t *testing.T, ctx context.Context, weights string) (map[string]*agent.Agent, map[string]*Worker) {
	t.Helper()
	_, agents, workers := torchMesh(t, ctx, weights, 100, map[string]jobs.Stage{
		"encode-t": jobs.Encode, "denoise-a": jobs.Denoise, "denoise-b": jobs.Denoise, "decode-t": jobs.Decode})
	return agents, workers
}

// finishTorchJob waits at entry for job id to succeed and returns it with
// its file.
func finishTorchJob(t *testing.T, ctx context.Context, entry *agent.Agent, id string) (jobs.Job, []byte) {
	t.Helper()
	j, err := entry.Wait(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if j.State != jobs.Succeeded {
		t.Fatalf("job %s: %s %+v", id, j.State, j.Error)
	}
	data, _, err := entry.Result(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return j, data
}

// killDenoiseEngine waits for job id's denoise (on a failoverMesh) to
// pass step, then kills the engine running it; it returns that agent and
// the other denoise agent.
func killDenoiseEngine(t *testing.T, ctx context.Context, entry *agent.Agent, id string, workers map[string]*Worker, step int) (victim, survivor string) {
	t.Helper()
	eventually(t, time.Minute, func() error {
		j, err := entry.Get(ctx, id)
		if err != nil {
			return err
		}
		if p := j.Progress; p != nil && p.Stage == jobs.Denoise && p.Step >= step {
			victim = p.Node
			return nil
		}
		return fmt.Errorf("denoise not past step %d: %+v", step, j.Progress)
	})
	survivor = map[string]string{"denoise-a": "denoise-b", "denoise-b": "denoise-a"}[victim]
	if survivor == "" {
		t.Fatalf("denoise runs on %q", victim)
	}
	workers[victim].Kill()
	return victim, survivor
}

// Criterion: kill -9 an engine mid-denoise: the task completes on another
// agent's engine, the job succeeds once, and the dead engine's agent claims
// nothing until a new engine registers.
func TestEngineCrashFailsOver(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// 100 ms per step: a 30-step denoise takes 3 s, time to kill it midway.
	agents, workers := failoverMesh(t, ctx, weights)
	entry := agents["encode-t"]
	spec := engine.Spec{Model: torchModel, Prompt: "a red fox", Seed: 11, Width: 64, Height: 64, Frames: 1, Steps: 30, GuidanceScale: 5}
	submit := func() string {
		j, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		return j.ID
	}
	finish := func(id string) (jobs.Job, []byte) {
		j, data := finishTorchJob(t, ctx, entry, id)
		rgba(t, data) // a valid PNG
		return j, data
	}

	id := submit()
	victim, other := killDenoiseEngine(t, ctx, entry, id, workers, 3)
	t.Logf("killed %s's engine mid-denoise", victim)

	j, first := finish(id)
	if n := j.Stages[jobs.Denoise].Node; n != other {
		t.Errorf("denoise committed by %s, want %s (the survivor)", n, other)
	}
	if a := j.Stages[jobs.Denoise].Attempt; a < 2 {
		t.Errorf("denoise committed at attempt %d: the killed engine's claim was not counted", a)
	}
	if a := j.Stages[jobs.Decode].Attempt; a != 1 || j.Rewinds != 0 {
		t.Errorf("decode attempt %d, rewinds %d: want the job to succeed once", a, j.Rewinds)
	}
	if agents[victim].Engine() != nil {
		t.Errorf("%s still has an engine registered after the kill", victim)
	}

	// With no engine, the victim claims nothing: the next job goes to the
	// survivor, and gives the same bytes (same spec and seed).
	j2, second := finish(submit())
	if n := j2.Stages[jobs.Denoise].Node; n != other {
		t.Errorf("with %s's engine dead, denoise ran on %s", victim, n)
	}
	if !bytes.Equal(first, second) {
		t.Error("the failed-over job and a clean run of the same spec differ")
	}

	// A new engine registers on the victim; with the survivor's engine
	// gone, the victim takes the next job.
	workers[victim] = startEngine(t, ctx, agents[victim], WorkerScript("torch_pipeline.py"), "--weights", weights, "--stages", "denoise", "--step-ms", "10")
	workers[other].Kill()
	j3, third := finish(submit())
	if n := j3.Stages[jobs.Denoise].Node; n != victim {
		t.Errorf("after its engine restarted, denoise ran on %s, want %s", n, victim)
	}
	if !bytes.Equal(first, third) {
		t.Error("the restarted engine's output differs")
	}
}

// lineTap passes a worker's output to the test log and hands lines that
// contain match to a channel.
type lineTap struct {
	t     *testing.T
	match string
	lines chan string
}

func (w lineTap) Write(p []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Logf("worker: %s", l)
		if strings.Contains(l, w.match) {
			select {
			case w.lines <- l:
			default:
			}
		}
	}
	return len(p), nil
}

// Criterion: cancel a 50-step torch job at step 10 through the API: the
// engine stops at a step boundary. The exact "within one step" bound is
// TestEngineCheck's (it sees every step the engine reports); through the
// mesh the test sees the step as the agent reports it (live progress,
// polled), which lags the engine by up to a poll, so this bounds the
// overrun by that lag plus one step, and the stop by one step's time plus
// the cancel's way through etcd and the socket.
func TestCancelTorchJobMidDenoise(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	tap := lineTap{t: t, match: "cancelled after step", lines: make(chan string, 1)}
	_, agents, _ := torchMeshOut(t, ctx, weights, 100, map[string]jobs.Stage{"encode-t": jobs.Encode, "denoise-t": jobs.Denoise, "decode-t": jobs.Decode},
		func(id string) io.Writer {
			if id == "denoise-t" {
				return tap
			}
			return workerLog{t}
		})
	entry := agents["encode-t"]
	spec := engine.Spec{Model: torchModel, Prompt: "a long job", Seed: 3, Width: 64, Height: 64, Frames: 1, Steps: 50, GuidanceScale: 5}
	j, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	eventually(t, time.Minute, func() error {
		got, err := entry.Get(ctx, j.ID)
		if err != nil {
			return err
		}
		if p := got.Progress; p != nil && p.Stage == jobs.Denoise && p.Step >= 10 {
			seen = p.Step
			return nil
		}
		return fmt.Errorf("denoise at %+v", got.Progress)
	})
	start := time.Now()
	if _, err := entry.Cancel(ctx, j.ID); err != nil {
		t.Fatal(err)
	}
	var line string
	select {
	case line = <-tap.lines:
	case <-time.After(30 * time.Second):
		t.Fatal("the engine never reported stopping the cancelled task")
	}
	took := time.Since(start)
	var step, total int
	if _, err := fmt.Sscanf(line[strings.Index(line, "after step"):], "after step %d of %d", &step, &total); err != nil {
		t.Fatalf("cancel line %q: %v", line, err)
	}
	t.Logf("progress showed step %d; cancelled; the engine stopped after step %d of %d, %v after the cancel", seen, step, total, took.Round(time.Millisecond))
	if total != 50 || step > seen+3 {
		t.Errorf("engine stopped after step %d of %d; progress showed %d at the cancel: want a stop within one step of the cancel reaching it (<= %d)", step, total, seen, seen+3)
	}
	if took > 3*time.Second { // one 100 ms step, plus etcd and the socket, under a loaded CI machine
		t.Errorf("the engine took %v to stop after the cancel; a step is 100 ms", took)
	}
	final, err := entry.Wait(ctx, j.ID)
	if err != nil || final.State != jobs.Cancelled {
		t.Errorf("job after cancel: %s, %v", final.State, err)
	}
}

// Criteria (issue 19, protocol v2): (a) kill -9 the torch engine of the
// agent running a denoise with checkpoint_every set: the other denoise
// agent's engine resumes the task from the newest checkpoint (the stage
// record's resumed_from says so) and the file is byte-identical to an
// uninterrupted run; (b) two jobs sharing a negative prompt: the second
// gets its keys and values from the denoise agent's tensor cache (a hit in
// its metrics), each file byte-identical to an uncached run. One mesh for
// both: (b) runs where (a) left the only engine.
func TestTorchEngineCheckpointsAndTensorCache(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// 100 ms a step: a 12-step denoise takes over a second, time to see
	// step 4 and kill its engine before the last step.
	agents, workers := failoverMesh(t, ctx, weights)
	entry := agents["encode-t"]
	finish := func(id string) (jobs.Job, []byte) {
		t.Helper()
		j, data := finishTorchJob(t, ctx, entry, id)
		return j, rgba(t, data)
	}
	specs := []engine.Spec{
		{Model: torchModel, Prompt: "a red fox", Seed: 11, Width: 64, Height: 64, Frames: 1, Steps: 12, GuidanceScale: 5},
		{Model: torchModel, Prompt: "a lighthouse", NegativePrompt: "blurry, low quality", Seed: 12, Width: 64, Height: 64, Frames: 1, Steps: 4, GuidanceScale: 5},
		{Model: torchModel, Prompt: "ocean waves", NegativePrompt: "blurry, low quality", Seed: 13, Width: 64, Height: 64, Frames: 1, Steps: 4, GuidanceScale: 5},
	}
	want := torchReference(t, weights, specs)

	// (a) Checkpoints every 3 steps; the engine killed at step 4 or later.
	every := 3
	j, err := entry.Submit(ctx, specs[0], jobs.Options{Checkpointing: &jobs.Checkpointing{Every: &every}})
	if err != nil {
		t.Fatal(err)
	}
	victim, survivor := killDenoiseEngine(t, ctx, entry, j.ID, workers, 4)
	done, got := finish(j.ID)
	d := done.Stages[jobs.Denoise]
	if d.Node != survivor || d.Attempt < 2 || d.ResumedFrom < every || d.ResumedFrom%every != 0 || d.ResumedFrom >= specs[0].Steps {
		t.Fatalf("denoise stage %+v: want it committed by %s on a later attempt, resumed from a checkpoint (a multiple of %d, at least %d)", d, survivor, every, every)
	}
	t.Logf("engine of %s killed; %s resumed from step %d", victim, survivor, d.ResumedFrom)
	if !bytes.Equal(got, want[0]) {
		t.Fatal("the resumed job's image differs from an uninterrupted run")
	}

	// (b) The same negative prompt twice, on the one engine left.
	admin := agents[survivor].AdminAddr()
	kv := func() (hits, misses float64) {
		mf := families(t, scrapeMetrics(t, admin))
		hits, _ = sample(mf, "latentmesh_kv_cache_hits_total", nil)
		misses, _ = sample(mf, "latentmesh_kv_cache_misses_total", nil)
		return hits, misses
	}
	hits0, misses0 := kv()
	for i, s := range specs[1:] {
		j, err := entry.Submit(ctx, s, jobs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		done, got := finish(j.ID)
		if n := done.Stages[jobs.Denoise].Node; n != survivor {
			t.Fatalf("job %d denoised on %s, want %s (the only engine left)", i+1, n, survivor)
		}
		if !bytes.Equal(got, want[i+1]) {
			t.Fatalf("job %d (%q): the image differs from an uncached single-process run", i+1, s.Prompt)
		}
	}
	hits, misses := kv()
	if hits-hits0 != 1 || misses-misses0 != 1 {
		t.Fatalf("tensor cache on %s: %v hits, %v misses for two jobs sharing a negative prompt; want the first to miss and the second to hit", survivor, hits-hits0, misses-misses0)
	}
}

// torchReference runs specs through the torch pipeline in one process,
// without latentmesh (its --reference mode, which caches nothing and never
// checkpoints), and returns each one's RGBA bytes.
func torchReference(t *testing.T, weights string, specs []engine.Spec) [][]byte {
	t.Helper()
	var in []map[string]any
	n := 0
	for _, s := range specs {
		in = append(in, map[string]any{"prompt": s.Prompt, "negative_prompt": s.NegativePrompt, "seed": s.Seed,
			"width": s.Width, "height": s.Height, "frames": s.Frames, "steps": s.Steps, "guidance_scale": s.GuidanceScale})
		n += 4 * s.Width * s.Height * s.Frames
	}
	js, _ := json.Marshal(in)
	path := filepath.Join(t.TempDir(), "ref.rgba")
	if out, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--reference", string(js), path).CombinedOutput(); err != nil {
		t.Fatalf("reference run: %v\n%s", err, out)
	}
	all, err := os.ReadFile(path)
	if err != nil || len(all) != n {
		t.Fatalf("reference wrote %d bytes (%v), want %d", len(all), err, n)
	}
	out := make([][]byte, len(specs))
	for i, s := range specs {
		k := 4 * s.Width * s.Height * s.Frames
		out[i], all = all[:k], all[k:]
	}
	return out
}
