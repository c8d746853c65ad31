package httpapi

import (
	"net/http"
	"strings"
	"testing"
)

// "lora" names an adapter in /v1/jobs, /v1/images/generations and the
// edits form: it reaches the spec; a malformed name is a 400 on "lora"
// before the agent sees the request.
func TestLoraField(t *testing.T) {
	f := newFakeJobs(true) // jobs finish at once: the images call waits for its job
	h := NewHandler(testConfig(t), f)
	j := decodeJob(t, do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"a fox","model":"m","lora":"paint-v1"}`), http.StatusAccepted)
	if j.Spec.Adapter != "paint-v1" {
		t.Errorf("/v1/jobs: spec adapter %q, want paint-v1", j.Spec.Adapter)
	}
	resp := decodeImages(t, do(h, "POST", "/v1/images/generations", "application/json", `{"prompt":"a fox","model":"m","lora":"paint-v2"}`))
	if len(resp.Data) != 1 || f.jobs[resp.Data[0].Latentmesh.JobID].Spec.Adapter != "paint-v2" {
		t.Errorf("/v1/images/generations: the job's spec does not name adapter paint-v2")
	}
	for _, name := range []string{"a/b", strings.Repeat("x", 33), "two words"} {
		w := do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"x","model":"m","lora":"`+name+`"}`)
		e := decodeAPIError(t, w)
		if w.Code != http.StatusBadRequest || e.Param != "lora" {
			t.Errorf("lora %q: %d %+v, want 400 on lora", name, w.Code, e)
		}
	}
}
