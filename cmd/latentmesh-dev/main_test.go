package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/testbed/sim"
)

func runCmd(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string // in stderr
	}{
		{nil, 2, "usage: latentmesh-dev"},
		{[]string{"agent"}, 2, `unknown command "agent"`},
		{[]string{"demo"}, 2, "--out DIR is required"},
		{[]string{"demo", "--out", "x", "--topology", "ring"}, 2, "unknown topology"},
		{[]string{"demo", "--out", "x", "extra"}, 2, `unexpected argument "extra"`},
		{[]string{"dev", "--agents", "2"}, 2, "want 0, 1, or 3 or more"},
		{[]string{"bench", "transfer", "--sizes", "big"}, 2, "big"},
		{[]string{"bench", "control", "--agents", "4,many"}, 2, "want positive integers"},
		{[]string{"bench", "control", "--etcd-metrics", "http://127.0.0.1:1/metrics"}, 2, "--etcd-metrics needs --etcd-endpoints"},
		{[]string{"bench", "control", "--agents", "2"}, 1, "at least 3"},
		{[]string{"testbed"}, 2, "usage: latentmesh-dev testbed"},
		{[]string{"testbed", "storm"}, 2, `unknown command "storm"`},
		{[]string{"testbed", "chaos", "--agents", "2"}, 2, "want at least 3"},
		{[]string{"testbed", "chaos", "--duration", "soon"}, 2, "--duration"},
		{[]string{"plan", "--model", "sd9", "--gpus", "8"}, 2, "flux.1-dev"},
		{[]string{"plan", "--model", "flux.1-dev", "--gpus", "2"}, 2, "cannot give each of 3 stages"},
		{[]string{"sim", "--model", "sd9"}, 2, "flux.1-dev"},
		{[]string{"sim", "--gpus", "2"}, 2, "at least one per stage"},
		{[]string{"sim", "--etcd-profile", "huge"}, 2, "local or dedicated"},
		{[]string{"sim", "--duration", "0", "--sweep-duration", "0"}, 2, "nor both 0"},
		{[]string{"sim", "--pools", "1:2"}, 2, "--pools"},
		{[]string{"sim", "--backpressure-slack", "-1"}, 2, "must not be negative"},
		{[]string{"sim", "--trace", "/nonexistent/trace.jsonl"}, 2, "--trace"},
	}
	for _, tt := range tests {
		code, _, stderr := runCmd(tt.args...)
		if code != tt.code || !strings.Contains(stderr, tt.want) {
			t.Errorf("%q: exit %d, stderr %q; want exit %d and %q", tt.args, code, stderr, tt.code, tt.want)
		}
	}
}

func TestHelp(t *testing.T) {
	if code, out, _ := runCmd("help"); code != 0 || !strings.Contains(out, "bench") || !strings.Contains(out, "testbed") {
		t.Fatalf("help: %d %q", code, out)
	}
	if code, out, _ := runCmd("testbed", "help"); code != 0 || !strings.Contains(out, "chaos") {
		t.Fatalf("testbed help: %d %q", code, out)
	}
	if code, _, errOut := runCmd("testbed", "chaos", "-h"); code != 0 || !strings.Contains(errOut, "-agent-binary") {
		t.Fatalf("testbed chaos -h: %d %q", code, errOut)
	}
}

// plan sizes pools from the cost model and says why.
func TestPlan(t *testing.T) {
	code, out, errOut := runCmd("plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "16", "--rate", "1")
	if code != 0 || !strings.Contains(out, "E:D:V = 2:13:1") || !strings.Contains(out, "denoise sets the pace") {
		t.Fatalf("plan: %d %q %q", code, out, errOut)
	}
	code, out, _ = runCmd("plan", "--model", "qwen-image", "--gpus", "8", "--rate", "5", "--json")
	var p struct {
		Pools    string  `json:"pools"`
		Capacity float64 `json:"capacity"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &p) != nil || p.Pools != "1:6:1" || p.Capacity <= 0 {
		t.Fatalf("plan --json: %d %q", code, out)
	}
}

// sim runs the table and the sweep and reports where etcd saturates.
func TestSim(t *testing.T) {
	code, out, errOut := runCmd("sim", "--gpus", "30", "--duration", "30s", "--sweep-duration", "10s", "--json")
	var rep struct {
		Runs []struct {
			Mode      string  `json:"mode"`
			Completed int     `json:"completed"`
			Util      float64 `json:"gpu_utilisation"`
		} `json:"runs"`
		Sweep []json.RawMessage `json:"sweep"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil || len(rep.Runs) != 4 || len(rep.Sweep) == 0 {
		t.Fatalf("sim --json: %d %q %q", code, out, errOut)
	}
	for i, r := range rep.Runs {
		if want := []string{"mesh", "mesh-nopush", "mesh-nohints", "central"}[i]; r.Mode != want {
			t.Fatalf("run %d is %s, want %s", i, r.Mode, want)
		}
		if r.Completed == 0 || r.Util <= 0 || r.Util > 1 {
			t.Fatalf("sim run %+v", r)
		}
	}
	if code, out, _ := runCmd("sim", "--gpus", "30", "--duration", "30s", "--sweep-duration", "0"); code != 0 || !strings.Contains(out, "mesh-nohints") || !strings.Contains(out, "etcd saturates") {
		t.Fatalf("sim: %d %q", code, out)
	}
	// The dedicated profile, the sweep alone: 10x every capacity.
	code, out, errOut = runCmd("sim", "--etcd-profile", "dedicated", "--gpus", "10", "--duration", "0", "--sweep-duration", "10s", "--sweep-modes", "mesh,central", "--json")
	var ded struct {
		Etcd struct {
			WriteCap     float64 `json:"write_txns_per_s"`
			KeepAliveCap float64 `json:"keepalives_per_s"`
		} `json:"etcd"`
		Runs  []json.RawMessage `json:"runs"`
		Sweep []struct {
			Mode string `json:"mode"`
		} `json:"sweep"`
	}
	def := sim.DefaultEtcdCosts()
	if code != 0 || json.Unmarshal([]byte(out), &ded) != nil || len(ded.Runs) != 0 || len(ded.Sweep) != 4 ||
		ded.Etcd.WriteCap != 10*def.WriteCap || ded.Etcd.KeepAliveCap != 10*def.KeepAliveCap {
		t.Fatalf("sim --etcd-profile dedicated: %d %q %q", code, out, errOut)
	}
}

// sim on one shape (--pools) replays a bench serve trace (--trace): one
// run per mode, of that shape, with the trace's jobs; a trace of another
// model than --model is refused.
func TestSimTrace(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "trace.jsonl")
	lines := `{"t":0.5,"model":"flux.1-dev","class":"interactive"}
{"t":1,"model":"flux.1-dev","class":"batch"}
{"t":3,"model":"flux.1-dev","class":"standard"}
`
	if err := os.WriteFile(trace, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCmd("sim", "--model", "flux.1-dev", "--pools", "1:3:1", "--trace", trace, "--backpressure-slack", "4", "--json")
	var rep struct {
		Runs []struct {
			GPUs      int    `json:"gpus"`
			Pools     string `json:"pools"`
			Submitted int    `json:"submitted"`
			Completed int    `json:"completed"`
		} `json:"runs"`
		Sweep []json.RawMessage `json:"sweep"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil || len(rep.Runs) != 4 || len(rep.Sweep) != 0 {
		t.Fatalf("sim --pools --trace: %d %q %q", code, out, errOut)
	}
	for _, r := range rep.Runs {
		if r.GPUs != 5 || r.Pools != "1:3:1" || r.Submitted != 3 || r.Completed != 3 {
			t.Fatalf("run %+v: want the 1:3:1 shape and the trace's 3 jobs", r)
		}
	}
	if code, _, errOut := runCmd("sim", "--model", "wan2.1-t2v-1.3b", "--trace", trace); code != 2 || !strings.Contains(errOut, "one model") {
		t.Fatalf("a trace of another model: %d %q", code, errOut)
	}
}
