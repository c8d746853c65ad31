package bench

import (
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

func testStoreConfig(t *testing.T) StoreConfig {
	cfg := DefaultStoreConfig()
	cfg.Sizes = []int64{4 << 20}
	cfg.Transports = []string{TransportTCP}
	cfg.Reps = 2
	cfg.Transfer.TCPCongestion = "reno" // built into every kernel
	cfg.Logger = zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
	return cfg
}

// A short run reports positive figures and ratios; performance itself is
// checked by running the benchmark, never by a timed unit test.
func TestRunStore(t *testing.T) {
	cfg := testStoreConfig(t)
	var progress strings.Builder
	cfg.Progress = &progress
	rep, err := RunStore(testCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	top := fields(t, rep)
	if top["nodes"] != float64(cfg.Nodes) || top["in_process"] != true {
		t.Errorf("report header: %v", top)
	}
	results, _ := top["results"].([]any)
	if len(results) != 1 {
		t.Fatalf("%d results, want 1: %v", len(results), results)
	}
	row := results[0].(map[string]any)
	if row["transport"] != "tcp" || row["size_bytes"] != float64(4<<20) || row["replicas"] != float64(2) {
		t.Errorf("row %v: want tcp, 4 MiB, R=2", row)
	}
	for _, k := range []string{"put_gbps_median", "put_gbps_min", "put_gbps_max", "get_gbps_median", "get_gbps_min", "get_gbps_max",
		"lookup_ms_median", "ratio_get_with_lookup", "p2p_gbps_median", "p2p_put_gbps_median", "put_cpu_ms_median", "p2p_put_cpu_ms_median", "ratio_get", "ratio_put",
		"replicated_ms_median", "seq_pulls_ms_median", "ratio_replicated"} {
		if v, _ := row[k].(float64); !(v > 0) {
			t.Errorf("%s = %v, want > 0", k, row[k])
		}
	}
	if row["get_target"] != GetTarget || row["put_target"] != PutTarget || row["replicate_target"] != ReplicateTarget {
		t.Errorf("targets %v, %v, %v; want %v, %v, %v", row["get_target"], row["put_target"], row["replicate_target"], GetTarget, PutTarget, ReplicateTarget)
	}
	for _, k := range []string{"get_meets_target", "put_meets_target", "replicate_meets_target"} {
		if _, ok := row[k].(bool); !ok {
			t.Errorf("%s = %v, want a bool", k, row[k])
		}
	}
	r := rep.Results[0]
	if r.ReplicatedMSMedian*1e-3 < float64(r.SizeBytes)/(r.PutGbpsMedian*1e9)*0.999 {
		t.Errorf("R copies took %.2f ms, less than the put that made the first (%.2f GB/s)", r.ReplicatedMSMedian, r.PutGbpsMedian)
	}
	if r.PutGbpsMin > r.PutGbpsMedian || r.PutGbpsMedian > r.PutGbpsMax || r.GetGbpsMin > r.GetGbpsMedian || r.GetGbpsMedian > r.GetGbpsMax {
		t.Errorf("min/median/max out of order: %+v", r)
	}
	var table strings.Builder
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "4MiB") || !strings.Contains(table.String(), "in this process") || !strings.Contains(progress.String(), "rep 2/2") {
		t.Errorf("table:\n%s\nprogress:\n%s", table.String(), progress.String())
	}
}

func TestRunStoreRejects(t *testing.T) {
	for name, mod := range map[string]func(*StoreConfig){
		"unknown transport": func(c *StoreConfig) { c.Transports = []string{"carrier-pigeon"} },
		"replicas >= nodes": func(c *StoreConfig) { c.Replicas = c.Nodes },
		"no reps":           func(c *StoreConfig) { c.Reps = 0 },
		"no sizes":          func(c *StoreConfig) { c.Sizes = nil },
		"no chunks":         func(c *StoreConfig) { c.Chunks = 0 },
		"uneven chunks":     func(c *StoreConfig) { c.Chunks = 3 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := testStoreConfig(t)
			mod(&cfg)
			if _, err := RunStore(testCtx(t), cfg); err == nil {
				t.Fatal("want an error")
			}
		})
	}
}

// Objects of several chunks run the same cycle, each chain copy pulled
// chunk by chunk, and are reported as such.
func TestRunStoreChunked(t *testing.T) {
	cfg := testStoreConfig(t)
	cfg.Chunks, cfg.Reps = 4, 1
	rep, err := RunStore(testCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if r := rep.Results[0]; r.Chunks != 4 || !(r.RatioPut > 0) || !(r.RatioReplicated > 0) {
		t.Fatalf("row %+v: want 4 chunks and positive ratios", r)
	}
}
