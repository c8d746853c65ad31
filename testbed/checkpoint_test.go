package testbed

import (
	"bytes"
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// kill -9 of a denoise agent at step 35 of 50 with checkpoint_every=10:
// the job resumes on the other denoise agent from step 30 (its stage
// record says so), the file is byte-identical to an uninterrupted run,
// and the denoise commit releases the checkpoints.
func TestKillDenoiseResumesFromCheckpoint(t *testing.T) {
	m := startMesh(t)
	_, enc := m.agent("enc-c", "encode")
	m.agent("dec-c", "decode")
	victim, _ := m.agent("den-victim", "denoise", "--sim-cost", "step=120ms")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	w, h, steps, every := 64, 64, 50, 10
	seed := int64(35)
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a lighthouse on a cliff", Seed: &seed, Width: &w, Height: &h, Steps: &steps, CheckpointEvery: &every})
	if err != nil {
		t.Fatal(err)
	}
	waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool {
		return p.Stage == jobs.Denoise && p.Node == "den-victim" && p.Step >= 35
	})
	victim.Kill()
	m.agent("den-heir", "denoise", "--sim-cost", "step=20ms")

	done := waitSucceededAt(t, ctx, c, job.ID)
	d := done.Stages[jobs.Denoise]
	if d.Node != "den-heir" || d.Attempt != 2 || d.ResumedFrom != 30 {
		t.Fatalf("denoise stage = %+v, want committed by den-heir on attempt 2, resumed from step 30", d)
	}
	// The heir ran steps 31..50 and checkpointed at 40 (and no further).
	if d.Checkpoints != 1 {
		t.Fatalf("the resumed attempt wrote %d checkpoints, want 1 (step 40)", d.Checkpoints)
	}
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := referenceOutput(t, engine.Spec{Prompt: "a lighthouse on a cliff", Seed: seed, Width: w, Height: h, Steps: steps}.WithDefaults())
	if !bytes.Equal(data, want) {
		t.Fatal("the resumed job's file differs from an uninterrupted run")
	}
	m.checkResultOnce(ctx, done)
	left, err := m.cli.Get(ctx, "/latentmesh/default/objects/"+jobs.CheckpointsOf(job.ID), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if left.Count != 0 {
		t.Fatalf("%d checkpoint records left after the denoise committed", left.Count)
	}
}

// A fork from step 20 with a new prompt gives the file of a run that does
// its first 20 steps with the old prompt and the rest with the new one.
func TestForkFromStep(t *testing.T) {
	cl := startCluster(t, Disaggregated, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + cl.Agents[0].HTTPAddr()}
	w, h, steps, every := 64, 64, 40, 10
	seed := int64(20)
	orig, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a red barn in snow", Seed: &seed, Width: &w, Height: &h, Steps: &steps,
		CheckpointEvery: &every, KeepCheckpoints: "10m"})
	if err != nil {
		t.Fatal(err)
	}
	if j := waitSucceeded(t, ctx, cl.Agents[0], orig.ID); j.Stages[jobs.Denoise].Checkpoints != 3 {
		t.Fatalf("the job wrote %d checkpoints, want 3 (steps 10, 20, 30)", j.Stages[jobs.Denoise].Checkpoints)
	}
	if _, err := c.Fork(ctx, orig.ID, httpapi.ForkRequest{FromStep: 25}); err == nil {
		t.Fatal("a fork from step 25, which has no checkpoint, was accepted")
	}
	newPrompt := "a blue boat at sea"
	fork, err := c.Fork(ctx, orig.ID, httpapi.ForkRequest{FromStep: 20, Prompt: &newPrompt})
	if err != nil {
		t.Fatal(err)
	}
	fj := waitSucceeded(t, ctx, cl.Agents[0], fork.ID)
	if d := fj.Stages[jobs.Denoise]; d.ResumedFrom != 20 {
		t.Fatalf("fork's denoise stage = %+v, want resumed from step 20", d)
	}
	got, _, err := c.Result(ctx, fork.ID)
	if err != nil {
		t.Fatal(err)
	}

	// The reference: steps 1-20 on the old prompt, 21-40 on the new, in one
	// engine.
	e, err := engine.New(engine.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	old := engine.Spec{Prompt: "a red barn in snow", Seed: seed, Width: w, Height: h, Steps: steps}.WithDefaults()
	cur := old
	cur.Prompt = newPrompt
	var at20 *engine.Checkpoint
	condOld, err := e.Encode(ctx, old)
	if err != nil {
		t.Fatal(err)
	}
	lat := make([]byte, e.LatentMeta(old).Bytes())
	if _, err := e.DenoiseWith(ctx, old, condOld, lat, engine.DenoiseOptions{CheckpointEvery: 20, Checkpoint: func(ck engine.Checkpoint) { at20 = &ck }}); err != nil || at20 == nil {
		t.Fatalf("reference first half: %v (checkpoint %v)", err, at20 != nil)
	}
	condNew, err := e.Encode(ctx, cur)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.DenoiseWith(ctx, cur, condNew, lat, engine.DenoiseOptions{Resume: at20}); err != nil {
		t.Fatal(err)
	}
	want, _, err := e.Decode(ctx, cur, engine.Tensor{Meta: e.LatentMeta(cur), Data: lat})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the fork's file differs from 20 steps of the old prompt and 20 of the new")
	}
	if bytes.Equal(got, referenceOutput(t, cur)) {
		t.Fatal("the fork's file equals a fresh run of the new prompt: the first 20 steps were not the old prompt's")
	}
}

// The negative prompt's attention keys and values are computed once per
// denoise agent and reused by later requests with the same negative
// prompt, whatever their prompts, with no change to their files.
func TestKVCacheAcrossRequests(t *testing.T) {
	cl := startCluster(t, Disaggregated, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	entry := cl.Agents[0]
	var den string
	for _, a := range cl.Agents {
		if a.ID() == string(jobs.Denoise)+"-1" {
			den = a.AdminAddr()
		}
	}
	if den == "" {
		t.Fatal("no denoise agent")
	}
	specs := []engine.Spec{
		{Prompt: "a red fox", NegativePrompt: "blurry, low quality", Seed: 1, Width: 64, Height: 64, Steps: 4},
		{Prompt: "a green field", NegativePrompt: "blurry, low quality", Seed: 2, Width: 64, Height: 64, Steps: 4},
		{Prompt: "a grey city", NegativePrompt: "text, watermark", Seed: 3, Width: 64, Height: 64, Steps: 4},
	}
	for _, s := range specs {
		s = s.WithDefaults()
		j, err := entry.Submit(ctx, s, jobs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		waitSucceeded(t, ctx, entry, j.ID)
		data, _, err := entry.Result(ctx, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data, referenceOutput(t, s)) { // the reference caches nothing
			t.Fatalf("%q: the file differs from an uncached run", s.Prompt)
		}
	}
	mf := families(t, scrapeMetrics(t, den))
	hits, _ := sample(mf, "latentmesh_kv_cache_hits_total", nil)
	misses, _ := sample(mf, "latentmesh_kv_cache_misses_total", nil)
	held, _ := sample(mf, "latentmesh_kv_cache_bytes", nil)
	if hits != 1 || misses != 2 || held <= 0 {
		t.Fatalf("tensor cache: %v hits, %v misses, %v bytes; want 1 hit (the repeated negative prompt), 2 misses, entries held", hits, misses, held)
	}
}
