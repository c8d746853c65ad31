package httpapi

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// tightServer is a client API on a real socket with timeouts short enough
// to test: every deadline is well under a second.
func tightServer(t *testing.T, j Jobs, mod func(*ServerConfig)) string {
	t.Helper()
	cfg := testConfig(t)
	cfg.Server = ServerConfig{
		ReadHeaderTimeout: 300 * time.Millisecond,
		ReadTimeout:       400 * time.Millisecond,
		WriteTimeout:      400 * time.Millisecond,
		IdleTimeout:       500 * time.Millisecond,
		MaxHeaderBytes:    4 << 10,
		MaxInFlight:       64,
	}
	if mod != nil {
		mod(&cfg.Server)
	}
	srv := NewServer(NewHandler(cfg, j), cfg.Server, cfg.Logger)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return ln.Addr().String()
}

// closedWithin reads c until the server closes it and returns how long
// that took; it fails the test if the connection is still open after max.
func closedWithin(t *testing.T, c net.Conn, start time.Time, max time.Duration) time.Duration {
	t.Helper()
	_ = c.SetReadDeadline(start.Add(max))
	_, err := io.Copy(io.Discard, c)
	took := time.Since(start)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("connection still open after %v", took)
	}
	return took
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestServerClosesSlowClients(t *testing.T) {
	addr := tightServer(t, newFakeJobs(true), nil)

	t.Run("slow headers", func(t *testing.T) {
		c := dial(t, addr)
		start := time.Now()
		fmt.Fprintf(c, "GET /v1/jobs/x HTTP/1.1\r\nHost: x\r\n") // and never the blank line
		took := closedWithin(t, c, start, 3*time.Second)
		t.Logf("closed after %v (ReadHeaderTimeout 300ms)", took)
	})
	t.Run("slow body", func(t *testing.T) {
		c := dial(t, addr)
		start := time.Now()
		fmt.Fprintf(c, "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
		stop := make(chan struct{})
		defer close(stop)
		go func() { // a byte every 100 ms: 10 s for the body
			for {
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
					if _, err := c.Write([]byte(" ")); err != nil {
						return
					}
				}
			}
		}()
		took := closedWithin(t, c, start, 3*time.Second)
		t.Logf("closed after %v (ReadTimeout 400ms)", took)
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		c := dial(t, addr)
		fmt.Fprintf(c, "GET /v1/jobs/nope HTTP/1.1\r\nHost: x\r\n\r\n")
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound || resp.Close {
			t.Fatalf("status %d close %v; want a kept-alive 404", resp.StatusCode, resp.Close)
		}
		start := time.Now()
		took := closedWithin(t, c, start, 3*time.Second)
		if took < 400*time.Millisecond {
			t.Fatalf("idle connection closed after %v, before IdleTimeout", took)
		}
		t.Logf("idle connection closed after %v (IdleTimeout 500ms)", took)
	})
	t.Run("huge headers", func(t *testing.T) {
		c := dial(t, addr)
		fmt.Fprintf(c, "GET /v1/jobs/x HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", strings.Repeat("a", 16<<10))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("status %d, want 431", resp.StatusCode)
		}
	})
}

// frameFake streams one frame, waits past every server timeout, then a
// second frame.
type frameFake struct {
	*fakeJobs
	pause time.Duration
}

func (f frameFake) StreamFrames(ctx context.Context, id string, emit func(jobs.Frame) error) (jobs.Job, error) {
	for i := range 2 {
		if i > 0 {
			select {
			case <-ctx.Done():
				return jobs.Job{}, ctx.Err()
			case <-time.After(f.pause):
			}
		}
		if err := emit(jobs.Frame{Index: i, PNG: []byte("png")}); err != nil {
			return jobs.Job{}, err
		}
	}
	return f.Get(ctx, id)
}

// Long polls, event streams and synchronous generation outlive the
// server's Read and WriteTimeout, which every other answer keeps.
func TestLongRequestsOutliveServerTimeouts(t *testing.T) {
	f := newFakeJobs(false)
	addr := tightServer(t, frameFake{fakeJobs: f, pause: time.Second}, nil)
	base := "http://" + addr
	cl := &http.Client{Timeout: 10 * time.Second}

	resp, err := cl.Post(base+"/v1/jobs", "application/json", strings.NewReader(`{"prompt":"a"}`))
	if err != nil {
		t.Fatal(err)
	}
	var job jobs.Job
	json.NewDecoder(resp.Body).Decode(&job)
	resp.Body.Close()

	t.Run("long poll runs out", func(t *testing.T) {
		start := time.Now()
		resp, err := cl.Get(base + "/v1/jobs/" + job.ID + "?wait=1200ms")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var got jobs.Job
		if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || resp.StatusCode != 200 || got.ID != job.ID {
			t.Fatalf("status %d, %+v, %v", resp.StatusCode, got, err)
		}
		if took := time.Since(start); took < 1200*time.Millisecond {
			t.Fatalf("answered after %v, before its wait", took)
		}
	})
	t.Run("long poll answered", func(t *testing.T) {
		go func() {
			time.Sleep(900 * time.Millisecond)
			f.update(job.ID, func(j *jobs.Job) { j.State = jobs.Succeeded })
		}()
		resp, err := cl.Get(base + "/v1/jobs/" + job.ID + "?wait=5s")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var got jobs.Job
		if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || got.State != jobs.Succeeded {
			t.Fatalf("status %d, %+v, %v", resp.StatusCode, got, err)
		}
	})
	t.Run("frame stream", func(t *testing.T) {
		resp, err := cl.Get(base + "/v1/jobs/" + job.ID + "/frames")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		if n := strings.Count(string(b), "event: frame"); n != 2 || !strings.Contains(string(b), "event: done") {
			t.Fatalf("stream:\n%s", b)
		}
	})
	t.Run("synchronous generation", func(t *testing.T) {
		f2 := newFakeJobs(false)
		addr2 := tightServer(t, f2, nil)
		go func() {
			time.Sleep(time.Second)
			f2.update("job-1", func(j *jobs.Job) { j.State = jobs.Succeeded })
		}()
		resp, err := cl.Post("http://"+addr2+"/v1/images/generations", "application/json", strings.NewReader(`{"prompt":"a","response_format":"b64_json"}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out ImagesResponse
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 || len(out.Data) != 1 {
			t.Fatalf("status %d, %+v, %v", resp.StatusCode, out, err)
		}
	})
}

func TestInFlightCap(t *testing.T) {
	f := newFakeJobs(false)
	addr := tightServer(t, f, func(c *ServerConfig) { c.MaxInFlight = 2 })
	base := "http://" + addr
	job, _ := f.Submit(context.Background(), engine.Spec{Prompt: "a"}, jobs.Options{})

	// Two long polls hold both slots. A poll that meets the probe below in
	// a slot is refused; it asks again, so both polls end up holding one.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	for range 2 {
		go func() {
			defer func() { done <- struct{}{} }()
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, "GET", base+"/v1/jobs/"+job.ID+"?wait=30s", nil)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusServiceUnavailable {
					return
				}
			}
		}()
	}
	defer func() {
		cancel()
		<-done
		<-done
	}()
	var resp *http.Response
	eventually(t, "a third request refused", func() bool {
		start := time.Now()
		r, err := http.Get(base + "/v1/jobs/" + job.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.StatusCode != http.StatusServiceUnavailable {
			r.Body.Close()
			return false
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("refusal took %v", took)
		}
		resp = r
		return true
	})
	defer resp.Body.Close()
	var env errorEnvelope
	if err := json.NewDecoder(resp.Body).Decode(&env); err != nil || env.Error.Code != CodeOverloaded || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("%+v %v, Retry-After %q", env.Error, err, resp.Header.Get("Retry-After"))
	}
	// A slot frees as soon as a poll ends.
	f.update(job.ID, func(j *jobs.Job) { j.State = jobs.Succeeded })
	eventually(t, "requests served again", func() bool {
		r, err := http.Get(base + "/v1/jobs/" + job.ID)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		return r.StatusCode == http.StatusOK
	})
}
