package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

// producerEnv makes the test binary act as the producer child, so tests run
// the real two-process path without building cmd/latentmesh.
const producerEnv = "LATENTMESH_BENCH_TEST_PRODUCER"

func TestMain(m *testing.M) {
	if os.Getenv(producerEnv) == "1" {
		if err := ServeProducer(context.Background(), DefaultProducerConfig(), os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// fields decodes v's JSON encoding into a map, to check field names.
func fields(t *testing.T, v any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func testTransferConfig(t *testing.T) TransferConfig {
	cfg := DefaultTransferConfig()
	cfg.Sizes = []int64{1 << 20, 2 << 20}
	cfg.Reps = 2
	// reno is built into every kernel, so the tuned baseline can always be
	// set up, whichever modules the test machine has loaded.
	cfg.Transfer.TCPCongestion = "reno"
	cfg.Producer = []string{os.Args[0]}
	cfg.ProducerEnv = []string{producerEnv + "=1"}
	cfg.Logger = zaptest.NewLogger(t)
	return cfg
}

func TestRunTransfer(t *testing.T) {
	cfg := testTransferConfig(t)
	var progress strings.Builder
	cfg.Progress = &progress
	rep, err := RunTransfer(testCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	results, _ := fields(t, rep)["results"].([]any)
	// Per size: tcp; then per size: shm and shm-view.
	var want []string
	for _, tr := range []string{"tcp", "shm"} {
		for range cfg.Sizes {
			want = append(want, tr)
			if tr == "shm" {
				want = append(want, "shm-view")
			}
		}
	}
	if len(results) != len(want) {
		t.Fatalf("%d results, want %d: %v", len(results), len(want), results)
	}
	for i, r := range results {
		row := r.(map[string]any)
		for _, k := range []string{"transport", "size_bytes", "conns", "gbps_median", "gbps_min", "gbps_max",
			"baseline_gbps_median", "ratio_vs_baseline", "allocs_per_op", "chunks", "first_chunk_ms_median", "whole_ms_median"} {
			if _, ok := row[k]; !ok {
				t.Errorf("result %d lacks %q: %v", i, k, row)
			}
		}
		size := cfg.Sizes[i%len(cfg.Sizes)]
		if want[i] != "tcp" {
			size = cfg.Sizes[(i-len(cfg.Sizes))/2]
		}
		if row["transport"] != want[i] || row["size_bytes"] != float64(size) || row["conns"] != float64(cfg.Conns) {
			t.Errorf("result %d: %v, want transport %s, size %d", i, row, want[i], size)
		}
		positive := []string{"gbps_median", "gbps_min", "gbps_max", "baseline_gbps_median", "ratio_vs_baseline"}
		// tcp rows also compare with raw TCP running the data plane's
		// congestion control; shm rows have no such baseline.
		if want[i] == "tcp" {
			positive = append(positive, "tuned_baseline_gbps_median", "ratio_vs_tuned_baseline")
		} else if _, ok := row["tuned_baseline_gbps_median"]; ok {
			t.Errorf("result %d: a tuned baseline on a %s row: %v", i, want[i], row)
		}
		if want[i] == "shm-view" {
			positive = append(positive, "handoff_ms_median")
		} else {
			positive = append(positive, "first_chunk_ms_median", "whole_ms_median")
			if row["chunks"] != float64(cfg.Chunks) {
				t.Errorf("result %d: chunks %v, want %d", i, row["chunks"], cfg.Chunks)
			}
		}
		for _, k := range positive {
			if v, _ := row[k].(float64); !(v > 0) {
				t.Errorf("result %d: %s = %v, want > 0", i, k, row[k])
			}
		}
		if row["gbps_min"].(float64) > row["gbps_median"].(float64) || row["gbps_median"].(float64) > row["gbps_max"].(float64) {
			t.Errorf("result %d: min/median/max out of order: %v", i, row)
		}
	}
	var table strings.Builder
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "2MiB") || !strings.Contains(progress.String(), "rep 2/2") {
		t.Errorf("table:\n%s\nprogress:\n%s", table.String(), progress.String())
	}
}

// With the system's congestion control there is no tuned baseline to
// measure, and none is reported.
func TestRunTransferSystemCongestion(t *testing.T) {
	cfg := testTransferConfig(t)
	cfg.Sizes, cfg.Transports, cfg.Chunks = []int64{1 << 20}, []string{TransportTCP}, 1
	cfg.Transfer.TCPCongestion = ""
	rep, err := RunTransfer(testCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 1 {
		t.Fatalf("%d results, want 1", len(rep.Results))
	}
	row := fields(t, rep.Results[0])
	if _, ok := row["tuned_baseline_gbps_median"]; ok || !(row["ratio_vs_baseline"].(float64) > 0) {
		t.Fatalf("row %v: want a ratio against raw TCP and no tuned baseline", row)
	}
}

func TestRunTransferRejects(t *testing.T) {
	for name, mod := range map[string]func(*TransferConfig){
		"unknown":   func(c *TransferConfig) { c.Transports = []string{"carrier-pigeon"} },
		"indivisor": func(c *TransferConfig) { c.Sizes = []int64{1<<20 + 1} },
		"no conns":  func(c *TransferConfig) { c.Conns = 0 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := testTransferConfig(t)
			mod(&cfg)
			if _, err := RunTransfer(testCtx(t), cfg); err == nil {
				t.Fatal("want an error")
			}
		})
	}
}

// A producer that dies at start fails the run with its stderr attached.
func TestProducerFailureShowsStderr(t *testing.T) {
	cfg := testTransferConfig(t)
	cfg.Producer = []string{"/bin/sh", "-c", "echo producer exploded >&2; exit 3"}
	_, err := RunTransfer(testCtx(t), cfg)
	if err == nil || !strings.Contains(err.Error(), "producer exploded") {
		t.Fatalf("got %v, want the producer's stderr", err)
	}
}

func TestRunOverlap(t *testing.T) {
	cfg := DefaultOverlapConfig()
	cfg.Frames, cfg.Width, cfg.Height = 4, 64, 64
	cfg.ChunkInterval = 10 * time.Millisecond
	cfg.Reps = 2
	cfg.Producer = []string{os.Args[0]}
	cfg.ProducerEnv = []string{producerEnv + "=1"}
	cfg.Logger = zaptest.NewLogger(t)
	rep, err := RunOverlap(testCtx(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	o, _ := fields(t, rep)["overlap"].(map[string]any)
	for _, k := range []string{"frames", "width", "height", "latent_bytes", "chunk_interval_ms", "decode_frame_ms", "reps", "first_frame_ratio", "total_ratio"} {
		if v, _ := o[k].(float64); !(v > 0) {
			t.Errorf("overlap.%s = %v, want > 0", k, o[k])
		}
	}
	for _, path := range []string{"chunked", "whole"} {
		p, _ := o[path].(map[string]any)
		for _, k := range []string{"time_to_first_frame_ms", "total_ms"} {
			if v, _ := p[k].(float64); !(v > 0) {
				t.Errorf("overlap.%s.%s = %v, want > 0", path, k, p[k])
			}
		}
	}
	// 4 frames x 4 channels x 8 x 8 float32.
	if o["latent_bytes"] != float64(4*4*8*8*4) || o["chunk_interval_ms"] != 10.0 {
		t.Errorf("overlap: %v", o)
	}
	// Which path is faster is the benchmark's finding, not this test's: the
	// two are medians of separate repetitions, which a loaded machine can
	// invert (it failed so under parallel test runs).
	var table strings.Builder
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "chunked / whole") {
		t.Errorf("table:\n%s", table.String())
	}
}
