package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// batchTap passes a worker's output to the test log and counts the
// members of the batches it ran, by stage ("batch of N <stage> tasks").
type batchTap struct {
	t       testing.TB
	mu      sync.Mutex
	batches map[string][]int // stage -> the size of each batch, in order
}

var batchLine = regexp.MustCompile(`batch of (\d+) (encode|denoise|decode) tasks (ran|started)`)

func (w *batchTap) Write(p []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Logf("worker: %s", l)
		if m := batchLine.FindStringSubmatch(l); m != nil {
			n, _ := strconv.Atoi(m[1])
			w.mu.Lock()
			w.batches[m[2]] = append(w.batches[m[2]], n)
			w.mu.Unlock()
		}
	}
	return len(p), nil
}

func (w *batchTap) sizes(stage string) []int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]int(nil), w.batches[stage]...)
}

// batchMesh is a torch mesh of one agent a stage whose workers batch up
// to batch tasks a call (--batch), the agents' slots sized to admit a
// batch: each stage's credits, and so the budget admission grants the
// stage before it.
func batchMesh(t testing.TB, ctx context.Context, weights string, stepMS, batch int) (map[string]*agent.Agent, *batchTap) {
	t.Helper()
	tap := &batchTap{t: t, batches: map[string][]int{}}
	ids := map[string]jobs.Stage{"encode-b": jobs.Encode, "denoise-b": jobs.Denoise, "decode-b": jobs.Decode}
	args := map[string][]string{}
	for id := range ids {
		args[id] = []string{"--batch", fmt.Sprint(batch)}
	}
	_, agents, _ := torchMeshConfig(t, ctx, weights, stepMS, ids, func(string) io.Writer { return tap }, args, func(c *agent.Config) {
		for st := range c.Slots {
			c.Slots[st] = batch
		}
		// Sixteen HTTP submissions at once reach the encoder over a few
		// hundred milliseconds under the race detector on two cores; with
		// 100 ms, a run gave batches of [4 2 3 2 3 2].
		c.External.BatchWindow = 250 * time.Millisecond
	})
	return agents, tap
}

// Criterion (issue 20, batching): with a max batch of 4 and slots sized to
// admit a batch, 16 concurrent small jobs run in about 4 engine calls a
// stage; every job succeeds, its image within a rounding of the
// single-process pipeline's (a batched VAE sums in another order).
func TestTorchBatchingSixteenJobs(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	agents, tap := batchMesh(t, ctx, weights, 0, 4)
	entry := agents["encode-b"].HTTPAddr()

	const jobsN = 16
	got := make([][]byte, jobsN)
	errs := make([]error, jobsN)
	var wg sync.WaitGroup
	for i := range jobsN {
		wg.Go(func() {
			var png []byte
			png, _, errs[i] = generate(ctx, entry, imageReq{Model: torchModel, Prompt: fmt.Sprintf("a lighthouse, take %d", i), Size: "64x64", Seed: int64(200 + i), Steps: 10})
			if errs[i] == nil {
				got[i] = rgba(t, png)
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("job %d: %v", i, err)
		}
	}
	for _, st := range jobs.Stages() {
		calls := agents[string(st)+"-b"].EngineCalls(st)
		t.Logf("%s: %d engine calls for %d jobs; batches the worker ran: %v", st, calls, jobsN, tap.sizes(string(st)))
		// About 4: a batch goes when full, or when no other task of the
		// stage is on its way; how the jobs' tasks meet varies a little.
		if calls < jobsN/4 || calls > jobsN/4+2 {
			t.Errorf("%s: %d engine calls for %d jobs with batches of 4, want about 4", st, calls, jobsN)
		}
	}

	var specs []engine.Spec
	for i := range jobsN {
		specs = append(specs, engine.Spec{Prompt: fmt.Sprintf("a lighthouse, take %d", i), Seed: int64(200 + i), Width: 64, Height: 64, Frames: 1, Steps: 10, GuidanceScale: 5})
	}
	want := torchReference(t, weights, specs)
	for i := range jobsN {
		maxDiff := 0
		for k, b := range got[i] {
			maxDiff = max(maxDiff, absDiff(b, want[i][k]))
		}
		if maxDiff > 1 {
			t.Errorf("job %d: max abs pixel difference %d from the single-process pipeline, want at most 1", i, maxDiff)
		}
	}
}

// Criterion (issue 20, batching): cancelling one member of a running batch
// stops only it; the batch's other members finish, in the same engine
// call. A slow job holds the denoise engine's one call while three small
// ones queue, so the three go as one batch when it ends.
func TestTorchBatchMemberCancel(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	agents, tap := batchMesh(t, ctx, weights, 100, 4)
	entry, den := agents["encode-b"], agents["denoise-b"]

	submit := func(size, steps int, seed int64) string {
		spec := engine.Spec{Model: torchModel, Prompt: "a cat", Width: size, Height: size, Frames: 1, Steps: steps, Seed: seed, GuidanceScale: 5}
		j, err := entry.Submit(ctx, spec, jobs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return j.ID
	}
	blocker := submit(128, 24, 1) // 2.4 s of denoise, alone: another size
	eventually(t, 30*time.Second, func() error {
		if j, err := entry.Get(ctx, blocker); err != nil || j.Progress == nil || j.Progress.Stage != jobs.Denoise || j.Progress.Step < 1 {
			return fmt.Errorf("the blocker's denoise has not begun")
		}
		return nil
	})
	members := []string{submit(64, 20, 2), submit(64, 20, 3), submit(64, 20, 4)}
	victim := members[1]
	eventually(t, time.Minute, func() error {
		j, err := entry.Get(ctx, victim)
		if err != nil || j.Progress == nil || j.Progress.Stage != jobs.Denoise || j.Progress.Step < 2 {
			return fmt.Errorf("job %s is not two steps into its denoise", victim)
		}
		return nil
	})
	if _, err := entry.Cancel(ctx, victim); err != nil {
		t.Fatal(err)
	}
	for _, id := range append([]string{blocker}, members...) {
		j, err := entry.Wait(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case id == victim && j.State != jobs.Cancelled:
			t.Errorf("the cancelled member ended %s", j.State)
		case id != victim && j.State != jobs.Succeeded:
			t.Errorf("job %s ended %s (%s), want succeeded", id, j.State, j.Error)
		}
	}
	sizes := tap.sizes("denoise")
	if calls := den.EngineCalls(jobs.Denoise); calls != 2 || len(sizes) != 1 || sizes[0] != 3 {
		t.Fatalf("denoise: %d engine calls, batches %v; want 2 calls: the blocker alone, then one batch of the three", calls, sizes)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatal("timed out")
	}
}

// BenchmarkTorchBatching measures what batching buys on the torch
// reference worker (CPU, one thread a worker): 16 concurrent 64x64 jobs
// of 10 steps through a 3-agent mesh, with batches of 1 (slots 1: one task
// a call, as without batching) and of 4 (slots 4), in one run. Run with
// `go test -run '^$' -bench TorchBatching -benchtime 5x ./testbed`; it
// reports jobs/s for each, and their ratio is batching's gain here.
func BenchmarkTorchBatching(b *testing.B) {
	weights := torchWeights(b)
	for _, batch := range []int{1, 4} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			agents, _ := batchMesh(b, ctx, weights, 0, batch)
			entry := agents["encode-b"].HTTPAddr()
			const jobsN = 16
			run := func() {
				var wg sync.WaitGroup
				for i := range jobsN {
					wg.Go(func() {
						q := imageReq{Model: torchModel, Prompt: fmt.Sprintf("a lighthouse, take %d", i), Size: "64x64", Seed: int64(200 + i), Steps: 10}
						if _, _, err := generate(ctx, entry, q); err != nil {
							b.Error(err)
						}
					})
				}
				wg.Wait()
			}
			run() // warm: first calls load and trace the networks
			b.ResetTimer()
			for range b.N {
				run()
			}
			b.ReportMetric(float64(jobsN*b.N)/b.Elapsed().Seconds(), "jobs/s")
		})
	}
}
