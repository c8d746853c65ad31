package httpapi

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

const (
	tokAlice = "alice-0123456789abcdef"
	tokBob   = "bob-0123456789abcdef"
	tokAdmin = "root-0123456789abcdef"
)

func testTokens(t *testing.T) *Tokens {
	t.Helper()
	tk, err := ParseTokens(strings.NewReader("# clients\n" + tokAlice + "\n\n" + tokBob + "\nadmin:" + tokAdmin + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

func TestParseTokens(t *testing.T) {
	for _, c := range []struct {
		file, err string
	}{
		{"short\n", "at least 16 bytes"},
		{"admin:short\n", "at least 16 bytes"},
		{"has a space in it, long enough\n", "no spaces"},
		{"# nothing\n\n", "no tokens"},
	} {
		if _, err := ParseTokens(strings.NewReader(c.file)); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %v, want %q", c.file, err, c.err)
		}
	}
	tk := testTokens(t)
	if !tk.HasAdmin() {
		t.Fatal("no admin token")
	}
	if c, ok := tk.lookup(tokAdmin); !ok || !c.admin {
		t.Fatal("admin token not an admin's")
	}
	if c, ok := tk.lookup(tokAlice); !ok || c.admin || c.owner != TokenHash(tokAlice) {
		t.Fatalf("alice: %+v %v", c, ok)
	}
}

// tokenServer is a client API with tokens on a real socket.
func tokenServer(t *testing.T, j Jobs, perSec float64, burst int) string {
	t.Helper()
	cfg := testConfig(t)
	cfg.Tokens, cfg.RatePerToken, cfg.RateBurst = testTokens(t), perSec, burst
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
	return "http://" + ln.Addr().String()
}

// call sends one request with token ("" for none) and returns the status,
// the body and the response.
func call(t *testing.T, method, url, token, body string) (int, string, *http.Response) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp
}

// With tokens on, a job is its creator's: another token gets the same
// 404 as for an id that does not exist, an admin token sees everything,
// and the token hash the job records never leaves the server.
func TestTokensScopeJobs(t *testing.T) {
	f := newFakeJobs(false)
	base := tokenServer(t, frameFake{fakeJobs: f, pause: 0}, 0, 0)

	for _, tok := range []string{"", "not-a-known-token-at-all"} {
		code, body, resp := call(t, "GET", base+"/v1/jobs/job-1", tok, "")
		if code != http.StatusUnauthorized || !strings.Contains(body, CodeUnauthorized) || resp.Header.Get("WWW-Authenticate") == "" {
			t.Fatalf("token %q: %d %s", tok, code, body)
		}
	}
	code, body, _ := call(t, "POST", base+"/v1/jobs", tokAlice, `{"prompt":"mine"}`)
	if code != http.StatusAccepted || strings.Contains(body, "owner") || strings.Contains(body, TokenHash(tokAlice)) {
		t.Fatalf("submit: %d %s", code, body)
	}
	var job jobs.Job
	json.Unmarshal([]byte(body), &job)
	if got := f.jobs[job.ID].Owner; got != TokenHash(tokAlice) {
		t.Fatalf("job records owner %q, want the hash of the token", got)
	}

	_, missing, _ := call(t, "GET", base+"/v1/jobs/job-999", tokBob, "")
	for _, c := range []struct{ method, path string }{
		{"GET", "/v1/jobs/" + job.ID},
		{"GET", "/v1/jobs/" + job.ID + "?wait=1s"},
		{"GET", "/v1/jobs/" + job.ID + "/result"},
		{"GET", "/v1/jobs/" + job.ID + "/frames"},
		{"POST", "/v1/jobs/" + job.ID + "/cancel"},
		{"DELETE", "/v1/jobs/" + job.ID},
	} {
		code, body, _ := call(t, c.method, base+c.path, tokBob, "")
		if code != http.StatusNotFound || strings.Replace(body, job.ID, "job-999", 1) != missing {
			t.Fatalf("bob %s %s: %d %s; want the answer for a missing job: %s", c.method, c.path, code, body, missing)
		}
	}
	if f.jobs[job.ID].State != jobs.Queued {
		t.Fatalf("bob changed the job: %s", f.jobs[job.ID].State)
	}
	if code, body, _ := call(t, "GET", base+"/v1/jobs/"+job.ID, tokAlice, ""); code != http.StatusOK || strings.Contains(body, "owner") {
		t.Fatalf("alice reads her job: %d %s", code, body)
	}
	if code, body, _ := call(t, "GET", base+"/v1/jobs/"+job.ID+"/frames", tokAlice, ""); code != http.StatusOK || strings.Contains(body, "owner") {
		t.Fatalf("alice streams her job: %d %s", code, body)
	}
	if code, body, _ := call(t, "GET", base+"/v1/jobs/"+job.ID, tokAdmin, ""); code != http.StatusOK {
		t.Fatalf("admin reads: %d %s", code, body)
	}
	if code, body, _ := call(t, "POST", base+"/v1/jobs/"+job.ID+"/cancel", tokAdmin, ""); code != http.StatusOK || !strings.Contains(body, `"cancelled"`) {
		t.Fatalf("admin cancels: %d %s", code, body)
	}
}

func TestTokenRateLimit(t *testing.T) {
	base := tokenServer(t, newFakeJobs(true), 2, 3)
	for i := range 3 {
		if code, body, _ := call(t, "GET", base+"/v1/jobs/nope", tokAlice, ""); code != http.StatusNotFound {
			t.Fatalf("request %d within the burst: %d %s", i, code, body)
		}
	}
	code, body, resp := call(t, "GET", base+"/v1/jobs/nope", tokAlice, "")
	if code != http.StatusTooManyRequests || !strings.Contains(body, CodeRateLimited) || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("past the burst: %d Retry-After %q %s", code, resp.Header.Get("Retry-After"), body)
	}
	// Another token has its own bucket, and Alice's refills.
	if code, _, _ := call(t, "GET", base+"/v1/jobs/nope", tokBob, ""); code != http.StatusNotFound {
		t.Fatalf("bob: %d", code)
	}
	time.Sleep(600 * time.Millisecond)
	if code, _, _ := call(t, "GET", base+"/v1/jobs/nope", tokAlice, ""); code != http.StatusNotFound {
		t.Fatalf("alice after a refill: %d", code)
	}
}

func TestAdminAcceptsAdminTokens(t *testing.T) {
	h := NewAdminHandler(AdminConfig{Tokens: testTokens(t), Logger: testConfig(t).Logger})
	for _, c := range []struct {
		path, token string
		want        int
	}{
		{"/livez", "", http.StatusOK},
		{"/readyz", "", http.StatusUnauthorized},
		{"/readyz", tokAlice, http.StatusUnauthorized}, // a client token is not an admin's
		{"/readyz", tokAdmin, http.StatusOK},
		{"/debug/pprof/cmdline", tokAlice, http.StatusUnauthorized},
		{"/debug/pprof/cmdline", tokAdmin, http.StatusOK},
	} {
		r, _ := http.NewRequest("GET", c.path, nil)
		if c.token != "" {
			r.Header.Set("Authorization", "Bearer "+c.token)
		}
		w := &recorder{header: http.Header{}}
		h.ServeHTTP(w, r)
		if w.code != c.want {
			t.Errorf("%s with %q: %d, want %d", c.path, c.token, w.code, c.want)
		}
	}
}

// recorder is the least of a ResponseWriter.
type recorder struct {
	header http.Header
	code   int
}

func (w *recorder) Header() http.Header { return w.header }
func (w *recorder) Write(b []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return len(b), nil
}
func (w *recorder) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}
