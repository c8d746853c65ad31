package httpapi

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// streamingJobs is fakeJobs with an event stream: the job as it stands,
// three denoise steps, then the job succeeded.
type streamingJobs struct{ *fakeJobs }

func (s streamingJobs) StreamEvents(ctx context.Context, id string, onJob func(jobs.Job) error, onStep func(jobs.Step) error) (jobs.Job, error) {
	j, err := s.Get(ctx, id)
	if err != nil {
		return jobs.Job{}, err
	}
	j.State, j.Progress = jobs.Running, &jobs.Progress{Stage: jobs.Denoise, Node: "den-1"}
	if err := onJob(j); err != nil {
		return jobs.Job{}, err
	}
	for k := 1; k <= 3; k++ {
		if err := onStep(jobs.Step{Stage: jobs.Denoise, Step: k, Total: 3, Node: "den-1", At: time.Unix(int64(k), 0)}); err != nil {
			return jobs.Job{}, err
		}
	}
	j.State, j.Progress = jobs.Succeeded, nil
	return j, nil
}

func TestEventStream(t *testing.T) {
	fj := newFakeJobs(false)
	srv := httptest.NewServer(NewHandler(DefaultConfig(), streamingJobs{fj}))
	defer srv.Close()
	ctx := context.Background()
	job, err := fj.Submit(ctx, engine.Spec{Prompt: "x"}.WithDefaults(), jobs.Options{})
	if err != nil {
		t.Fatal(err)
	}

	// The wire format, as a browser's EventSource reads it.
	resp, err := http.Get(srv.URL + "/v1/jobs/" + job.ID + "/events")
	if err != nil {
		t.Fatal(err)
	}
	body := new(strings.Builder)
	_, _ = io.Copy(body, resp.Body)
	resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	for _, want := range []string{"event: job\ndata: {", "event: progress\ndata: {\"stage\":\"denoise\",\"step\":2,\"total\":3,\"node\":\"den-1\",\"at\":", "event: done\ndata: {"} {
		if !strings.Contains(body.String(), want) {
			t.Fatalf("stream lacks %q:\n%s", want, body)
		}
	}

	// The Go client follows it.
	c := &Client{BaseURL: srv.URL}
	var steps []int
	var seen []jobs.State
	done, err := c.Events(ctx, job.ID, func(j jobs.Job) { seen = append(seen, j.State) }, func(st jobs.Step) { steps = append(steps, st.Step) })
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("Events = %+v %v", done, err)
	}
	if len(steps) != 3 || steps[0] != 1 || steps[2] != 3 || len(seen) != 1 || seen[0] != jobs.Running {
		t.Fatalf("steps %v, job states %v", steps, seen)
	}

	// A job that does not exist is a JSON 404 before any stream.
	if _, err := c.Events(ctx, "nope", nil, nil); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("Events of a missing job: %v", err)
	}
}

// A Jobs without a stream answers 501, and Generate falls back to polling.
func TestEventStreamNotImplemented(t *testing.T) {
	fj := newFakeJobs(true)
	h := NewHandler(DefaultConfig(), fj)
	job, err := fj.Submit(context.Background(), engine.Spec{Prompt: "x"}.WithDefaults(), jobs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if w := do(h, "GET", "/v1/jobs/"+job.ID+"/events", "", ""); w.Code != http.StatusNotImplemented {
		t.Fatalf("events without a streamer: %d %s", w.Code, w.Body)
	}
}
