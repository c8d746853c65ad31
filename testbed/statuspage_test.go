package testbed

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// The status page, in Debian's headless Chromium against a real
// three-node mesh that has run a job: the page asks for the admin token,
// then shows the three nodes alive and the job's Gantt timeline, a bar per
// phase of each stage on the node that ran it, loading nothing but the
// admin endpoint's own files and data. The screenshot is saved in the
// test's artifact directory (go test -artifacts -outputdir DIR keeps it).
//
// chromedp drives the browser rather than `chromium --dump-dom`: the test
// types the token as an operator would and waits for the DOM to hold the
// bars (no virtual-time budget to guess), over the DevTools protocol that
// also gives the screenshot and every request the page made.
func TestStatusPageInBrowser(t *testing.T) {
	browser := chromiumPath(t)
	const token = "status-page-test-token"
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) { c.Agent.AdminToken = token })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := cl.Run(ctx, []engine.Spec{{Prompt: "a red fox in a snowy forest at dawn", Width: 64, Height: 64, Frames: 1, Steps: 4, Seed: 7}})
	if err != nil {
		t.Fatal(err)
	}
	job := out[0].Job
	admin := "http://" + cl.Agents[0].AdminAddr()

	// The page's files load without the token; its data does not.
	for path, want := range map[string]int{"/ui/": 200, "/ui/app.js": 200, "/ui/style.css": 200, "/v1/admin/jobs": 401, "/v1/admin/status": 401} {
		if code, _ := adminGet(t, admin+path, ""); code != want {
			t.Errorf("GET %s without token: %d, want %d", path, code, want)
		}
	}
	code, body := adminGet(t, admin+"/v1/admin/jobs?limit=5", token)
	var recent agent.RecentJobs
	if code != 200 || json.Unmarshal(body, &recent) != nil || len(recent.Jobs) != 1 || recent.Jobs[0].ID != job.ID {
		t.Fatalf("GET /v1/admin/jobs: %d %s, want the job %s", code, body, job.ID)
	}
	if code, _ := adminGet(t, admin+"/v1/admin/jobs?limit=1000", token); code != 400 {
		t.Errorf("limit past the cap: %d, want 400", code)
	}

	opts := append(slices.Clone(chromedp.DefaultExecAllocatorOptions[:]),
		chromedp.ExecPath(browser),
		chromedp.NoSandbox, // tests run as root, where Chromium's sandbox will not start
		chromedp.WindowSize(1400, 1000),
	)
	actx, acancel := chromedp.NewExecAllocator(ctx, opts...)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()

	var mu sync.Mutex // guards the two slices below, filled by the listener
	var requests, exceptions []string
	err = chromedp.Listen(bctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch e := ev.(type) {
		case *network.EventRequestWillBeSent:
			requests = append(requests, e.Request.URL)
		case *runtime.EventExceptionThrown:
			exceptions = append(exceptions, e.ExceptionDetails.Text)
		}
	})
	if err != nil {
		t.Fatalf("browser: %v", err)
	}
	if _, err := chromedp.Call(bctx, network.Enable, network.EnableParams{}); err != nil {
		t.Fatalf("browser: network.enable: %v", err)
	}

	bar := func(stage jobs.Stage, phase string) string {
		return `.bar[data-job="` + job.ID + `"][data-stage="` + string(stage) + `"][data-phase="` + phase + `"]`
	}
	steps := []chromedp.Action[chromedp.Void]{
		chromedp.Navigate(admin + "/ui/"),
		chromedp.WaitVisible("#token"), // the data reads answered 401: the page asks
		chromedp.SendKeys("#token", token),
		chromedp.Click("#token-save"),
		chromedp.WaitVisible("#content"),
		chromedp.WaitReady(bar(jobs.Decode, "committed")),
	}
	for _, a := range cl.Agents {
		steps = append(steps, chromedp.WaitReady(`#nodes tr[data-node="`+a.ID()+`"] td.health.alive`))
	}
	if err := chromedp.Do(bctx, steps...); err != nil {
		t.Fatalf("browser: %v", err)
	}
	eval := func(expr string, v any) {
		t.Helper()
		raw, err := chromedp.Run(bctx, chromedp.Evaluate[[]byte](expr))
		if err == nil {
			err = json.Unmarshal(raw, v)
		}
		if err != nil {
			t.Fatalf("browser: %s: %v", expr, err)
		}
	}
	var nodes, health []string
	var bars []struct{ Stage, Phase, Node, Transport string }
	var cssLoaded bool
	eval(`[...document.querySelectorAll("#nodes tr[data-node]")].map(r => r.dataset.node)`, &nodes)
	eval(`[...document.querySelectorAll("#nodes td.health")].map(c => c.textContent)`, &health)
	eval(`[...document.querySelectorAll('.bar[data-job="`+job.ID+`"]')].map(b => ({Stage: b.dataset.stage, Phase: b.dataset.phase, Node: b.dataset.node, Transport: b.dataset.transport}))`, &bars)
	eval(`getComputedStyle(document.querySelector(".lane .bar.ran")).position === "absolute"`, &cssLoaded)
	png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100)) // 100: PNG
	if err != nil {
		t.Fatalf("browser: screenshot: %v", err)
	}

	shot := filepath.Join(t.ArtifactDir(), "status-page.png")
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", shot)

	var ids []string
	for _, a := range cl.Agents {
		ids = append(ids, a.ID())
	}
	slices.Sort(ids)
	if !slices.Equal(nodes, ids) {
		t.Errorf("page shows nodes %v, want %v", nodes, ids)
	}
	if want := []string{"alive", "alive", "alive"}; !slices.Equal(health, want) {
		t.Errorf("page shows health %v, want %v", health, want)
	}
	for _, st := range jobs.Stages() {
		rec := job.Stages[st]
		for _, phase := range []string{"queued", "claimed", "transferred", "ran", "committed"} {
			found := false
			for _, b := range bars {
				if b.Stage == string(st) && b.Phase == phase {
					found = true
					if b.Node != rec.Node {
						t.Errorf("%s %s bar on %q, want %q (the stage record's node)", st, phase, b.Node, rec.Node)
					}
					// Denoise and decode pull their input: the record names
					// the transport, and the transferred bar shows it.
					if phase == "transferred" && st != jobs.Encode && (rec.Transport == "" || b.Transport != rec.Transport) {
						t.Errorf("%s transferred bar by %q, the stage record says %q (want a transport)", st, b.Transport, rec.Transport)
					}
				}
			}
			if !found {
				t.Errorf("no %s %s bar for job %s; bars: %v", st, phase, job.ID, bars)
			}
		}
	}
	if !cssLoaded {
		t.Error("the page's stylesheet did not apply")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(exceptions) > 0 {
		t.Errorf("page script threw: %v", exceptions)
	}
	for _, u := range requests {
		if !strings.HasPrefix(u, admin+"/") {
			t.Errorf("page fetched %s: only the admin endpoint's own files and data are allowed (no CDN)", u)
		}
	}
	if len(requests) < 5 { // page, script, style, status, jobs
		t.Errorf("saw %d requests, want the page's files and its data reads: %v", len(requests), requests)
	}
}

// chromiumPath finds Debian's chromium (scripts/install-deps.sh installs
// it); without it the test fails, unless -short.
func chromiumPath(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("chromium")
	if err == nil {
		return p
	}
	if testing.Short() {
		t.Skip("chromium not installed (scripts/install-deps.sh installs it)")
	}
	t.Fatal("chromium not installed: run scripts/install-deps.sh")
	return ""
}

// adminGet reads url with the bearer token ("" for none).
func adminGet(t *testing.T, url, token string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, b
}
