package simgpu

import (
	"context"
	"slices"
	"testing"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// A denoise's spans name their steps, and a resumed one starts after its
// checkpoint's step: what bench serve's redone accounting reads.
func TestDenoiseSpansNameTheirSteps(t *testing.T) {
	var spans []Span
	cfg := Config{Models: map[string]Model{"m": testModel()}, Observe: func(s Span) { spans = append(spans, s) }}
	r, err := cfg.Runner("n1")
	if err != nil {
		t.Fatal(err)
	}
	s := engine.Spec{Model: "m", Prompt: "p", Seed: 7, Steps: 5}
	lat, _ := r.LatentMeta(s)
	var ck *engine.Checkpoint
	stop := make(chan struct{})
	call := agent.DenoiseCall{Spec: s, Dst: make([]byte, lat.Bytes()), Stop: stop,
		Checkpoint: func(c engine.Checkpoint) { ck = &c },
		Progress: func(step, _ int) {
			if step == 2 {
				close(stop) // a preemption asks the sampler to stop after step 2
			}
		}}
	if err := r.Denoise(context.Background(), call); err != engine.ErrStopped {
		t.Fatalf("stopped denoise: %v, want ErrStopped", err)
	}
	if ck == nil || ck.Step != 2 {
		t.Fatalf("checkpoint at the stop: %+v, want step 2", ck)
	}
	call = agent.DenoiseCall{Spec: s, Dst: call.Dst, Resume: ck}
	if err := r.Denoise(context.Background(), call); err != nil {
		t.Fatal(err)
	}
	var steps []int
	for _, sp := range spans {
		if sp.Stage != jobs.Denoise || sp.Seed != 7 || sp.Tag != "p" {
			t.Fatalf("span %+v", sp)
		}
		steps = append(steps, sp.Step)
	}
	if want := []int{1, 2, 3, 4, 5}; !slices.Equal(steps, want) {
		t.Fatalf("span steps %v, want %v: the resume runs 3 to 5", steps, want)
	}
}

// NoCheckpoints is a runner that cannot checkpoint (the agent then cancels
// a preempted denoise instead of stopping it at a step).
func TestNoCheckpoints(t *testing.T) {
	s := engine.Spec{Model: "m", Steps: 5}
	for _, no := range []bool{false, true} {
		r, err := Config{Models: map[string]Model{"m": testModel()}, NoCheckpoints: no}.Runner("n1")
		if err != nil {
			t.Fatal(err)
		}
		if ok, _ := r.Checkpoints(s); ok == no {
			t.Fatalf("NoCheckpoints %v: Checkpoints reports %v", no, ok)
		}
	}
}
