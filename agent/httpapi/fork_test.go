package httpapi

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

func TestCheckpointFieldsReachTheJob(t *testing.T) {
	f := newFakeJobs(false)
	h := NewHandler(testConfig(t), f)
	w := do(h, http.MethodPost, "/v1/jobs", "application/json", `{"prompt":"a red fox","steps":40,"checkpoint_every":10,"keep_checkpoints":"2h"}`)
	if w.Code != http.StatusAccepted {
		t.Fatalf("submit: %d %s", w.Code, w.Body)
	}
	j := f.jobs["job-1"]
	if k := j.Checkpointing; k == nil || k.Every == nil || *k.Every != 10 || k.Keep != 2*time.Hour {
		t.Fatalf("checkpointing = %+v, want every 10, keep 2h", j.Checkpointing)
	}
	for body, param := range map[string]string{
		`{"prompt":"x","steps":20,"checkpoint_every":20}`:    "checkpoint_every", // not fewer than the steps
		`{"prompt":"x","steps":20,"checkpoint_every":-1}`:    "checkpoint_every",
		`{"prompt":"x","keep_checkpoints":"forever"}`:        "keep_checkpoints",
		`{"prompt":"x","keep_checkpoints":"9000h"}`:          "keep_checkpoints", // past MaxCheckpointKeep
		`{"prompt":"x","steps":20,"keep_checkpoints":"-1h"}`: "keep_checkpoints",
	} {
		w := do(h, http.MethodPost, "/v1/jobs", "application/json", body)
		if w.Code != http.StatusBadRequest {
			t.Fatalf("%s: %d %s, want 400", body, w.Code, w.Body)
		}
		if e := decodeAPIError(t, w); e.Param != param {
			t.Fatalf("%s: param %q, want %q (%s)", body, e.Param, param, e.Message)
		}
	}
}

func TestForkFromACheckpoint(t *testing.T) {
	f := newFakeJobs(false)
	h := NewHandler(testConfig(t), f)
	if w := do(h, http.MethodPost, "/v1/jobs", "application/json",
		`{"prompt":"a red fox","negative_prompt":"blur","seed":7,"steps":40,"guidance_scale":6,"checkpoint_every":10,"keep_checkpoints":"1h"}`); w.Code != http.StatusAccepted {
		t.Fatalf("submit: %d %s", w.Code, w.Body)
	}
	if w := do(h, http.MethodPost, "/v1/jobs", "application/json", `{"prompt":"kept nothing","steps":40}`); w.Code != http.StatusAccepted {
		t.Fatalf("submit: %d %s", w.Code, w.Body)
	}

	w := do(h, http.MethodPost, "/v1/jobs/job-1/fork", "application/json", `{"from_step":20,"prompt":"a blue fox","guidance_scale":4}`)
	if w.Code != http.StatusAccepted {
		t.Fatalf("fork: %d %s", w.Code, w.Body)
	}
	var got jobs.Job
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	fork := f.jobs[got.ID]
	want := jobs.ForkFrom{Job: "job-1", Step: 20, Object: jobs.CheckpointID("job-1", 20)}
	if fork.Fork == nil || *fork.Fork != want {
		t.Fatalf("fork's source = %+v, want %+v", fork.Fork, want)
	}
	s := fork.Spec
	if s.Prompt != "a blue fox" || s.NegativePrompt != "blur" || s.GuidanceScale != 4 || s.Seed != 7 || s.Steps != 40 {
		t.Fatalf("fork's spec = %+v: want the new prompt and guidance, the rest of job-1's", s)
	}
	if loc := w.Header().Get("Location"); loc != "/v1/jobs/"+got.ID {
		t.Fatalf("Location = %q", loc)
	}

	for _, c := range []struct {
		path, body string
		status     int
		code       string
	}{
		{"/v1/jobs/job-1/fork", `{"from_step":15}`, http.StatusConflict, CodeNoCheckpoint},             // every 10
		{"/v1/jobs/job-2/fork", `{"from_step":10}`, http.StatusConflict, CodeNoCheckpoint},             // kept none
		{"/v1/jobs/nope/fork", `{"from_step":10}`, http.StatusNotFound, CodeJobNotFound},               // no such job
		{"/v1/jobs/job-1/fork", `{"from_step":0}`, http.StatusBadRequest, "invalid_from_step"},         // no step
		{"/v1/jobs/job-1/fork", `{"from_step":20,"steps":20}`, http.StatusBadRequest, "invalid_steps"}, // nothing left to run
		{"/v1/jobs/job-1/fork", `{"from_step":20,"seed":3}`, http.StatusBadRequest, "unknown_field"},   // the seed cannot change
	} {
		w := do(h, http.MethodPost, c.path, "application/json", c.body)
		if w.Code != c.status {
			t.Fatalf("%s %s: %d %s, want %d", c.path, c.body, w.Code, w.Body, c.status)
		}
		if e := decodeAPIError(t, w); e.Code != c.code {
			t.Fatalf("%s %s: code %q, want %q (%s)", c.path, c.body, e.Code, c.code, e.Message)
		}
	}
}
