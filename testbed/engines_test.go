package testbed

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// engineAgent adds an agent of roles whose stages an external engine
// serves on a socket in dir, and starts script as that engine.
func engineAgent(t *testing.T, ctx context.Context, c *Cluster, id, dir, script string, roles ...jobs.Stage) (*agent.Agent, *Worker) {
	t.Helper()
	a := addEngineAgent(t, ctx, c, id, dir, roles...)
	return a, startEngine(t, ctx, a, script)
}

// addEngineAgent adds an agent of roles that waits for an external engine
// on a socket in dir.
func addEngineAgent(t testing.TB, ctx context.Context, c *Cluster, id, dir string, roles ...jobs.Stage) *agent.Agent {
	t.Helper()
	ac := c.cfg.Agent
	ac.NodeID, ac.Roles, ac.Logger = id, roles, c.cfg.Logger
	ac.External.Socket = filepath.Join(dir, id+".sock")
	a, err := c.AddAgentConfig(ctx, ac)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// startEngine starts script against a's engine socket and waits for it to
// register.
func startEngine(t *testing.T, ctx context.Context, a *agent.Agent, script string, args ...string) *Worker {
	t.Helper()
	return startEngineOut(t, ctx, a, workerLog{t}, script, args...)
}

// startEngineOut is startEngine with the worker's output going to out.
func startEngineOut(t testing.TB, ctx context.Context, a *agent.Agent, out io.Writer, script string, args ...string) *Worker {
	t.Helper()
	w, err := StartWorker(script, a.EngineSocket(), out, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Kill)
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := WaitEngine(wctx, func() bool { return a.Engine() != nil }, a.EngineChanged); err != nil {
		t.Fatal(err)
	}
	return w
}

// workerLog sends a worker's output to the test log.
type workerLog struct{ t testing.TB }

func (w workerLog) Write(p []byte) (int, error) {
	w.t.Logf("worker: %s", bytes.TrimRight(p, "\n"))
	return len(p), nil
}

// Criterion: the numpy decoder worker serves a mesh's decode stage and its
// files (PNG and GIF) are byte-identical to the built-in Go engine's.
func TestNumpyDecoderMatchesBuiltin(t *testing.T) {
	if why := PythonWorkerMissing(); why != "" {
		t.Skip(why)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cfg := DefaultClusterConfig()
	cfg.Topology = ""
	cfg.Logger = testLogger(t)
	c, err := StartCluster(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, st := range []jobs.Stage{jobs.Encode, jobs.Denoise} {
		if _, err := c.AddAgent(ctx, string(st)+"-go", st); err != nil {
			t.Fatal(err)
		}
	}
	dec, _ := engineAgent(t, ctx, c, "decode-numpy", t.TempDir(), WorkerScript("numpy_decoder.py"), jobs.Decode)
	if reg := dec.Engine(); reg.Version != extengine.Version1 || len(reg.Features) != 0 {
		t.Fatalf("the numpy decoder registered protocol v%d with %v; it is the mesh's v1 engine", reg.Version, reg.Features)
	}

	// A model no member serves is refused at submission, not queued for ever.
	if _, err := c.Agents[0].Submit(ctx, engine.Spec{Model: "nobody-serves-this", Prompt: "x"}.WithDefaults(), jobs.Options{}); err == nil || !strings.Contains(err.Error(), "no agent of this mesh serves it") {
		t.Errorf("submitting an unserved model: %v, want a refusal", err)
	}

	specs := demoSpecs() // two images and a four-frame video
	outs, err := c.Run(ctx, specs)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(engine.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range specs {
		want, ctype, err := e.Generate(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		if got := outs[i]; got.ContentType != ctype || !bytes.Equal(got.Data, want) {
			os.WriteFile(filepath.Join(t.TempDir(), "got"), got.Data, 0o644)
			t.Errorf("job %d (%dx%dx%d): numpy-decoded %s of %d bytes differs from the built-in engine's %s of %d bytes",
				i, s.Width, s.Height, s.Frames, got.ContentType, len(got.Data), ctype, len(want))
		}
		if node := outs[i].Job.Stages[jobs.Decode].Node; node != dec.ID() {
			t.Errorf("job %d decoded on %s, want %s", i, node, dec.ID())
		}
	}
}
