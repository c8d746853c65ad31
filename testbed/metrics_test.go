package testbed

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// promtool is Debian's (package prometheus, scripts/install-deps.sh). The
// tests that need it fail without it, as CI installs it; -short skips them.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		if testing.Short() {
			t.Skip("promtool not installed (apt-get install prometheus)")
		}
		t.Fatalf("promtool not installed: run scripts/install-deps.sh (Debian package prometheus): %v", err)
	}
	return p
}

// scrapeMetrics reads an agent's /metrics as text.
func scrapeMetrics(t *testing.T, admin string) []byte {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("metrics: %d %v", resp.StatusCode, err)
	}
	return b
}

// families parses Prometheus text.
func families(t *testing.T, text []byte) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mf, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		t.Fatalf("parsing metrics: %v", err)
	}
	return mf
}

// sample sums the values of family name's series whose labels include
// want (counters, gauges; for histograms their observation counts).
func sample(mf map[string]*dto.MetricFamily, name string, want map[string]string) (sum float64, n int) {
	f := mf[name]
	if f == nil {
		return 0, 0
	}
next:
	for _, m := range f.Metric {
		for k, v := range want {
			found := false
			for _, l := range m.Label {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		n++
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Histogram != nil:
			sum += float64(m.Histogram.GetSampleCount())
		}
	}
	return sum, n
}

// Jobs run through a real three-agent mesh on the embedded etcd move the
// series an operator alerts on, every agent's /metrics passes promtool's
// lint without a warning, and the depth of each stage's queue is exported
// by exactly one agent, so a sum over agents is the mesh's.
func TestMetricsMoveUnderLoad(t *testing.T) {
	tool := promtool(t)
	cl := startCluster(t, Disaggregated, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	specs := []engine.Spec{
		{Prompt: "a red fox in the snow", Width: 64, Height: 64, Frames: 1, Steps: 2, Seed: 1},
		{Prompt: "ocean waves", Width: 64, Height: 64, Frames: 4, Steps: 2, Seed: 2},
	}
	if _, err := cl.Run(ctx, specs); err != nil {
		t.Fatal(err)
	}

	byStage := map[jobs.Stage]map[string]*dto.MetricFamily{}
	for _, a := range cl.Agents {
		text := scrapeMetrics(t, a.AdminAddr())
		cmd := exec.Command(tool, "check", "metrics")
		cmd.Stdin = bytes.NewReader(text)
		if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) != 0 {
			t.Errorf("promtool check metrics on %s: %v\n%s", a.ID(), err, out)
		}
		byStage[jobs.Stage(strings.TrimSuffix(a.ID(), "-1"))] = families(t, text)
	}

	type check struct {
		stage  jobs.Stage
		name   string
		labels map[string]string
	}
	for _, c := range []check{
		{jobs.Encode, "latentmesh_queue_wait_seconds", map[string]string{"stage": "encode", "class": "standard"}},
		{jobs.Denoise, "latentmesh_queue_wait_seconds", map[string]string{"stage": "denoise"}},
		{jobs.Decode, "latentmesh_stage_duration_seconds", map[string]string{"stage": "decode", "class": "standard"}},
		{jobs.Decode, "latentmesh_job_duration_seconds", map[string]string{"class": "standard"}},
		{jobs.Decode, "latentmesh_time_to_first_frame_seconds", map[string]string{"class": "standard"}},
		{jobs.Denoise, "latentmesh_transfer_bytes_total", map[string]string{"purpose": "stage"}},
		{jobs.Decode, "latentmesh_transfer_bytes_total", map[string]string{"purpose": "stage"}},
		{jobs.Decode, "latentmesh_transfer_seconds_total", map[string]string{"purpose": "stage"}},
		{jobs.Decode, "latentmesh_etcd_request_duration_seconds", map[string]string{"op": "txn"}},
		{jobs.Encode, "latentmesh_etcd_request_duration_seconds", map[string]string{"op": "lease_grant"}},
		{jobs.Encode, "latentmesh_jobs_submitted_total", nil},
		{jobs.Decode, "latentmesh_jobs_finished_total", map[string]string{"state": "succeeded"}},
		{jobs.Encode, "latentmesh_engine_registered", map[string]string{"engine": "builtin"}},
		{jobs.Denoise, "go_goroutines", nil},
		{jobs.Denoise, "process_resident_memory_bytes", nil},
		{jobs.Denoise, "go_build_info", nil},
	} {
		if v, _ := sample(byStage[c.stage], c.name, c.labels); v <= 0 {
			t.Errorf("%s agent: %s%v is %v after two jobs, want > 0", c.stage, c.name, c.labels, v)
		}
	}
	// Two jobs: the decode agent saw both end to end; the video's first
	// frame came before its result.
	if v, _ := sample(byStage[jobs.Decode], "latentmesh_job_duration_seconds", nil); v != 2 {
		t.Errorf("job latency observed %v times, want 2", v)
	}
	for st, mf := range byStage {
		if v, _ := sample(mf, "latentmesh_gossip_members", map[string]string{"state": "alive"}); v != 3 {
			t.Errorf("%s agent sees %v alive members, want 3", st, v)
		}
		if _, n := sample(mf, "latentmesh_credits_in_use", map[string]string{"stage": string(st)}); n != 1 {
			t.Errorf("%s agent: %d credits_in_use series for its stage", st, n)
		}
	}
	// The docs, the dashboard and the alerts name only series an agent
	// exports, and the docs list every series exported.
	exported := map[string]bool{ // series that appear with their first event
		"latentmesh_engine_last_heartbeat_timestamp_seconds": true, // an external engine's frame
		"latentmesh_etcd_request_errors_total":               true, // a failed etcd request (its code is a label)
		"latentmesh_http_requests_total":                     true, // a client API request (Run calls the agent)
	}
	for _, mf := range byStage {
		for name := range mf {
			exported[name] = true
		}
	}
	named := regexp.MustCompile(`latentmesh_[a-z_]+`)
	for _, doc := range []string{"metrics.md", "grafana-dashboard.json", "alerts.yml"} {
		b, err := os.ReadFile(filepath.Join("..", "docs", doc))
		if err != nil {
			t.Fatal(err)
		}
		listed := map[string]bool{}
		for _, n := range named.FindAllString(string(b), -1) {
			n = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_count"), "_sum")
			listed[n] = true
			if !exported[n] && n != "latentmesh_" {
				t.Errorf("docs/%s names %s, which no agent exports", doc, n)
			}
		}
		if doc != "metrics.md" {
			continue
		}
		for n := range exported {
			if strings.HasPrefix(n, "latentmesh_") && !listed[n] {
				t.Errorf("docs/metrics.md does not list %s", n)
			}
		}
	}
	// Every agent reports the tasks waiting in its own ledger of each
	// stage, one series a class: a sum over agents is the mesh's backlog.
	for _, st := range jobs.Stages() {
		for agent, mf := range byStage {
			if _, n := sample(mf, "latentmesh_queue_depth", map[string]string{"stage": string(st)}); n != 3 {
				t.Errorf("%s, stage %s: %d queue depth series, want one per class", agent, st, n)
			}
		}
	}
}

// The shipped alert rules load in Prometheus's own checker.
func TestAlertRules(t *testing.T) {
	tool := promtool(t)
	rules := filepath.Join("..", "docs", "alerts.yml")
	out, err := exec.Command(tool, "check", "rules", rules).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check rules %s: %v\n%s", rules, err, out)
	}
	if !strings.Contains(string(out), "SUCCESS") {
		t.Fatalf("promtool check rules: %s", out)
	}
}
