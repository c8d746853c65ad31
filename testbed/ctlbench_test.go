package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestControlBench runs bench control small on real etcd processes: every
// job succeeds, each fleet's row says something, and the simulator counts
// what etcd counts, a job on a fleet of the same shape (events, write
// transactions: within SimAgreement). The figures themselves are the
// benchmark's business (docs/benchmarks.md), not a test's.
func TestControlBench(t *testing.T) {
	if _, err := EtcdBinaryAvailable(); err != nil {
		t.Skipf("needs Debian's etcd: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := DefaultControlBenchConfig()
	cfg.Agents = []int{4, 5} // two clients never wait for one of 2 denoise slots
	cfg.Jobs, cfg.Steps, cfg.Clients = 10, 5, 2
	cfg.Idle = 2 * time.Second
	cfg.Logger = testLogger(t) // memberlist logs from timers a moment after Close
	var progress bytes.Buffer
	cfg.Progress = &progress

	rep, err := RunControlBench(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("progress:\n%s", progress.String())
	if len(rep.Fleets) != 2 || rep.Fleets[0].Agents != 4 || rep.Fleets[1].Agents != 5 {
		t.Fatalf("fleets %+v, want rows for 4 and 5 agents", rep.Fleets)
	}
	if !strings.HasPrefix(rep.EtcdVersion, "3.") {
		t.Errorf("etcd version %q", rep.EtcdVersion)
	}
	positive := func(what string, v float64) {
		t.Helper()
		if !(v > 0) || math.IsInf(v, 0) {
			t.Errorf("%s = %v, want positive and finite", what, v)
		}
	}
	for _, f := range rep.Fleets {
		if f.Jobs != cfg.Jobs || f.Denoise != f.Agents-2 {
			t.Errorf("%d agents: %d jobs succeeded on %d denoise agents, want %d on %d", f.Agents, f.Jobs, f.Denoise, cfg.Jobs, f.Agents-2)
		}
		positive("events/job", f.PerJob.Events)
		positive("proposals/job", f.PerJob.Proposals)
		positive("ranges/job", f.PerJob.Ranges)
		positive("txns/job", f.PerJob.Txns)
		positive("jobs/s", f.JobsPerSec)
		positive("idle seconds", f.IdleSeconds)
		// Every job's long poll watches its ended key, which the job's
		// end writes once: the client's own count of what its watches
		// received.
		if got := f.EventsByWatch["ended/<job>"]; got != 1 {
			t.Errorf("%d agents: %v events/job at ended/<job>, want 1", f.Agents, got)
		}
		if got := f.EventsByWatch["jobs/<job>"]; got != 0 {
			t.Errorf("%d agents: %v events/job at jobs/<job>: nothing watches a job's record while it runs", f.Agents, got)
		}
		if f.IdlePerAgent.Proposals < 0 || f.IdlePerAgent.Ranges < 0 {
			t.Errorf("%d agents: idle counters went backwards: %+v", f.Agents, f.IdlePerAgent)
		}
	}

	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", table.String())
	lines := strings.Split(strings.TrimSpace(table.String()), "\n")
	if l := lines[len(lines)-2]; !strings.HasPrefix(l, "5 agents against 4: events/job x") {
		t.Errorf("line %q, want the ratio of 5 agents to 4", l)
	}
	for _, f := range rep.Fleets {
		if f.Sim.Jobs < 100 {
			t.Errorf("%d agents: the simulator ran %d jobs, want at least 100", f.Agents, f.Sim.Jobs)
		}
	}
	if ev, wr := rep.SimOff(); ev > SimAgreement || wr > SimAgreement {
		t.Errorf("the simulator's counts a job are %.0f%% (events) and %.0f%% (write txns) off etcd's, want within %.0f%%: %s", 100*ev, 100*wr, 100*SimAgreement, lines[len(lines)-1])
	}

	data, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	var back ControlBenchReport
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, rep) {
		t.Errorf("JSON round trip changed the report:\n got %+v\nwant %+v", back, rep)
	}
}

func TestParseEtcdMetrics(t *testing.T) {
	const text = `# TYPE etcd_debugging_mvcc_events_total counter
etcd_debugging_mvcc_events_total 42
etcd_server_proposals_committed_total 9
etcd_mvcc_range_total 28
etcd_mvcc_put_total 7
etcd_mvcc_delete_total 5
etcd_mvcc_txn_total 3
etcd_debugging_mvcc_current_revision 17
etcd_debugging_lease_granted_total 4
etcd_server_version{server_version="3.4.23"} 1
grpc_server_msg_received_total{grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 6
grpc_server_msg_received_total{grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 2
grpc_server_msg_received_total{grpc_method="Put",grpc_service="etcdserverpb.KV",grpc_type="unary"} 0
`
	s, err := parseEtcdMetrics(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	want := EtcdCost{Events: 42, Proposals: 9, Ranges: 28, Puts: 7, Deletes: 5, MVCCTxns: 3, Txns: 6, LeaseGrants: 4,
		Requests: map[string]float64{"Txn": 6, "Range": 2}}
	if !reflect.DeepEqual(s.cost, want) || s.revision != 17 || s.version != "3.4.23" {
		t.Errorf("parsed %+v rev %v version %q, want %+v rev 17 version 3.4.23", s.cost, s.revision, s.version, want)
	}
	if _, err := parseEtcdMetrics(strings.NewReader("go_goroutines 12\n")); err == nil || !strings.Contains(err.Error(), "etcd_debugging_mvcc_events_total") {
		t.Errorf("a non-etcd /metrics: err %v, want one naming the missing counters", err)
	}
}

func TestWatchKind(t *testing.T) {
	const p = "/latentmesh/default"
	for key, want := range map[string]string{
		p + "/nodes/":            "nodes/",
		p + "/objects/":          "objects/",
		p + "/objects/j1.frame.": "objects/<job>...",
		p + "/queues/denoise/":   "queues/denoise/",
		p + "/queues/decode/tasks/1/decode-01/00000187a1b2c3d4-ab12": "queues/decode/tasks/<task>",
		p + "/queues/decode/tasks/1/decode-01/":                      "queues/decode/tasks/<class>/<node>/",
		p + "/jobs/0123abcd":                                         "jobs/<job>",
		p + "/progress/0123abcd":                                     "progress/<job>",
		p + "/ended/0123abcd":                                        "ended/<job>",
		p + "/payloads/denoise-01/":                                  "payloads/<node>/",
		p + "/holders/decode-01/":                                    "holders/<node>/",
		"/elsewhere/nodes/":                                          "/elsewhere/nodes/",
		p + "/latentmesh-etcd-identity":                              "latentmesh-etcd-identity",
	} {
		if got := watchKind(p, key); got != want {
			t.Errorf("watchKind(%q) = %q, want %q", key, got, want)
		}
	}
}
