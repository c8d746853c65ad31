package testbed

import (
	"bytes"
	"context"
	"image/gif"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// demoSpecs are small versions of the demo prompts, to keep the race-enabled
// suite fast: two images of different sizes and a short video.
func demoSpecs() []engine.Spec {
	specs := []engine.Spec{
		{Prompt: "a red fox in a snowy forest", Seed: 1, Width: 128, Height: 96, Steps: 8},
		{Prompt: "a lighthouse under a stormy sky", NegativePrompt: "blurry", Seed: 2, Width: 96, Height: 128, Steps: 8},
		{Prompt: "ocean waves on a beach", Seed: 3, Width: 96, Height: 64, Frames: 4, Steps: 6},
	}
	for i := range specs {
		specs[i] = specs[i].WithDefaults()
	}
	return specs
}

func runDemo(t *testing.T, top Topology, specs []engine.Spec) DemoReport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := DemoConfig{Out: t.TempDir(), Specs: specs, Cluster: DefaultClusterConfig()}
	cfg.Cluster.Topology = top
	cfg.Cluster.Agent.TransferMode = jobs.P2P // a stage handoff is then exactly one pull
	cfg.Cluster.Logger = testLogger(t)
	rep, err := RunDemo(ctx, cfg)
	if err != nil {
		t.Fatalf("%s demo: %v", top, err)
	}
	if len(rep.Jobs) != len(specs) {
		t.Fatalf("%s demo: %d jobs reported, want %d", top, len(rep.Jobs), len(specs))
	}
	return rep
}

// checkPulls requires rep's pulls to have gone over transport alone, n of
// them when every stage ran once; a stage run again (a lease lost on a
// loaded machine, say) pulls its inputs again, so then at least n.
func checkPulls(t *testing.T, what string, rep DemoReport, transport string, n int64) {
	t.Helper()
	retried := false
	for _, j := range rep.Jobs {
		for _, st := range j.Stages {
			retried = retried || st.Attempt > 1
		}
	}
	got := rep.Pulls[transport]
	if len(rep.Pulls) != 1 || got < n || (!retried && got != n) {
		t.Errorf("%s pulls %v: want %d over %s (more only if a stage ran again: %v)", what, rep.Pulls, n, transport, retried)
	}
}

// The same inputs give byte-identical files whether one agent runs every
// stage or three agents pass payloads over the network.
func TestTopologiesProduceIdenticalFiles(t *testing.T) {
	specs := demoSpecs()
	dis := runDemo(t, Disaggregated, specs)
	col := runDemo(t, Colocated, specs)
	// Each job moves three payloads (its prompt's and its negative
	// prompt's embeddings, which are conditioning cache entries, and the
	// latent): between agents of one host over shared memory, within the
	// colocated agent locally.
	n := int64(3 * len(specs))
	checkPulls(t, "disaggregated", dis, "shm", n)
	checkPulls(t, "colocated", col, "local", n)
	for i, s := range specs {
		a, err := os.ReadFile(dis.Jobs[i].Output)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(col.Jobs[i].Output)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("job %d (%q): disaggregated and colocated outputs differ", i, s.Prompt)
		}
		checkImage(t, a, s)
		// Every stage ran on the agent of its role.
		for st, timing := range dis.Jobs[i].Stages {
			if !strings.HasPrefix(timing.Node, st) {
				t.Errorf("job %d: stage %s ran on %s", i, st, timing.Node)
			}
		}
		if n := len(dis.Jobs[i].Stages); n != 3 {
			t.Errorf("job %d: %d stages in the timeline, want 3", i, n)
		}
	}
}

// checkImage decodes a result and checks its size and frame count.
func checkImage(t *testing.T, data []byte, s engine.Spec) {
	t.Helper()
	if s.Frames > 1 {
		g, err := gif.DecodeAll(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("%q: not a GIF: %v", s.Prompt, err)
		}
		if len(g.Image) != s.Frames || g.Config.Width != s.Width || g.Config.Height != s.Height {
			t.Fatalf("%q: GIF %dx%d with %d frames, want %dx%d with %d", s.Prompt, g.Config.Width, g.Config.Height, len(g.Image), s.Width, s.Height, s.Frames)
		}
		return
	}
	img, err := png.Decode(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("%q: not a PNG: %v", s.Prompt, err)
	}
	if b := img.Bounds(); b.Dx() != s.Width || b.Dy() != s.Height {
		t.Fatalf("%q: PNG %dx%d, want %dx%d", s.Prompt, b.Dx(), b.Dy(), s.Width, s.Height)
	}
}

func TestLoadPrompts(t *testing.T) {
	good := `# a comment
{"prompt":"a cat","seed":3,"width":128,"height":64}

{"prompt":"a dog","negative_prompt":"blurry","frames":4,"steps":10,"guidance_scale":3.5}
`
	specs, err := LoadPrompts(strings.NewReader(good), engine.DefaultLimits())
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 2 || specs[0].Width != 128 || specs[1].Frames != 4 || specs[1].Width != engine.DefaultSpec().Width {
		t.Fatalf("specs = %+v", specs)
	}
	for name, in := range map[string]string{
		"unknown field": `{"prompt":"x","colour":"red"}`,
		"bad json":      `{"prompt":`,
		"out of range":  `{"prompt":"x","width":100000}`,
		"empty prompt":  `{"seed":1}`,
		"two values":    `{"prompt":"x"} {"prompt":"y"}`,
		"no prompts":    "# nothing\n",
	} {
		if _, err := LoadPrompts(strings.NewReader(in), engine.DefaultLimits()); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestFileNames(t *testing.T) {
	s := engine.Spec{Prompt: "A Red Fox, at dawn!", Seed: 9}
	if got := fileName(0, s, "image/png"); got != "01-a-red-fox-at-dawn-9.png" {
		t.Fatalf("fileName = %q", got)
	}
	if got := filepath.Ext(fileName(1, s, "image/gif")); got != ".gif" {
		t.Fatalf("gif ext = %q", got)
	}
}

// With early handoff a video's denoise stage commits when its first frame is
// final, so decode starts while the denoiser finishes the rest; the file is
// the same as without.
func TestEarlyHandoffOverlapsDecode(t *testing.T) {
	spec := engine.Spec{Prompt: "a slow river", Seed: 8, Width: 64, Height: 64, Frames: 8, Steps: 2}.WithDefaults()
	const step = time.Second // simulated: the last step finishes one frame per 125 ms
	run := func(early bool) (DemoReport, []byte) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cfg := DemoConfig{Out: t.TempDir(), Specs: []engine.Spec{spec}, Cluster: DefaultClusterConfig()}
		cfg.Cluster.Logger = testLogger(t)
		cfg.Cluster.Agent.Engine.StepCost = step
		cfg.Cluster.Agent.EarlyHandoff = early
		rep, err := RunDemo(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(rep.Jobs[0].Output)
		if err != nil {
			t.Fatal(err)
		}
		return rep, b
	}
	rep, early := run(true)
	// The denoise stage committed before its last step was done.
	if ms := rep.Jobs[0].Stages["denoise"].Ms; ms >= float64(spec.Steps)*float64(step.Milliseconds()) {
		t.Fatalf("denoise committed after %.0f ms: no early handoff", ms)
	}
	_, late := run(false)
	if !bytes.Equal(early, late) {
		t.Fatal("early handoff changed the output")
	}
	checkImage(t, early, spec)
}

// The end-to-end pipeline works over each transport, and the files are the
// same whichever moved the payloads.
func TestEndToEndOverEachTransport(t *testing.T) {
	specs := demoSpecs()
	var want [][]byte
	for _, mode := range []string{transfer.TransportTCP, transfer.TransportShm} {
		t.Run(mode, func(t *testing.T) {
			cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
				c.Agent.Transfer.Transport = mode
				c.Agent.TransferMode = jobs.P2P // every stage handoff is one pull
			})
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			outs, err := cl.Run(ctx, specs)
			if err != nil {
				t.Fatal(err)
			}
			var got [][]byte
			for _, o := range outs {
				got = append(got, o.Data)
			}
			if want == nil {
				want = got
			}
			for i := range specs {
				checkImage(t, got[i], specs[i])
				if !bytes.Equal(got[i], want[i]) {
					t.Errorf("job %d: output over %s differs from tcp", i, mode)
				}
			}
			// Every cross-agent pull (denoise pulls the prompt's and the
			// negative prompt's conditioning cache entries, decode the
			// latent) went over the forced transport.
			pulls, err := cl.Pulls(ctx)
			if err != nil {
				t.Fatal(err)
			}
			rep := DemoReport{Pulls: pulls}
			for _, o := range outs {
				dj := DemoJob{Stages: map[string]StageTiming{}}
				for st, r := range o.Job.Stages {
					dj.Stages[string(st)] = StageTiming{Attempt: r.Attempt}
				}
				rep.Jobs = append(rep.Jobs, dj)
			}
			checkPulls(t, mode, rep, mode, int64(3*len(specs)))
		})
	}
}
