package httpapi

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// Client speaks the native client API. The zero value is not usable: set
// BaseURL ("http://host:8080"); HTTP defaults to http.DefaultClient.
type Client struct {
	BaseURL string
	HTTP    *http.Client
	Token   string // sent as "Authorization: Bearer <Token>" when set (--api-tokens)
}

// Client-side bounds on what it will read.
const (
	maxErrorBody  = 64 << 10
	maxJobBody    = 1 << 20
	maxResultBody = 1 << 30 // far above any result the engine's limits allow

	pollInterval = 200 * time.Millisecond // progress refresh while a person watches
	longPoll     = 30 * time.Second       // GET ?wait= when nobody watches
)

// Submit creates a job.
func (c *Client) Submit(ctx context.Context, req JobRequest) (jobs.Job, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return jobs.Job{}, fmt.Errorf("httpapi: encoding request: %w", err)
	}
	var job jobs.Job
	err = c.doJSON(ctx, http.MethodPost, "/v1/jobs", bytes.NewReader(body), &job)
	return job, err
}

// Fork submits a job that re-denoises job id from its checkpoint after
// req.FromStep with req's changes (POST /v1/jobs/{id}/fork).
func (c *Client) Fork(ctx context.Context, id string, req ForkRequest) (jobs.Job, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return jobs.Job{}, fmt.Errorf("httpapi: encoding request: %w", err)
	}
	var job jobs.Job
	err = c.doJSON(ctx, http.MethodPost, jobPath(id)+"/fork", bytes.NewReader(body), &job)
	return job, err
}

// Get returns the job's current record, progress included.
func (c *Client) Get(ctx context.Context, id string) (jobs.Job, error) {
	var job jobs.Job
	err := c.doJSON(ctx, http.MethodGet, jobPath(id), nil, &job)
	return job, err
}

// Wait long-polls the job for up to max (the server caps it), returning
// the job when it is terminal or when max runs out, whichever is first.
func (c *Client) Wait(ctx context.Context, id string, max time.Duration) (jobs.Job, error) {
	var job jobs.Job
	p := jobPath(id) + "?wait=" + url.QueryEscape(max.String())
	err := c.doJSON(ctx, http.MethodGet, p, nil, &job)
	return job, err
}

// Result returns the job's output and its content type. A job that has not
// succeeded yields an *APIError: code "not_ready", "cancelled", or the
// job's own failure code.
func (c *Client) Result(ctx context.Context, id string) ([]byte, string, error) {
	resp, err := c.do(ctx, http.MethodGet, jobPath(id)+"/result", nil)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxResultBody+1))
	if err != nil {
		return nil, "", fmt.Errorf("httpapi: reading result of %s: %w", id, err)
	}
	if len(data) > maxResultBody {
		return nil, "", fmt.Errorf("httpapi: result of %s is larger than %d bytes", id, maxResultBody)
	}
	return data, resp.Header.Get("Content-Type"), nil
}

// Cancel stops a queued or running job and returns its record; a finished
// job is left alone (an *APIError with code already_finished).
func (c *Client) Cancel(ctx context.Context, id string) (jobs.Job, error) {
	var job jobs.Job
	err := c.doJSON(ctx, http.MethodPost, jobPath(id)+"/cancel", nil, &job)
	return job, err
}

// Delete removes a finished job and its result (a running one is cancelled
// instead).
func (c *Client) Delete(ctx context.Context, id string) error {
	var ack deleteResponse
	return c.doJSON(ctx, http.MethodDelete, jobPath(id), nil, &ack)
}

// submitGrace is how long Generate still waits for a submission's answer
// after its context ended.
const submitGrace = 2 * time.Second

// Generate submits req, follows the job to its end and returns its output.
// With progress set, it follows the job's event stream and reports the job
// at each change and each denoise step (polling every 200ms a server
// without the stream); without, it long-polls. On failure the returned job
// is the last one seen, so a caller can tell whether anything was
// submitted.
func (c *Client) Generate(ctx context.Context, req JobRequest, progress func(jobs.Job)) (jobs.Job, []byte, error) {
	// A submission under way when ctx ends is given submitGrace to answer:
	// the job may exist already, and the caller can withdraw it only if it
	// learns its id.
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(submitGrace, cancel) })
	job, err := c.Submit(sctx, req)
	stop()
	if err != nil {
		return job, nil, err
	}
	if ctx.Err() != nil {
		return job, nil, ctx.Err()
	}
	if progress != nil {
		progress(job)
		job, err = c.follow(ctx, job, progress)
	}
	for err == nil && !job.State.Terminal() {
		job, err = c.Wait(ctx, job.ID, longPoll)
	}
	if err != nil {
		return job, nil, err
	}
	// A failed or cancelled job answers with its reason as an *APIError.
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		return job, nil, err
	}
	return job, data, nil
}

// follow reports the job to progress at each change and step until it is
// terminal: from its event stream, or by polling a server without one.
func (c *Client) follow(ctx context.Context, job jobs.Job, progress func(jobs.Job)) (jobs.Job, error) {
	last := job
	done, err := c.Events(ctx, job.ID, func(j jobs.Job) {
		last = j
		progress(j)
	}, func(st jobs.Step) {
		if p := last.Progress; p != nil && p.Stage == st.Stage {
			cp := *p
			cp.Step, cp.Total = st.Step, st.Total
			last.Progress = &cp
			progress(last)
		}
	})
	var apiErr *APIError
	switch {
	case err == nil:
		progress(done)
		return done, nil
	case !errors.As(err, &apiErr) || (apiErr.Status != http.StatusNotImplemented && apiErr.Code != CodeNotFound):
		return last, err
	}
	// A server without the stream (501, or an older one's 404 for the
	// endpoint): poll.
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for !job.State.Terminal() {
		select {
		case <-ctx.Done():
			return job, ctx.Err()
		case <-tick.C:
		}
		next, err := c.Get(ctx, job.ID)
		if err != nil {
			return job, err
		}
		job = next
		progress(job)
	}
	return job, nil
}

func jobPath(id string) string { return "/v1/jobs/" + url.PathEscape(id) }

func (c *Client) doJSON(ctx context.Context, method, path string, body io.Reader, out any) error {
	resp, err := c.do(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxJobBody+1))
	if err != nil {
		return fmt.Errorf("httpapi: %s %s: reading response: %w", method, path, err)
	}
	if len(b) > maxJobBody {
		return fmt.Errorf("httpapi: %s %s: response larger than %d bytes", method, path, maxJobBody)
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("httpapi: %s %s: decoding response: %w", method, path, err)
	}
	return nil
}

// do sends a request and turns any non-2xx answer into an *APIError; a
// 2xx response's body is the caller's to close.
func (c *Client) do(ctx context.Context, method, path string, body io.Reader) (*http.Response, error) {
	base := strings.TrimRight(c.BaseURL, "/")
	if base == "" {
		return nil, errors.New("httpapi: Client.BaseURL is not set")
	}
	req, err := http.NewRequestWithContext(ctx, method, base+path, body)
	if err != nil {
		return nil, fmt.Errorf("httpapi: %s %s: %w", method, path, err)
	}
	req.Header.Set("Accept", "application/json")
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err // *url.Error: names the method and URL already
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return resp, nil
	}
	defer resp.Body.Close()
	return nil, readAPIError(resp)
}

// readAPIError decodes an error body, or makes one from the status line
// when something other than this API (a proxy, say) answered.
func readAPIError(resp *http.Response) *APIError {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	var env errorEnvelope
	if err := json.Unmarshal(b, &env); err == nil && env.Error != nil && env.Error.Message != "" {
		env.Error.Status = resp.StatusCode
		return env.Error
	}
	msg := strings.TrimSpace(string(b))
	if msg == "" || len(msg) > 200 {
		msg = http.StatusText(resp.StatusCode)
	}
	return &APIError{Status: resp.StatusCode, Type: "http_error", Message: msg}
}

// Events follows the job's event stream (GET /v1/jobs/{id}/events): onJob
// with the job at each change, onStep (may be nil) with each denoise step,
// until the stream's "done" event, whose job it returns. Each event's data
// is bounded like a job body.
func (c *Client) Events(ctx context.Context, id string, onJob func(jobs.Job), onStep func(jobs.Step)) (jobs.Job, error) {
	path := jobPath(id) + "/events"
	resp, err := c.do(ctx, http.MethodGet, path, nil)
	if err != nil {
		return jobs.Job{}, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), maxJobBody)
	var event string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			data := []byte(strings.TrimPrefix(line, "data: "))
			switch event {
			case "job", "done":
				var j jobs.Job
				if err := json.Unmarshal(data, &j); err != nil {
					return jobs.Job{}, fmt.Errorf("httpapi: %s: %s event: %w", path, event, err)
				}
				if event == "done" {
					return j, nil
				}
				if onJob != nil {
					onJob(j)
				}
			case "progress":
				var st jobs.Step
				if err := json.Unmarshal(data, &st); err != nil {
					return jobs.Job{}, fmt.Errorf("httpapi: %s: progress event: %w", path, err)
				}
				if onStep != nil {
					onStep(st)
				}
			case "error":
				var env errorEnvelope
				if json.Unmarshal(data, &env) == nil && env.Error != nil {
					return jobs.Job{}, env.Error
				}
				return jobs.Job{}, fmt.Errorf("httpapi: %s: error event: %s", path, data)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return jobs.Job{}, fmt.Errorf("httpapi: %s: %w", path, err)
	}
	if err := ctx.Err(); err != nil {
		return jobs.Job{}, err
	}
	return jobs.Job{}, fmt.Errorf("httpapi: %s: stream ended before the job finished", path)
}
