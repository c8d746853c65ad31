package testbed

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// history builds a job history from (state, stage, rewinds, committed
// stage or "", committing node) steps.
func history(steps ...[5]string) []jobVersion {
	var out []jobVersion
	j := jobs.Job{ID: "j1", Stages: map[jobs.Stage]*jobs.StageRecord{}}
	t0 := time.Unix(1000, 0)
	for i, s := range steps {
		j.State, j.Stage = jobs.State(s[0]), jobs.Stage(s[1])
		j.Rewinds = int(s[2][0] - '0')
		stages := map[jobs.Stage]*jobs.StageRecord{}
		for k, v := range j.Stages {
			c := *v
			stages[k] = &c
		}
		if s[3] != "" {
			stages[jobs.Stage(s[3])] = &jobs.StageRecord{Node: s[4], Attempt: 1, FinishedAt: t0.Add(time.Duration(i) * time.Second)}
		}
		j.Stages = stages
		if j.State == jobs.Succeeded && j.Result == nil {
			j.Result = &jobs.Result{Object: "j1.result", SHA256: "ab"}
		}
		out = append(out, jobVersion{Rev: int64(10 + i), Job: j})
	}
	return out
}

func TestDuplicateCommits(t *testing.T) {
	tests := []struct {
		name  string
		steps [][5]string
		want  []string // substrings, one per duplicate
	}{
		{"clean", [][5]string{
			{"queued", "encode", "0", "", ""},
			{"running", "denoise", "0", "encode", "e1"},
			{"running", "decode", "0", "denoise", "d1"},
			{"succeeded", "", "0", "decode", "x1"},
		}, nil},
		{"rewound and committed again", [][5]string{
			{"queued", "encode", "0", "", ""},
			{"running", "denoise", "0", "encode", "e1"},
			{"running", "encode", "1", "", ""}, // the denoise worker rewinds
			{"running", "denoise", "1", "encode", "e2"},
			{"running", "decode", "1", "denoise", "d1"},
			{"succeeded", "", "1", "decode", "x1"},
		}, nil},
		{"stage committed twice", [][5]string{
			{"queued", "encode", "0", "", ""},
			{"running", "encode", "0", "encode", "e1"}, // a bad commit that left the job at encode
			{"running", "denoise", "0", "encode", "e2"},
		}, []string{"committed twice in pass 0"}},
		{"stale commit of a passed stage", [][5]string{
			{"queued", "encode", "0", "", ""},
			{"running", "denoise", "0", "encode", "e1"},
			{"running", "decode", "0", "denoise", "d1"},
			{"running", "decode", "0", "encode", "e2"},
		}, []string{`while the job was at "decode"`}},
		{"commit after success", [][5]string{
			{"queued", "encode", "0", "", ""},
			{"running", "denoise", "0", "encode", "e1"},
			{"running", "decode", "0", "denoise", "d1"},
			{"succeeded", "", "0", "decode", "x1"},
			{"succeeded", "", "0", "decode", "x2"},
		}, []string{"after the job was succeeded"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := duplicateCommits(history(tt.steps...))
			if len(got) != len(tt.want) {
				t.Fatalf("got %d duplicates %q, want %d", len(got), got, len(tt.want))
			}
			for i, w := range tt.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("duplicate %d = %q, want it to say %q", i, got[i], w)
				}
			}
		})
	}
}

func TestLeaks(t *testing.T) {
	snap := etcdSnapshot{
		Jobs: map[string]jobs.Job{
			"ok":  {ID: "ok", State: jobs.Succeeded, Result: &jobs.Result{Object: "ok.result"}},
			"bad": {ID: "bad", State: jobs.Failed},
			"run": {ID: "run", State: jobs.Running},
		},
		Payloads: []jobs.PayloadRecord{
			{Input: jobs.Input{Payload: "p1", Node: "a"}, Job: "bad", Stage: jobs.Encode}, // leaked
			{Input: jobs.Input{Payload: "p2", Node: "a"}, Job: "run", Stage: jobs.Encode}, // in use
		},
		Objects: []cache.Record{
			{ID: "ok.result", Job: "ok", Mode: cache.Pinned, Holders: []cache.Holder{{Node: "a"}, {Node: "b"}}},
			{ID: "ok.denoise.x", Job: "ok", Mode: cache.Consume, Holders: []cache.Holder{{Node: "b"}}}, // leaked
			{ID: "gone.result", Job: "gone", Mode: cache.Pinned},                                       // leaked
			{ID: "cond.v.t.x", Mode: cache.Cache, Holders: []cache.Holder{{Node: "a"}}},                // a cache entry
		},
	}
	if recs := leakedRecords(snap); len(recs) != 3 {
		t.Fatalf("leaked records %q, want p1, ok.denoise.x and gone.result", recs)
	}
	hs := []holdings{
		{Node: "a", Payloads: 4, Copies: 2, CacheUsed: 10, CacheCapacity: 10}, // result, cache entry, p1, p2: nothing extra
		{Node: "b", Payloads: 4, Copies: 3},                                   // two records name it: one extra copy, one extra payload
		{Node: "c", Payloads: 1, Copies: 1, Staged: 1, CacheUsed: 11, CacheCapacity: 10},
	}
	n, ev := leakedHoldings(snap, hs)
	if n != 4 || len(ev) != 4 {
		t.Fatalf("leaked holdings %d %q, want 4: b's copy and payload, c's staged copy and cache beyond its room", n, ev)
	}
}

// The CI's chaos run: four agents for 30 s with a fault about every 2 s,
// the fault rate of the long runs in docs/benchmarks.md. Nothing accepted
// is lost, no stage commits twice, nothing leaks, and the repairs the
// faults called for were measured and ended.
func TestChaosShort(t *testing.T) {
	if ok, why := NetAvailable(); !ok {
		if os.Geteuid() != 0 {
			t.Skip(why)
		}
		t.Fatal(why)
	}
	if _, err := EtcdBinaryAvailable(); err != nil {
		t.Fatal(err)
	}
	cfg := DefaultChaosConfig()
	cfg.Binary, cfg.Agents, cfg.Duration, cfg.Seed = binary, 4, 30*time.Second, 7
	cfg.FaultEvery = 2 * time.Second
	cfg.Settle = 40 * time.Second
	cfg.Progress = &testWriter{t: t}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := RunChaos(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", *rep)
	if rep.FaultsInjected < 8 {
		t.Errorf("%d faults injected, want at least 8", rep.FaultsInjected)
	}
	if rep.Repair.ShortAtEnd != 0 {
		t.Errorf("%d objects still short of copies after the settle: %+v", rep.Repair.ShortAtEnd, rep.Repair)
	}
	if rep.Accepted < 20 || rep.Completed == 0 {
		t.Errorf("accepted %d, completed %d: the load did not run", rep.Accepted, rep.Completed)
	}
	if !rep.OK() {
		t.Errorf("lost %d, duplicate commits %d, leaked %d, corrupt %d; logs in %s:\n%s",
			rep.Lost, rep.DuplicateCommits, rep.LeakedPayloads, rep.Corrupt, rep.Dir, strings.Join(rep.Violations, "\n"))
	}
}
