package testbed

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// stampTap passes a worker's output to the test log and keeps the time
// stamped on each line that says "<what> at <unix seconds>".
type stampTap struct {
	t     *testing.T
	mu    sync.Mutex
	stamp map[string]float64 // the text before " at ", first seen
}

func newStampTap(t *testing.T) *stampTap { return &stampTap{t: t, stamp: map[string]float64{}} }

func (w *stampTap) Write(p []byte) (int, error) {
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		w.t.Logf("worker: %s", l)
		i := strings.LastIndex(l, " at ")
		if i < 0 {
			continue
		}
		if ts, err := strconv.ParseFloat(strings.TrimSpace(l[i+4:]), 64); err == nil {
			w.mu.Lock()
			if _, ok := w.stamp[l[:i]]; !ok {
				w.stamp[l[:i]] = ts
			}
			w.mu.Unlock()
		}
	}
	return len(p), nil
}

// find returns the first stamp of a line containing sub.
func (w *stampTap) find(sub string) (string, float64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, v := range w.stamp {
		if strings.Contains(k, sub) {
			return k, v, true
		}
	}
	return "", 0, false
}

// Criterion (issue 20, done-when 1): the torch worker's video denoise says
// its first latent chunk is final before its first step (chunk_ready), so
// the early handoff commits and the decode agent's engine starts decoding
// chunk 0 while the denoise still runs: the decode worker's "decode of job
// J chunk 0 started at T" comes before the denoise worker's "denoise task
// N finished at T'" (one host, one clock). The decoder is causal, so the
// three chunks decode as one stream with state; the GIF is byte-equal to
// the one made of the single-process reference run's pixels.
func TestTorchEarlyHandoffDecodesWhileDenoising(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	taps := map[string]*stampTap{"denoise-h": newStampTap(t), "decode-h": newStampTap(t)}
	// 8 steps of 150 ms: over a second of denoise after chunk 0 is final.
	_, agents, _ := torchMeshOut(t, ctx, weights, 150, map[string]jobs.Stage{"encode-h": jobs.Encode, "denoise-h": jobs.Denoise, "decode-h": jobs.Decode},
		func(id string) io.Writer {
			if tap := taps[id]; tap != nil {
				return tap
			}
			return workerLog{t}
		})
	entry := agents["encode-h"]
	eventually(t, 30*time.Second, func() error {
		if _, ok := entry.ModelLimits(videoModel); !ok || !entry.ModelServed(videoModel) {
			return fmt.Errorf("%s not served with its record yet", videoModel)
		}
		return nil
	})
	cli := &httpapi.Client{BaseURL: "http://" + entry.HTTPAddr()}
	pix, pngBytes := refImage(t, 48, 40)
	seed, guidance, steps, frames := int64(31), 5.0, 8, 9
	job, err := cli.Submit(ctx, httpapi.JobRequest{Model: videoModel, Prompt: "a river at dawn", Seed: &seed,
		Width: ptrTo(64), Height: ptrTo(64), Frames: &frames, Steps: &steps, GuidanceScale: &guidance,
		Image: base64.StdEncoding.EncodeToString(pngBytes)})
	if err != nil {
		t.Fatal(err)
	}
	done, err := entry.Wait(ctx, job.ID)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job %s: %s %+v (%v)", job.ID, done.State, done.Error, err)
	}
	line, decodeAt, ok := taps["decode-h"].find("decode of job " + job.ID + " chunk 0 started")
	if !ok {
		t.Fatalf("the decode worker never said it started chunk 0 of job %s as a stream", job.ID)
	}
	dline, denoiseEnd, ok := taps["denoise-h"].find("finished")
	if !ok {
		t.Fatal("the denoise worker never said its task finished")
	}
	t.Logf("%q at %.3f; %q at %.3f", line, decodeAt, dline, denoiseEnd)
	if decodeAt >= denoiseEnd {
		t.Errorf("the decode of chunk 0 started %.3f s after the denoise finished: no overlap", decodeAt-denoiseEnd)
	}
	if _, _, ok := taps["decode-h"].find("decode of job " + job.ID + " chunk 2 started"); !ok {
		t.Error("the decode's last chunk (2) did not come as chunk 2 of the stream")
	}
	gif, _, err := cli.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := videoReferenceGIF(t, entry.ModelLimits, weights, done.Spec, pix, 48, 40)
	if !bytes.Equal(gif, want) {
		t.Errorf("the mesh's GIF (%d bytes) differs from the single-process run's (%d bytes)", len(gif), len(want))
	}
}

func ptrTo(n int) *int { return &n }

// videoReferenceGIF is the GIF the agent's frame sink makes of the video
// model's single-process reference run of s (its image: pix, w x h RGBA).
func videoReferenceGIF(t *testing.T, limits func(string) (engine.Limits, bool), weights string, s engine.Spec, pix []byte, w, h int) []byte {
	t.Helper()
	dir := t.TempDir()
	imgPath := filepath.Join(dir, "ref.rgba")
	if err := os.WriteFile(imgPath, pix, 0o600); err != nil {
		t.Fatal(err)
	}
	params := map[string]any{}
	for k, v := range s.Params {
		params[k] = v.Num
	}
	js, _ := json.Marshal([]map[string]any{{"model": s.Model, "prompt": s.Prompt, "negative_prompt": s.NegativePrompt,
		"seed": s.Seed, "width": s.Width, "height": s.Height, "frames": s.Frames, "steps": s.Steps, "guidance_scale": s.GuidanceScale,
		"params": params, "image": map[string]any{"path": imgPath, "width": w, "height": h}}})
	out := filepath.Join(dir, "ref.out")
	if b, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--reference", string(js), out).CombinedOutput(); err != nil {
		t.Fatalf("reference run: %v\n%s", err, b)
	}
	raw, err := os.ReadFile(out)
	frame := s.Width * s.Height * 4
	if err != nil || len(raw) != s.Frames*frame {
		t.Fatalf("reference wrote %d bytes (%v), want %d", len(raw), err, s.Frames*frame)
	}
	l, _ := limits(s.Model)
	sink, err := engine.NewFrameSink(s, l)
	if err != nil {
		t.Fatal(err)
	}
	for f := range s.Frames {
		if err := sink.PutRGBA(f, raw[f*frame:][:frame]); err != nil {
			t.Fatal(err)
		}
	}
	gif, _, err := sink.Finish()
	if err != nil {
		t.Fatal(err)
	}
	return gif
}

// Criterion (issue 20, done-when 2): an adapter loaded at run time on one
// denoise engine is used by the next request naming it, which is routed to
// that worker; its image differs from the base model's and equals the
// single-process run with the adapter. Loaded on the other engine and
// unloaded from the first, the next request goes to the other; unloaded
// there too, a request naming it is refused with a 400 naming it.
func TestTorchAdapterLoadedAtRunTime(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	adapter := filepath.Join(t.TempDir(), "paint.safetensors")
	if out, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--write-adapter", adapter, "--adapter-seed", "7").CombinedOutput(); err != nil {
		t.Fatalf("write adapter: %v\n%s", err, out)
	}
	control := []string{"--control"}
	_, agents, workers := torchMeshArgs(t, ctx, weights, 0,
		map[string]jobs.Stage{"encode-l": jobs.Encode, "denoise-la": jobs.Denoise, "denoise-lb": jobs.Denoise, "decode-l": jobs.Decode},
		func(string) io.Writer { return workerLog{t} }, map[string][]string{"denoise-la": control, "denoise-lb": control})
	entry := agents["encode-l"]
	cli := &httpapi.Client{BaseURL: "http://" + entry.HTTPAddr()}
	spec := engine.Spec{Model: torchModel, Prompt: "a lighthouse", Seed: 5, Width: 64, Height: 64, Frames: 1, Steps: 6, GuidanceScale: 5}
	with := spec
	with.Adapter = "paint"
	run := func(s engine.Spec) (jobs.Job, []byte) {
		t.Helper()
		j, err := entry.Submit(ctx, s, jobs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		done, data := finishTorchJob(t, ctx, entry, j.ID)
		return done, rgba(t, data)
	}
	served := func(want bool) {
		t.Helper()
		eventually(t, 30*time.Second, func() error {
			if got := entry.AdapterServed(torchModel, "paint"); got != want {
				return fmt.Errorf("adapter served: %v, want %v", got, want)
			}
			return nil
		})
	}
	ref := torchReferenceLora(t, weights, spec, adapter)

	// Loaded on denoise-la: the request naming it goes there.
	if err := workers["denoise-la"].Control("load-adapter " + torchModel + " paint " + adapter); err != nil {
		t.Fatal(err)
	}
	served(true)
	j, got := run(with)
	if n := j.Stages[jobs.Denoise].Node; n != "denoise-la" {
		t.Errorf("the request naming adapter paint denoised on %s, want denoise-la (the one with it loaded)", n)
	}
	if !bytes.Equal(got, ref["paint"]) {
		t.Error("the image with the adapter differs from the single-process run with it")
	}
	if bytes.Equal(got, ref[""]) {
		t.Error("the adapter changed nothing: the image equals the base model's")
	}
	if _, base := run(spec); !bytes.Equal(base, ref[""]) {
		t.Error("a request naming no adapter differs from the base model's single-process run")
	}

	// Loaded on denoise-lb and unloaded from denoise-la: the next one goes to lb.
	if err := workers["denoise-lb"].Control("load-adapter " + torchModel + " paint " + adapter); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		if agents["denoise-lb"].Engine().HasAdapter(torchModel, "paint") {
			return nil
		}
		return errors.New("denoise-lb's engine has not announced the adapter")
	})
	if err := workers["denoise-la"].Control("unload-adapter " + torchModel + " paint"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		if agents["denoise-la"].Engine().HasAdapter(torchModel, "paint") {
			return errors.New("denoise-la still has the adapter")
		}
		return nil
	})
	served(true)
	if j, got := run(with); j.Stages[jobs.Denoise].Node != "denoise-lb" || !bytes.Equal(got, ref["paint"]) {
		t.Errorf("after the move, the request naming it denoised on %s (want denoise-lb), same image as before: %v", j.Stages[jobs.Denoise].Node, bytes.Equal(got, ref["paint"]))
	}

	// Unloaded everywhere: refused, naming the adapter.
	if err := workers["denoise-lb"].Control("unload-adapter " + torchModel + " paint"); err != nil {
		t.Fatal(err)
	}
	served(false)
	_, err := cli.Submit(ctx, httpapi.JobRequest{Model: torchModel, Prompt: "a lighthouse", Lora: "paint"})
	var ae *httpapi.APIError
	if !errors.As(err, &ae) || ae.Status != 400 || ae.Param != "lora" || !strings.Contains(ae.Message, `adapter "paint" of model "latentmesh-tiny-torch" is not loaded on any agent`) {
		t.Errorf("a request naming an adapter no engine has: %v, want a 400 on lora naming it", err)
	}
}

// torchReferenceLora runs s in one process without an adapter ("") and
// with adapter file path ("paint"), returning each one's RGBA bytes.
func torchReferenceLora(t *testing.T, weights string, s engine.Spec, path string) map[string][]byte {
	t.Helper()
	one := map[string]any{"prompt": s.Prompt, "negative_prompt": s.NegativePrompt, "seed": s.Seed, "width": s.Width, "height": s.Height,
		"frames": s.Frames, "steps": s.Steps, "guidance_scale": s.GuidanceScale}
	two := map[string]any{"lora": path}
	for k, v := range one {
		two[k] = v
	}
	js, _ := json.Marshal([]map[string]any{one, two})
	out := filepath.Join(t.TempDir(), "ref.rgba")
	if b, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--reference", string(js), out).CombinedOutput(); err != nil {
		t.Fatalf("reference run: %v\n%s", err, b)
	}
	all, err := os.ReadFile(out)
	n := 4 * s.Width * s.Height * s.Frames
	if err != nil || len(all) != 2*n {
		t.Fatalf("reference wrote %d bytes (%v), want %d", len(all), err, 2*n)
	}
	return map[string][]byte{"": all[:n], "paint": all[n:]}
}
