package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func testConfig(t testing.TB) Config {
	cfg := DefaultConfig()
	if tt, ok := t.(*testing.T); ok {
		cfg.Logger = zaptest.NewLogger(tt)
	}
	return cfg
}

// eventually retries cond for up to five seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// do sends one request straight to h.
func do(h http.Handler, method, path, contentType, body string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// decodeAPIError checks that a response is a well-formed JSON error.
func decodeAPIError(t *testing.T, w *httptest.ResponseRecorder) *APIError {
	t.Helper()
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type = %q, want application/json; body %s", ct, w.Body)
	}
	var env struct {
		Error *APIError `json:"error"`
	}
	dec := json.NewDecoder(w.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&env); err != nil || env.Error == nil {
		t.Fatalf("error body does not decode (%v): %s", err, w.Body)
	}
	e := env.Error
	if e.Message == "" || e.Type == "" || e.Code == "" {
		t.Fatalf("error body lacks message, type or code: %+v", e)
	}
	return e
}

func TestBadRequests(t *testing.T) {
	const (
		img = "/v1/images/generations"
		job = "/v1/jobs"
		js  = "application/json"
	)
	long := strings.Repeat("a", engine.DefaultLimits().MaxPromptBytes+1)
	huge := `{"prompt":"` + strings.Repeat("a", 100<<10) + `"}`
	cases := []struct {
		name        string
		method      string
		path        string
		contentType string
		body        string
		status      int
		code        string
		field       string // the message must name it
	}{
		{"truncated JSON", "POST", img, js, `{"prompt":`, 400, CodeInvalidJSON, ""},
		{"malformed JSON", "POST", img, js, `{prompt:"x"}`, 400, CodeInvalidJSON, ""},
		{"empty body", "POST", img, js, ``, 400, CodeInvalidJSON, ""},
		{"trailing object", "POST", img, js, `{"prompt":"x"} {}`, 400, CodeInvalidJSON, ""},
		{"trailing garbage", "POST", job, js, `{"prompt":"x"}garbage`, 400, CodeInvalidJSON, ""},
		{"array body", "POST", img, js, `[]`, 400, CodeInvalidType, ""},
		{"unknown field", "POST", img, js, `{"prompt":"x","colour":"red"}`, 400, CodeUnknownField, "colour"},
		{"unknown field native", "POST", job, js, `{"prompt":"x","n":2}`, 400, CodeUnknownField, "n"},
		{"prompt wrong type", "POST", img, js, `{"prompt":5}`, 400, CodeInvalidType, "prompt"},
		{"seed wrong type", "POST", job, js, `{"prompt":"x","seed":"7"}`, 400, CodeInvalidType, "seed"},
		{"n negative", "POST", img, js, `{"prompt":"x","n":-1}`, 400, "invalid_n", "n"},
		{"n zero", "POST", img, js, `{"prompt":"x","n":0}`, 400, "invalid_n", "n"},
		{"n too large", "POST", img, js, `{"prompt":"x","n":5}`, 400, "invalid_n", "n"},
		{"n overflows", "POST", img, js, `{"prompt":"x","n":1e30}`, 400, CodeInvalidType, "n"},
		{"n fractional", "POST", img, js, `{"prompt":"x","n":1.5}`, 400, CodeInvalidType, "n"},
		{"size abc", "POST", img, js, `{"prompt":"x","size":"abc"}`, 400, "invalid_size", "size"},
		{"size signed", "POST", img, js, `{"prompt":"x","size":"-64x64"}`, 400, "invalid_size", "size"},
		{"size not multiple of 8", "POST", img, js, `{"prompt":"x","size":"100x100"}`, 400, "invalid_size", "width"},
		{"size too large", "POST", img, js, `{"prompt":"x","size":"2048x2048"}`, 400, "invalid_size", "width"},
		{"size too small", "POST", img, js, `{"prompt":"x","size":"64x8"}`, 400, "invalid_size", "height"},
		{"width not multiple of 8", "POST", job, js, `{"prompt":"x","width":65}`, 400, "invalid_width", "width"},
		{"steps zero", "POST", img, js, `{"prompt":"x","num_inference_steps":0}`, 400, "invalid_num_inference_steps", "num_inference_steps"},
		{"steps 1000", "POST", img, js, `{"prompt":"x","num_inference_steps":1000}`, 400, "invalid_num_inference_steps", "num_inference_steps"},
		{"native steps zero", "POST", job, js, `{"prompt":"x","steps":0}`, 400, "invalid_steps", "steps"},
		{"native steps 1000", "POST", job, js, `{"prompt":"x","steps":1000}`, 400, "invalid_steps", "steps"},
		{"frames too many", "POST", img, js, `{"prompt":"x","frames":65}`, 400, "invalid_frames", "frames"},
		{"frames zero", "POST", job, js, `{"prompt":"x","frames":0}`, 400, "invalid_frames", "frames"},
		{"too many pixels", "POST", job, js, `{"prompt":"x","width":1024,"height":1024,"frames":8}`, 400, "invalid_frames", "pixels"},
		{"prompt empty", "POST", img, js, `{"prompt":""}`, 400, "invalid_prompt", "prompt"},
		{"prompt absent", "POST", job, js, `{}`, 400, "invalid_prompt", "prompt"},
		{"prompt null body", "POST", job, js, `null`, 400, "invalid_prompt", "prompt"},
		{"prompt too long", "POST", img, js, `{"prompt":"` + long + `"}`, 400, "invalid_prompt", "prompt"},
		{"negative prompt too long", "POST", job, js, `{"prompt":"x","negative_prompt":"` + long + `"}`, 400, "invalid_negative_prompt", "negative_prompt"},
		{"guidance NaN string", "POST", img, js, `{"prompt":"x","guidance_scale":"NaN"}`, 400, CodeInvalidType, "guidance_scale"},
		{"guidance Infinity string", "POST", job, js, `{"prompt":"x","guidance_scale":"Infinity"}`, 400, CodeInvalidType, "guidance_scale"},
		{"guidance NaN literal", "POST", img, js, `{"prompt":"x","guidance_scale":NaN}`, 400, CodeInvalidJSON, ""},
		{"guidance huge", "POST", job, js, `{"prompt":"x","guidance_scale":1e400}`, 400, CodeInvalidType, "guidance_scale"},
		{"guidance too high", "POST", job, js, `{"prompt":"x","guidance_scale":31}`, 400, "invalid_guidance_scale", "guidance_scale"},
		{"guidance negative", "POST", img, js, `{"prompt":"x","guidance_scale":-1}`, 400, "invalid_guidance_scale", "guidance_scale"},
		{"priority unknown", "POST", img, js, `{"prompt":"x","priority":"urgent"}`, 400, "invalid_priority", "priority"},
		{"response_format other", "POST", img, js, `{"prompt":"x","response_format":"png"}`, 400, "invalid_response_format", "response_format"},
		{"stream", "POST", img, js, `{"prompt":"x","stream":true}`, 400, CodeUnsupportedFormat, "events"},
		{"quality unknown", "POST", img, js, `{"prompt":"x","quality":"ultra"}`, 400, "invalid_quality", "quality"},
		{"huge body", "POST", img, js, huge, 413, CodeBodyTooLarge, ""},
		{"huge body native", "POST", job, "", huge, 413, CodeBodyTooLarge, ""},
		{"wrong content type", "POST", img, "text/plain", `{"prompt":"x"}`, 415, CodeUnsupportedMedia, "application/json"},
		{"form content type", "POST", job, "application/x-www-form-urlencoded", `prompt=x`, 415, CodeUnsupportedMedia, ""},
		{"garbled content type", "POST", job, ";;", `{"prompt":"x"}`, 415, CodeUnsupportedMedia, ""},
		{"wrong method images", "GET", img, "", "", 405, CodeMethodNotAllowed, "POST"},
		{"wrong method jobs", "PUT", job, "", "", 405, CodeMethodNotAllowed, ""},
		{"wrong method job", "POST", job + "/job-1", "", "", 405, CodeMethodNotAllowed, "DELETE"},
		{"wrong method result", "DELETE", job + "/job-1/result", "", "", 405, CodeMethodNotAllowed, ""},
		{"unknown path", "GET", "/v2/images", "", "", 404, CodeNotFound, "/v2/images"},
		{"root", "GET", "/", "", "", 404, CodeNotFound, ""},
		{"unknown job", "GET", job + "/nope", "", "", 404, CodeJobNotFound, "nope"},
		{"unknown job result", "GET", job + "/nope/result", "", "", 404, CodeJobNotFound, ""},
		{"unknown job cancel", "DELETE", job + "/nope", "", "", 404, CodeJobNotFound, ""},
		{"escaped slash in id", "GET", job + "/a%2Fb", "", "", 404, CodeJobNotFound, ""},
		{"escaped dots id", "GET", job + "/%2e%2e", "", "", 404, CodeJobNotFound, ""},
		{"id too long", "GET", job + "/" + strings.Repeat("a", 129), "", "", 404, CodeJobNotFound, ""},
		{"bad wait", "GET", job + "/job-1?wait=soon", "", "", 400, "invalid_wait", "wait"},
		{"negative wait", "GET", job + "/job-1?wait=-1s", "", "", 400, "invalid_wait", "wait"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeJobs(true)
			h := NewHandler(testConfig(t), f)
			w := do(h, tc.method, tc.path, tc.contentType, tc.body)
			if w.Code != tc.status {
				t.Fatalf("status = %d, want %d; body %s", w.Code, tc.status, w.Body)
			}
			e := decodeAPIError(t, w)
			if tc.code != "" && e.Code != tc.code {
				t.Errorf("code = %q, want %q (message %q)", e.Code, tc.code, e.Message)
			}
			if tc.field != "" && !strings.Contains(e.Message, tc.field) {
				t.Errorf("message %q does not name %q", e.Message, tc.field)
			}
			if tc.status == 405 && w.Header().Get("Allow") == "" {
				t.Error("405 without an Allow header")
			}
			if len(f.jobs) != 0 {
				t.Errorf("a rejected request submitted %d jobs", len(f.jobs))
			}
		})
	}
}

func TestBodyTooLargeWithoutContentLength(t *testing.T) {
	h := NewHandler(testConfig(t), newFakeJobs(true))
	body := `{"prompt":"` + strings.Repeat("a", 100<<10) + `"}`
	r := httptest.NewRequest("POST", "/v1/jobs", io.MultiReader(strings.NewReader(body))) // no length known
	r.ContentLength = -1
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("status = %d, want 413; body %s", w.Code, w.Body)
	}
	if e := decodeAPIError(t, w); e.Code != CodeBodyTooLarge {
		t.Fatalf("code = %q", e.Code)
	}
}

func decodeImages(t *testing.T, w *httptest.ResponseRecorder) ImagesResponse {
	t.Helper()
	if w.Code != http.StatusOK {
		t.Fatalf("status = %d; body %s", w.Code, w.Body)
	}
	var resp ImagesResponse
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil {
		t.Fatal(err)
	}
	return resp
}

func TestImagesGenerations(t *testing.T) {
	f := newFakeJobs(true)
	h := NewHandler(testConfig(t), f)
	w := do(h, "POST", "/v1/images/generations", "application/json; charset=utf-8",
		`{"model":"dall-e-3","prompt":"a red fox","n":2,"size":"128x64","response_format":"b64_json","seed":7,"num_inference_steps":4,"priority":"interactive"}`)
	resp := decodeImages(t, w)
	if resp.Created == 0 || len(resp.Data) != 2 {
		t.Fatalf("created %d, %d items; want 2", resp.Created, len(resp.Data))
	}
	for i, d := range resp.Data {
		got, err := base64.StdEncoding.DecodeString(d.B64JSON)
		if err != nil {
			t.Fatal(err)
		}
		wantSeed := int64(7 + i)
		spec := engine.Spec{Prompt: "a red fox", Seed: wantSeed}
		if string(got) != string(fakeOutput(spec)) {
			t.Errorf("item %d = %q, want %q", i, got, fakeOutput(spec))
		}
		if d.Latentmesh.Seed != wantSeed || d.Latentmesh.JobID == "" || d.Latentmesh.ContentType != "image/png" {
			t.Errorf("item %d info = %+v", i, d.Latentmesh)
		}
		j := f.jobs[d.Latentmesh.JobID]
		if j.Spec.Width != 128 || j.Spec.Height != 64 || j.Spec.Steps != 4 || j.Class.String() != "interactive" {
			t.Errorf("job %s spec %+v class %v", j.ID, j.Spec, j.Class)
		}
	}
	if resp.Data[0].Latentmesh.JobID == resp.Data[1].Latentmesh.JobID {
		t.Error("both items came from one job")
	}
}

func TestImagesGenerationsRandomSeed(t *testing.T) {
	f := newFakeJobs(true)
	h := NewHandler(testConfig(t), f)
	resp := decodeImages(t, do(h, "POST", "/v1/images/generations", "", `{"prompt":"fox"}`))
	if len(resp.Data) != 1 {
		t.Fatalf("%d items, want 1", len(resp.Data))
	}
	seed := resp.Data[0].Latentmesh.Seed
	got, _ := base64.StdEncoding.DecodeString(resp.Data[0].B64JSON)
	if want := fakeOutput(engine.Spec{Prompt: "fox", Seed: seed}); string(got) != string(want) {
		t.Fatalf("reported seed %d does not match the image %q", seed, got)
	}
	j := f.jobs[resp.Data[0].Latentmesh.JobID]
	if d := engine.DefaultSpec(); j.Spec.Steps != d.Steps || j.Spec.Width != d.Width || j.Class.String() != "standard" {
		t.Fatalf("defaults not applied: %+v %v", j.Spec, j.Class)
	}
}

// imagesAsync posts an images request to a real server in the background.
func imagesAsync(t *testing.T, cfg Config, f *fakeJobs, body string) <-chan *httptest.ResponseRecorder {
	t.Helper()
	h := NewHandler(cfg, f)
	ch := make(chan *httptest.ResponseRecorder, 1)
	go func() { ch <- do(h, "POST", "/v1/images/generations", "", body) }()
	return ch
}

func TestImagesGenerationsJobEnds(t *testing.T) {
	cases := []struct {
		name   string
		end    func(j *jobs.Job)
		status int
		code   string
	}{
		{"failed", func(j *jobs.Job) {
			j.State, j.Error = jobs.Failed, &jobs.Error{Code: "engine_oom", Message: "out of memory in denoise"}
		}, http.StatusBadGateway, "engine_oom"},
		{"cancelled", func(j *jobs.Job) { j.State = jobs.Cancelled }, http.StatusConflict, CodeCancelled},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeJobs(false)
			ch := imagesAsync(t, testConfig(t), f, `{"prompt":"fox","n":2}`)
			eventually(t, "two jobs submitted", func() bool {
				f.mu.Lock()
				defer f.mu.Unlock()
				return len(f.jobs) == 2
			})
			f.update("job-1", tc.end)
			w := <-ch
			if w.Code != tc.status {
				t.Fatalf("status = %d, want %d; body %s", w.Code, tc.status, w.Body)
			}
			if e := decodeAPIError(t, w); e.Code != tc.code {
				t.Fatalf("code = %q, want %q", e.Code, tc.code)
			}
			// The rest of a doomed request is withdrawn.
			if j, _ := f.Get(context.Background(), "job-2"); j.State != jobs.Cancelled {
				t.Fatalf("job-2 is %s, want cancelled", j.State)
			}
		})
	}
}

func TestImagesGenerationsTimeout(t *testing.T) {
	f := newFakeJobs(false)
	cfg := testConfig(t)
	cfg.SyncTimeout = 50 * time.Millisecond
	w := <-imagesAsync(t, cfg, f, `{"prompt":"fox"}`)
	if w.Code != http.StatusGatewayTimeout {
		t.Fatalf("status = %d; body %s", w.Code, w.Body)
	}
	if e := decodeAPIError(t, w); e.Code != CodeTimeout || !strings.Contains(e.Message, "job-1") {
		t.Fatalf("error = %+v; want timeout naming job-1", e)
	}
}

func TestStoreErrors(t *testing.T) {
	f := newFakeJobs(true)
	f.submitErr = errFakeStore
	h := NewHandler(testConfig(t), f)
	for _, path := range []string{"/v1/images/generations", "/v1/jobs"} {
		w := do(h, "POST", path, "", `{"prompt":"x"}`)
		if w.Code != http.StatusInternalServerError {
			t.Fatalf("%s: status = %d", path, w.Code)
		}
		if e := decodeAPIError(t, w); e.Code != CodeInternal || strings.Contains(e.Message, "store down") {
			t.Fatalf("%s: error %+v (internal detail must stay in the log)", path, e)
		}
	}
}

// An unreachable etcd is a 503 that says so and when to retry, not a 500.
func TestEtcdUnreachableIs503(t *testing.T) {
	f := newFakeJobs(true)
	f.submitErr = fmt.Errorf("%w: no answer within 5s: context deadline exceeded", jobs.ErrUnavailable)
	w := do(NewHandler(testConfig(t), f), "POST", "/v1/jobs", "", `{"prompt":"x"}`)
	e := wantError(t, w, http.StatusServiceUnavailable, CodeUnavailable)
	if !strings.HasPrefix(e.Message, "etcd unreachable: no answer within 5s") || w.Header().Get("Retry-After") != "5" {
		t.Fatalf("%+v, Retry-After %q", e, w.Header().Get("Retry-After"))
	}
}

// hungJobs is a job store whose etcd never answers: every read waits for
// its context, and ends with the error gRPC gives a call a leaderless
// member held to its deadline.
type hungJobs struct{ *fakeJobs }

func (hungJobs) hang(ctx context.Context) error {
	<-ctx.Done()
	return status.Error(codes.Unknown, context.DeadlineExceeded.Error())
}

func (h hungJobs) Get(ctx context.Context, _ string) (jobs.Job, error) {
	return jobs.Job{}, h.hang(ctx)
}
func (h hungJobs) Wait(ctx context.Context, _ string) (jobs.Job, error) {
	return jobs.Job{}, h.hang(ctx)
}

// A long poll of a store that never answers ends within its wait plus
// lastKnownWithin with a 503 naming etcd, not a 500 or a hang: the read
// after the wait is bounded too.
func TestLongPollOnHungEtcd(t *testing.T) {
	h := NewHandler(testConfig(t), hungJobs{newFakeJobs(false)})
	start := time.Now()
	w := do(h, "GET", "/v1/jobs/job-1?wait=50ms", "", "")
	took := time.Since(start)
	e := wantError(t, w, http.StatusServiceUnavailable, CodeUnavailable)
	if !strings.HasPrefix(e.Message, "etcd unreachable: no answer within the long poll's wait") || w.Header().Get("Retry-After") == "" {
		t.Fatalf("%+v, Retry-After %q", e, w.Header().Get("Retry-After"))
	}
	t.Logf("answered after %v (wait 50ms, then at most %v for the job as it stands)", took.Round(time.Millisecond), lastKnownWithin)
}

// An outage error nobody classified (etcd's own, as gRPC carries it) is a
// 503 naming etcd, never a 500.
func TestUnnamedOutageIs503(t *testing.T) {
	for _, err := range []error{
		status.Error(codes.Unknown, context.DeadlineExceeded.Error()), // a leaderless member held the call to its deadline
		fmt.Errorf("jobs: get job-1: %w", status.Error(codes.Unavailable, "etcdserver: no leader")),
		rpctypes.ErrTimeout,
	} {
		f := newFakeJobs(true)
		f.submitErr = err
		w := do(NewHandler(testConfig(t), f), "POST", "/v1/jobs", "", `{"prompt":"x"}`)
		e := wantError(t, w, http.StatusServiceUnavailable, CodeUnavailable)
		if !strings.HasPrefix(e.Message, "etcd unreachable: ") || w.Header().Get("Retry-After") == "" {
			t.Fatalf("%v: %+v, Retry-After %q", err, e, w.Header().Get("Retry-After"))
		}
	}
}

type panickyJobs struct{ *fakeJobs }

func (panickyJobs) Get(context.Context, string) (jobs.Job, error) { panic("boom") }

func TestPanicIsRecovered(t *testing.T) {
	reg := mustMetrics(t)
	cfg := testConfig(t)
	cfg.Metrics = reg
	h := NewHandler(cfg, panickyJobs{newFakeJobs(true)})
	w := do(h, "GET", "/v1/jobs/job-1", "", "")
	if w.Code != http.StatusInternalServerError {
		t.Fatalf("status = %d", w.Code)
	}
	if e := decodeAPIError(t, w); e.Code != CodeInternal {
		t.Fatalf("code = %q", e.Code)
	}
	if text := scrape(t, reg.Handler()); !strings.Contains(text, `latentmesh_http_requests_total{code="500",route="/v1/jobs/{id}"} 1`) {
		t.Fatalf("panic not counted as a 500:\n%s", text)
	}
}

func decodeJob(t *testing.T, w *httptest.ResponseRecorder, status int) jobs.Job {
	t.Helper()
	if w.Code != status {
		t.Fatalf("status = %d, want %d; body %s", w.Code, status, w.Body)
	}
	var j jobs.Job
	if err := json.Unmarshal(w.Body.Bytes(), &j); err != nil {
		t.Fatal(err)
	}
	return j
}

func wantError(t *testing.T, w *httptest.ResponseRecorder, status int, code string) *APIError {
	t.Helper()
	if w.Code != status {
		t.Fatalf("status = %d, want %d; body %s", w.Code, status, w.Body)
	}
	e := decodeAPIError(t, w)
	if e.Code != code {
		t.Fatalf("code = %q, want %q (%s)", e.Code, code, e.Message)
	}
	return e
}

func TestJobLifecycle(t *testing.T) {
	f := newFakeJobs(false)
	h := NewHandler(testConfig(t), f)

	w := do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"fox","seed":3,"steps":4,"width":64,"height":128,"frames":2,"guidance_scale":0,"priority":"batch"}`)
	j := decodeJob(t, w, http.StatusAccepted)
	if loc := w.Header().Get("Location"); loc != "/v1/jobs/"+j.ID {
		t.Fatalf("Location = %q for job %q", loc, j.ID)
	}
	want := engine.Spec{Prompt: "fox", Seed: 3, Steps: 4, Width: 64, Height: 128, Frames: 2, GuidanceScale: 0}
	if !reflect.DeepEqual(j.Spec, want) || j.State != jobs.Queued || j.Class.String() != "batch" {
		t.Fatalf("job = %+v", j)
	}

	f.update(j.ID, func(j *jobs.Job) {
		j.State, j.Stage = jobs.Running, jobs.Denoise
		j.Progress = &jobs.Progress{Stage: jobs.Denoise, Step: 2, Total: 4, Node: "n1"}
	})
	got := decodeJob(t, do(h, "GET", "/v1/jobs/"+j.ID, "", ""), http.StatusOK)
	if got.State != jobs.Running || got.Progress == nil || got.Progress.Step != 2 || got.Progress.Total != 4 {
		t.Fatalf("job = %+v, progress %+v", got, got.Progress)
	}
	// A short long-poll on a running job answers with the job as it stands.
	got = decodeJob(t, do(h, "GET", "/v1/jobs/"+j.ID+"?wait=20ms", "", ""), http.StatusOK)
	if got.State != jobs.Running {
		t.Fatalf("state after short wait = %s", got.State)
	}

	e := wantError(t, do(h, "GET", "/v1/jobs/"+j.ID+"/result", "", ""), http.StatusConflict, CodeNotReady)
	if !strings.Contains(e.Message, "running") {
		t.Errorf("not-ready message %q does not say the job is running", e.Message)
	}

	// A long-poll returns as soon as the job finishes.
	done := make(chan *httptest.ResponseRecorder, 1)
	go func() { done <- do(h, "GET", "/v1/jobs/"+j.ID+"?wait=10s", "", "") }()
	f.update(j.ID, func(j *jobs.Job) { j.State = jobs.Succeeded })
	if got := decodeJob(t, <-done, http.StatusOK); got.State != jobs.Succeeded {
		t.Fatalf("long-poll answered %s", got.State)
	}

	w = do(h, "GET", "/v1/jobs/"+j.ID+"/result", "", "")
	if w.Code != http.StatusOK || w.Header().Get("Content-Type") != "image/png" || w.Body.String() != string(fakeOutput(want)) {
		t.Fatalf("result: %d %q %q", w.Code, w.Header().Get("Content-Type"), w.Body)
	}
	// A finished job cannot be cancelled, only deleted, with its result.
	wantError(t, do(h, "POST", "/v1/jobs/"+j.ID+"/cancel", "", ""), http.StatusConflict, CodeAlreadyFinished)
	if w := do(h, "DELETE", "/v1/jobs/"+j.ID, "", ""); w.Code != http.StatusOK || !strings.Contains(w.Body.String(), `"deleted":true`) {
		t.Fatalf("delete of a finished job: %d %s", w.Code, w.Body)
	}
	wantError(t, do(h, "GET", "/v1/jobs/"+j.ID+"/result", "", ""), http.StatusNotFound, CodeJobNotFound)

	// Cancel a second job.
	j2 := decodeJob(t, do(h, "POST", "/v1/jobs", "", `{"prompt":"owl"}`), http.StatusAccepted)
	if c := decodeJob(t, do(h, "DELETE", "/v1/jobs/"+j2.ID, "", ""), http.StatusOK); c.State != jobs.Cancelled {
		t.Fatalf("cancel answered %s", c.State)
	}
	wantError(t, do(h, "GET", "/v1/jobs/"+j2.ID+"/result", "", ""), http.StatusConflict, CodeCancelled)
	wantError(t, do(h, "POST", "/v1/jobs/"+j2.ID+"/cancel", "", ""), http.StatusConflict, CodeAlreadyFinished)

	// A failed job's result is gone, with the job's own code.
	j3 := decodeJob(t, do(h, "POST", "/v1/jobs", "", `{"prompt":"cat"}`), http.StatusAccepted)
	f.update(j3.ID, func(j *jobs.Job) {
		j.State, j.Error = jobs.Failed, &jobs.Error{Code: "stage_retries_exhausted", Message: "decode failed 3 times"}
	})
	e = wantError(t, do(h, "GET", "/v1/jobs/"+j3.ID+"/result", "", ""), http.StatusGone, "stage_retries_exhausted")
	if !strings.Contains(e.Message, "decode failed 3 times") {
		t.Fatalf("message %q lacks the job's error", e.Message)
	}
}

func TestWaitIsCapped(t *testing.T) {
	cfg := testConfig(t)
	cfg.MaxWait = 30 * time.Millisecond
	f := newFakeJobs(false)
	h := NewHandler(cfg, f)
	j := decodeJob(t, do(h, "POST", "/v1/jobs", "", `{"prompt":"fox"}`), http.StatusAccepted)
	start := time.Now()
	got := decodeJob(t, do(h, "GET", "/v1/jobs/"+j.ID+"?wait=1h", "", ""), http.StatusOK)
	if got.State != jobs.Queued || time.Since(start) > 5*time.Second {
		t.Fatalf("state %s after %v", got.State, time.Since(start))
	}
}

func mustMetrics(t *testing.T) *Metrics {
	t.Helper()
	m, err := NewMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func scrape(t *testing.T, h http.Handler) string {
	t.Helper()
	w := do(h, "GET", "/metrics", "", "")
	if w.Code != http.StatusOK {
		t.Fatalf("metrics status %d: %s", w.Code, w.Body)
	}
	return w.Body.String()
}

func TestMetrics(t *testing.T) {
	m := mustMetrics(t)
	m.JobSubmitted(1)
	m.JobFinished(jobs.Succeeded)
	m.ObserveStage(jobs.Denoise, routing.Standard, 1500*time.Millisecond)
	m.SetQueueDepth(jobs.Denoise, map[routing.Class]int{routing.Batch: 3})
	m.SetCredits(jobs.Decode, 2, 1)
	cfg := testConfig(t)
	cfg.Metrics = m
	h := NewHandler(cfg, newFakeJobs(true))
	do(h, "GET", "/v1/jobs/nope", "", "")

	text := scrape(t, m.Handler())
	for _, want := range []string{
		`latentmesh_jobs_submitted_total{class="standard"} 1`,
		`latentmesh_jobs_finished_total{state="succeeded"} 1`,
		`latentmesh_stage_duration_seconds_count{class="standard",stage="denoise"} 1`,
		`latentmesh_queue_depth{class="batch",stage="denoise"} 3`,
		`latentmesh_free_credits{stage="decode"} 2`,
		`latentmesh_http_requests_total{code="404",route="/v1/jobs/{id}"} 1`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	reg := m.reg
	if _, err := NewMetrics(reg); err == nil {
		t.Error("registering the same metrics twice succeeded")
	}
}

// A stage's claim counters read back what was counted, and what the
// scrape shows; a stage served but idle reads zeros and is exported.
func TestClaimCounts(t *testing.T) {
	m := mustMetrics(t)
	m.InitStage(jobs.Denoise)
	m.InitStage(jobs.Decode)
	for range 3 {
		m.ClaimTxn(jobs.Denoise)
	}
	m.ClaimConflict(jobs.Denoise)
	m.PushedClaim(jobs.Denoise, false)
	m.PushedClaim(jobs.Denoise, false)
	m.PushedClaim(jobs.Denoise, true)
	m.HandedOver(jobs.Denoise)
	m.Offered(jobs.Denoise, false)
	m.Offered(jobs.Denoise, true)
	before := m.Claims(jobs.Denoise)
	if want := (ClaimCounts{Txns: 3, Conflicts: 1, PushedStarted: 2, GivenBack: 1, HandedOver: 1, Offered: 1, Withdrawn: 1}); before != want {
		t.Fatalf("denoise claims %+v, want %+v", before, want)
	}
	if got := m.Claims(jobs.Decode); got != (ClaimCounts{}) {
		t.Fatalf("idle decode claims %+v, want zeros", got)
	}
	m.ClaimTxn(jobs.Denoise)
	if d := m.Claims(jobs.Denoise).Sub(before); d != (ClaimCounts{Txns: 1}) {
		t.Fatalf("since the first read %+v, want one txn", d)
	}
	if sum := before.Add(before); sum != (ClaimCounts{6, 2, 4, 2, 2, 2, 2}) {
		t.Fatalf("sum %+v", sum)
	}
	text := scrape(t, m.Handler())
	for _, want := range []string{
		`latentmesh_claim_txns_total{stage="denoise"} 4`,
		`latentmesh_claim_txns_total{stage="decode"} 0`,
		`latentmesh_claim_conflicts_total{stage="denoise"} 1`,
		`latentmesh_pushed_claims_total{outcome="given_back",stage="denoise"} 1`,
		`latentmesh_pushed_claims_total{outcome="handed_over",stage="denoise"} 1`,
		`latentmesh_pushed_claims_total{outcome="started",stage="decode"} 0`,
		`latentmesh_offered_claims_total{outcome="started",stage="denoise"} 1`,
		`latentmesh_offered_claims_total{outcome="withdrawn",stage="denoise"} 1`,
		`latentmesh_offered_claims_total{outcome="withdrawn",stage="decode"} 0`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func TestAdmin(t *testing.T) {
	m := mustMetrics(t)
	m.SetQueueDepth(jobs.Encode, map[routing.Class]int{routing.Standard: 1})
	ready := errors.New("etcd session not established")
	cfg := AdminConfig{
		Live:  func() error { return nil },
		Ready: func() error { return ready },
		Status: func(ctx context.Context) (any, error) {
			return map[string]any{"node": "n1", "stages": []string{"denoise"}}, nil
		},
		Metrics: m.Handler(),
		Logger:  zaptest.NewLogger(t),
	}

	t.Run("open", func(t *testing.T) {
		h := NewAdminHandler(cfg)
		if w := do(h, "GET", "/livez", "", ""); w.Code != 200 || w.Body.String() != "ok\n" {
			t.Errorf("livez: %d %q", w.Code, w.Body)
		}
		if w := do(h, "GET", "/readyz", "", ""); w.Code != 503 || !strings.Contains(w.Body.String(), ready.Error()) {
			t.Errorf("readyz: %d %q", w.Code, w.Body)
		}
		if text := scrape(t, h); !strings.Contains(text, "latentmesh_queue_depth") {
			t.Errorf("metrics: %s", text)
		}
		w := do(h, "GET", "/v1/admin/status", "", "")
		var st map[string]any
		if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &st) != nil || st["node"] != "n1" {
			t.Errorf("status: %d %s", w.Code, w.Body)
		}
		if w := do(h, "GET", "/debug/pprof/", "", ""); w.Code != 200 || !strings.Contains(w.Body.String(), "goroutine") {
			t.Errorf("pprof index: %d", w.Code)
		}
		if w := do(h, "GET", "/debug/pprof/goroutine?debug=1", "", ""); w.Code != 200 {
			t.Errorf("pprof goroutine: %d", w.Code)
		}
		if w := do(h, "GET", "/debug/pprof/cmdline", "", ""); w.Code != 200 {
			t.Errorf("pprof cmdline: %d", w.Code)
		}
		wantError(t, do(h, "GET", "/nope", "", ""), 404, CodeNotFound)
	})

	t.Run("token", func(t *testing.T) {
		cfg := cfg
		cfg.Token = "s3cret"
		cfg.Ready = nil
		h := NewAdminHandler(cfg)
		if w := do(h, "GET", "/livez", "", ""); w.Code != 200 {
			t.Errorf("livez without token: %d", w.Code)
		}
		for _, path := range []string{"/readyz", "/metrics", "/v1/admin/status", "/debug/pprof/", "/debug/pprof/cmdline"} {
			for _, auth := range []string{"", "Bearer wrong", "Basic s3cret", "s3cret"} {
				r := httptest.NewRequest("GET", path, nil)
				if auth != "" {
					r.Header.Set("Authorization", auth)
				}
				w := httptest.NewRecorder()
				h.ServeHTTP(w, r)
				if w.Code != http.StatusUnauthorized || w.Header().Get("WWW-Authenticate") == "" {
					t.Errorf("%s with %q: %d", path, auth, w.Code)
					continue
				}
				decodeAPIError(t, w)
			}
			r := httptest.NewRequest("GET", path, nil)
			r.Header.Set("Authorization", "Bearer s3cret")
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != http.StatusOK {
				t.Errorf("%s with token: %d %s", path, w.Code, w.Body)
			}
		}
	})

	t.Run("status error", func(t *testing.T) {
		h := NewAdminHandler(AdminConfig{Status: func(context.Context) (any, error) { return nil, errors.New("etcd unreachable") }})
		e := wantError(t, do(h, "GET", "/v1/admin/status", "", ""), http.StatusServiceUnavailable, CodeUnavailable)
		if !strings.Contains(e.Message, "etcd unreachable") {
			t.Errorf("message %q", e.Message)
		}
		if w := do(h, "GET", "/metrics", "", ""); w.Code != 404 {
			t.Errorf("metrics without a handler: %d", w.Code)
		}
	})
}

// newTestServer serves the client API over loopback for the Client tests.
func newTestServer(t *testing.T, f *fakeJobs) (*httptest.Server, *Client) {
	t.Helper()
	srv := httptest.NewServer(NewHandler(testConfig(t), f))
	t.Cleanup(srv.Close)
	return srv, &Client{BaseURL: srv.URL, HTTP: srv.Client()}
}

func TestClient(t *testing.T) {
	f := newFakeJobs(false)
	_, c := newTestServer(t, f)
	ctx := context.Background()

	j, err := c.Submit(ctx, JobRequest{Prompt: "fox", Seed: new(int64(9)), Steps: new(3)})
	if err != nil {
		t.Fatal(err)
	}
	if j.State != jobs.Queued || j.Spec.Seed != 9 || j.Spec.Steps != 3 {
		t.Fatalf("submitted %+v", j)
	}
	if g, err := c.Get(ctx, j.ID); err != nil || g.ID != j.ID {
		t.Fatalf("get: %+v %v", g, err)
	}
	var apiErr *APIError
	if _, _, err := c.Result(ctx, j.ID); !errors.As(err, &apiErr) || apiErr.Status != 409 || apiErr.Code != CodeNotReady {
		t.Fatalf("result of a queued job: %v", err)
	}
	if g, err := c.Wait(ctx, j.ID, 10*time.Millisecond); err != nil || g.State != jobs.Queued {
		t.Fatalf("wait: %+v %v", g, err)
	}
	if g, err := c.Cancel(ctx, j.ID); err != nil || g.State != jobs.Cancelled {
		t.Fatalf("cancel: %+v %v", g, err)
	}
	if _, err := c.Cancel(ctx, j.ID); !errors.As(err, &apiErr) || apiErr.Code != CodeAlreadyFinished {
		t.Fatalf("second cancel: %v", err)
	}
	if err := c.Delete(ctx, j.ID); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if _, err := c.Get(ctx, j.ID); !errors.As(err, &apiErr) || apiErr.Status != 404 {
		t.Fatalf("get after delete: %v", err)
	}
	if _, err := c.Get(ctx, "nope"); !errors.As(err, &apiErr) || apiErr.Status != 404 || apiErr.Code != CodeJobNotFound || apiErr.Type == "" {
		t.Fatalf("get unknown: %#v", err)
	}
	_, err = c.Submit(ctx, JobRequest{Prompt: "fox", Steps: new(1000)})
	if !errors.As(err, &apiErr) || apiErr.Status != 400 || apiErr.Code != "invalid_steps" || apiErr.Param != "steps" {
		t.Fatalf("bad submit: %#v", err)
	}
	if !strings.Contains(err.Error(), "steps") {
		t.Fatalf("error text %q does not name the field", err)
	}
}

func TestClientGenerate(t *testing.T) {
	t.Run("long-poll", func(t *testing.T) {
		_, c := newTestServer(t, newFakeJobs(true))
		j, data, err := c.Generate(context.Background(), JobRequest{Prompt: "fox", Seed: new(int64(1))}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if j.State != jobs.Succeeded || string(data) != string(fakeOutput(j.Spec)) {
			t.Fatalf("job %+v data %q", j, data)
		}
	})
	t.Run("progress", func(t *testing.T) {
		f := newFakeJobs(false)
		f.stepOnGet = true
		_, c := newTestServer(t, f)
		var seen []string
		j, data, err := c.Generate(context.Background(), JobRequest{Prompt: "fox", Steps: new(2)}, func(j jobs.Job) {
			_, label := jobProgress(j)
			seen = append(seen, label)
		})
		if err != nil {
			t.Fatal(err)
		}
		if string(data) != string(fakeOutput(j.Spec)) {
			t.Fatalf("data %q", data)
		}
		want := "queued,encode,denoise 1/2,denoise 2/2,decode,done"
		if got := strings.Join(seen, ","); got != want {
			t.Fatalf("progress %s, want %s", got, want)
		}
	})
	t.Run("failed", func(t *testing.T) {
		f := newFakeJobs(false)
		f.stepOnGet = true
		f.failWith = &jobs.Error{Code: "engine_error", Message: "decoder crashed"}
		_, c := newTestServer(t, f)
		j, _, err := c.Generate(context.Background(), JobRequest{Prompt: "fox", Steps: new(1)}, func(jobs.Job) {})
		var apiErr *APIError
		if !errors.As(err, &apiErr) || apiErr.Code != "engine_error" || !strings.Contains(apiErr.Message, "decoder crashed") {
			t.Fatalf("err = %v", err)
		}
		if j.State != jobs.Failed {
			t.Fatalf("job %s", j.State)
		}
	})
}

func TestClientNonJSONError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "upstream unavailable", http.StatusBadGateway)
	}))
	defer srv.Close()
	c := &Client{BaseURL: srv.URL, HTTP: srv.Client()}
	_, err := c.Get(context.Background(), "x")
	var apiErr *APIError
	if !errors.As(err, &apiErr) || apiErr.Status != 502 || apiErr.Message != "upstream unavailable" {
		t.Fatalf("err = %#v", err)
	}
}

// deadAddr returns a loopback URL nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

func TestClientUnreachable(t *testing.T) {
	c := &Client{BaseURL: deadAddr(t)}
	_, err := c.Get(context.Background(), "x")
	var apiErr *APIError
	if err == nil || errors.As(err, &apiErr) {
		t.Fatalf("err = %v, want a transport error", err)
	}
}

func runGenerate(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr strings.Builder
	code := RunGenerate(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestRunGenerate(t *testing.T) {
	f := newFakeJobs(false)
	f.stepOnGet = true
	srv, _ := newTestServer(t, f)
	dir := t.TempDir()
	out := filepath.Join(dir, "fox.png")
	if err := os.WriteFile(out, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}

	code, stdout, stderr := runGenerate(t, "--server", srv.URL, "--prompt", "a fox", "--negative-prompt", "blur",
		"--seed", "42", "--steps", "4", "--size", "64x128", "--frames", "1", "--guidance", "7.5", "--priority", "interactive", "-o", out)
	if code != 0 {
		t.Fatalf("exit %d; stderr %s", code, stderr)
	}
	j := f.jobs["job-1"]
	want := engine.Spec{Prompt: "a fox", NegativePrompt: "blur", Seed: 42, Steps: 4, Width: 64, Height: 128, Frames: 1, GuidanceScale: 7.5}
	if !reflect.DeepEqual(j.Spec, want) || j.Class.String() != "interactive" {
		t.Fatalf("spec %+v class %v", j.Spec, j.Class)
	}
	got, err := os.ReadFile(out)
	if err != nil || string(got) != string(fakeOutput(want)) {
		t.Fatalf("output %q, %v", got, err)
	}
	if !strings.Contains(stdout, "job-1") || !strings.Contains(stdout, out) {
		t.Errorf("summary %q lacks the job id or path", stdout)
	}
	for _, want := range []string{"[#", "denoise 2/4", "decode", "done"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("progress output lacks %q: %q", want, stderr)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("temp files left behind: %v", ents)
	}
}

func TestRunGenerateErrors(t *testing.T) {
	f := newFakeJobs(false)
	f.stepOnGet = true
	f.failWith = &jobs.Error{Code: "engine_error", Message: "decoder crashed"}
	srv, _ := newTestServer(t, f)
	dead := deadAddr(t)
	out := filepath.Join(t.TempDir(), "x.png")
	cases := []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"missing prompt", []string{"--server", srv.URL, "-o", out}, 2, []string{"--prompt is required"}},
		{"missing output", []string{"--server", srv.URL, "--prompt", "x"}, 2, []string{"-o FILE is required"}},
		{"unknown flag", []string{"--colour", "red"}, 2, []string{"colour"}},
		{"bad size", []string{"--prompt", "x", "-o", out, "--size", "big"}, 2, []string{"size", "WIDTHxHEIGHT"}},
		{"bad steps", []string{"--prompt", "x", "-o", out, "--steps", "many"}, 2, []string{"steps"}},
		{"bad server URL", []string{"--server", "127.0.0.1:8080", "--prompt", "x", "-o", out}, 2, []string{"--server"}},
		{"stray argument", []string{"--prompt", "x", "-o", out, "extra"}, 2, []string{"extra"}},
		{"server rejects", []string{"--server", srv.URL, "--prompt", "x", "-o", out, "--steps", "1000"}, 1, []string{"server error", "steps", "invalid_steps"}},
		{"job fails", []string{"--server", srv.URL, "--prompt", "x", "-o", out, "--steps", "1"}, 1, []string{"decoder crashed", "engine_error"}},
		{"unreachable", []string{"--server", dead, "--prompt", "x", "-o", out}, 1, []string{"cannot reach server at " + dead}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runGenerate(t, tc.args...)
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stderr %s", code, tc.code, stderr)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr lacks %q:\n%s", w, stderr)
				}
			}
			if stdout != "" {
				t.Errorf("stdout %q on failure", stdout)
			}
			if _, err := os.Stat(out); !os.IsNotExist(err) {
				t.Errorf("output written on failure")
			}
		})
	}
}

func TestRunGenerateInterrupted(t *testing.T) {
	f := newFakeJobs(false)
	srv, _ := newTestServer(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		eventually(t, "job submitted", func() bool {
			f.mu.Lock()
			defer f.mu.Unlock()
			return len(f.jobs) == 1
		})
		cancel()
	}()
	var stdout, stderr strings.Builder
	code := RunGenerate(ctx, []string{"--server", srv.URL, "--prompt", "x", "-o", filepath.Join(t.TempDir(), "x.png")}, &stdout, &stderr)
	if code != 1 || !strings.Contains(stderr.String(), "cancelled job job-1") {
		t.Fatalf("exit %d; stderr %s", code, stderr.String())
	}
	if j, _ := f.Get(context.Background(), "job-1"); j.State != jobs.Cancelled {
		t.Fatalf("job is %s, want cancelled", j.State)
	}
}

func FuzzImagesRequest(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"a fox","n":2,"size":"64x64","seed":1}`,
		`{"prompt":"x","num_inference_steps":1,"guidance_scale":0,"frames":2,"priority":"batch"}`,
		`{"prompt":"x","response_format":"url"}`,
		`{"prompt":"x","size":"999999x1"}`,
		`{"prompt":"\u0000\ud800","negative_prompt":"\xff"}`,
		`{"n":1e400}`,
		`[1,2,3]`,
		`{"prompt":"x"}{"prompt":"y"}`,
		``,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		cfg := DefaultConfig()
		h := NewHandler(cfg, newFakeJobs(true))
		for _, path := range []string{"/v1/images/generations", "/v1/jobs"} {
			w := do(h, "POST", path, "application/json", body)
			if w.Code >= 500 {
				t.Fatalf("%s: status %d for %q: %s", path, w.Code, body, w.Body)
			}
			if !json.Valid(w.Body.Bytes()) {
				t.Fatalf("%s: invalid JSON answer %q", path, w.Body)
			}
			if w.Code >= 400 {
				var env errorEnvelope
				if err := json.Unmarshal(w.Body.Bytes(), &env); err != nil || env.Error == nil || env.Error.Code == "" {
					t.Fatalf("%s: bad error body %s", path, w.Body)
				}
			}
		}
	})
}

func ExampleClient_Generate() {
	srv := httptest.NewServer(NewHandler(DefaultConfig(), newFakeJobs(true)))
	defer srv.Close()
	c := &Client{BaseURL: srv.URL, HTTP: srv.Client()}

	job, data, err := c.Generate(context.Background(), JobRequest{Prompt: "a red fox", Seed: new(int64(7)), Steps: new(8)}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(job.ID, job.State, job.Spec.Seed, job.Spec.Steps, len(data) > 0)
	// Output: job-1 succeeded 7 8 true
}

// A request that names a model and no steps gets the model's registered
// default; named steps, or the built-in model, keep theirs.
func TestModelDefaultSteps(t *testing.T) {
	cfg := testConfig(t)
	cfg.ModelSteps = func(model string) int {
		if model == "toy" {
			return 7
		}
		return 0
	}
	f := newFakeJobs(false)
	h := NewHandler(cfg, f)
	for _, tc := range []struct {
		body string
		want int
	}{
		{`{"prompt":"a","model":"toy"}`, 7},
		{`{"prompt":"a","model":"toy","steps":3}`, 3},
		{`{"prompt":"a"}`, engine.DefaultSpec().Steps},
		{`{"prompt":"a","model":"other"}`, engine.DefaultSpec().Steps},
	} {
		w := do(h, "POST", "/v1/jobs", "application/json", tc.body)
		var j jobs.Job
		if w.Code != http.StatusAccepted || json.Unmarshal(w.Body.Bytes(), &j) != nil {
			t.Fatalf("%s: %d %s", tc.body, w.Code, w.Body)
		}
		if j.Spec.Steps != tc.want {
			t.Errorf("%s: %d steps, want %d", tc.body, j.Spec.Steps, tc.want)
		}
	}
	// The OpenAI API applies it too (a fake that finishes jobs at once,
	// since the images API waits for them).
	auto := newFakeJobs(true)
	decodeImages(t, do(NewHandler(cfg, auto), "POST", "/v1/images/generations", "application/json", `{"prompt":"a","model":"toy"}`))
	auto.mu.Lock()
	last := auto.jobs["job-1"]
	auto.mu.Unlock()
	if last == nil || last.Spec.Model != "toy" || last.Spec.Steps != 7 {
		t.Fatalf("images API submitted %+v", last)
	}
}
