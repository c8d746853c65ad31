package simgpu

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

func testModel() Model {
	return Model{
		Encode: 2 * time.Millisecond, Step: time.Millisecond, Decode: 2 * time.Millisecond,
		Cond:        transfer.TensorMeta{DType: transfer.Float16, Shape: []int64{1, 8, 16}, NumChunks: 1},
		Latent:      transfer.TensorMeta{DType: transfer.Float16, Shape: []int64{2, 4, 8, 8}, NumChunks: 2},
		ResultBytes: 4096,
	}
}

func TestRunnerRejectsBadModels(t *testing.T) {
	tests := []struct {
		name  string
		model string
		edit  func(*Model)
		want  string
	}{
		{"bad name", "", func(*Model) {}, `model ""`},
		{"negative cost", "m", func(m *Model) { m.Step = -1 }, "negative cost"},
		{"no result", "m", func(m *Model) { m.ResultBytes = 0 }, "no result size"},
		{"latent not frame-chunked", "m", func(m *Model) { m.Latent.NumChunks = 1 }, "a chunk per frame"},
		{"bad cond", "m", func(m *Model) { m.Cond.DType = "int3" }, "cond"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := testModel()
			tc.edit(&m)
			_, err := Config{Models: map[string]Model{tc.model: m}}.Runner("n1")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// One agent's stages take turns on its one GPU: spans never overlap, and
// each is reported with the node and stage.
func TestStagesTakeTurnsOnOneGPU(t *testing.T) {
	var mu sync.Mutex
	var spans []Span
	cfg := Config{Models: map[string]Model{"m": testModel()}, Observe: func(s Span) {
		mu.Lock()
		defer mu.Unlock()
		spans = append(spans, s)
	}}
	r, err := cfg.Runner("n1")
	if err != nil {
		t.Fatal(err)
	}
	if !r.Serves(jobs.Denoise, "m") || r.Serves(jobs.Denoise, "other") {
		t.Fatalf("Serves: want model m only")
	}
	ctx := context.Background()
	s := engine.Spec{Model: "m", Prompt: "p", Seed: 1, Steps: 3}
	cond, err := r.CondMeta(s)
	if err != nil {
		t.Fatal(err)
	}
	lat, err := r.LatentMeta(s)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	encoded := make([][]byte, 4)
	for i := range encoded {
		encoded[i] = make([]byte, cond.Bytes())
		wg.Go(func() {
			if err := r.Encode(ctx, s, encoded[i]); err != nil {
				t.Error(err)
			}
		})
	}
	var steps []int
	var chunks []int
	dst := make([]byte, lat.Bytes())
	wg.Go(func() {
		err := r.Denoise(ctx, agent.DenoiseCall{Spec: s, Dst: dst,
			Progress:  func(step, total int) { steps = append(steps, step) },
			ChunkDone: func(k int) { chunks = append(chunks, k) }})
		if err != nil {
			t.Error(err)
		}
	})
	wg.Wait()
	for i := range encoded[1:] {
		if !bytes.Equal(encoded[0], encoded[i+1]) {
			t.Fatal("equal requests gave different encodings")
		}
	}
	if len(steps) != 3 || steps[2] != 3 || len(chunks) != 2 {
		t.Fatalf("denoise reported steps %v and chunks %v, want 1..3 and two chunks", steps, chunks)
	}
	d, err := r.NewDecoder(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.DecodeFrames(ctx, 0, dst); err != nil {
		t.Fatal(err)
	}
	if err := d.DecodeFrames(ctx, 0, dst[:d.FrameBytes()-1]); err == nil {
		t.Fatal("DecodeFrames took a part of a frame")
	}
	out, _, err := d.Finish()
	if err != nil || len(out) != 4096 {
		t.Fatalf("Finish: %d bytes, %v; want 4096", len(out), err)
	}

	// 4 encodes + 3 steps + 1 decode, each holding the GPU alone.
	if len(spans) != 8 {
		t.Fatalf("%d spans, want 8", len(spans))
	}
	for i, a := range spans {
		if a.Node != "n1" || a.Tag != "p" || a.Start.Before(a.Queued) || a.End.Before(a.Start) {
			t.Errorf("span %d = %+v", i, a)
		}
		for _, b := range spans[i+1:] {
			if a.Start.Before(b.End) && b.Start.Before(a.End) {
				t.Errorf("spans overlap on one GPU: %s %v-%v and %s %v-%v", a.Stage, a.Start, a.End, b.Stage, b.Start, b.End)
			}
		}
	}
}
