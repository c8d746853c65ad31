package testbed

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

const videoModel = "latentmesh-tiny-video"

// refImage is a w x h opaque gradient, as pixels (NRGBA) and as a PNG.
func refImage(t *testing.T, w, h int) ([]byte, []byte) {
	t.Helper()
	img := image.NewNRGBA(image.Rect(0, 0, w, h))
	for y := range h {
		for x := range w {
			img.SetNRGBA(x, y, color.NRGBA{uint8(5 * x), uint8(6 * y), uint8(3 * (x + y)), 255})
		}
	}
	var b bytes.Buffer
	if err := png.Encode(&b, img); err != nil {
		t.Fatal(err)
	}
	return img.Pix, b.Bytes()
}

// Criterion (issue 20, done-when 2): the torch worker's protocol v2 model
// serves, through a mesh of an encode, a denoise and a decode agent, a
// video job with two kinds of conditioning tensor (token sequences of the
// texts' own lengths, a float16 pooled vector), a 4x temporal latent (9
// frames, 3 latent frames, decoded chunk by chunk), a reference image and
// a parameter; the GIF is byte-equal to the one the agent makes of the
// single-process --reference run's pixels. At submission, 81 frames of
// this 4k+1 model map to 21 latent frames, 80 frames are refused, and so
// are a request without the image the model needs and an unknown
// parameter; the image object lives exactly as long as its job.
func TestTorchVideoShapesMatchSingleProcess(t *testing.T) {
	weights := torchWeights(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, agents, _ := torchMesh(t, ctx, weights, 0, map[string]jobs.Stage{"encode-v": jobs.Encode, "denoise-v": jobs.Denoise, "decode-v": jobs.Decode})
	entry := agents["encode-v"]
	eventually(t, 30*time.Second, func() error {
		if _, ok := entry.ModelLimits(videoModel); !ok || !entry.ModelServed(videoModel) {
			return fmt.Errorf("%s not served with its record yet", videoModel)
		}
		return nil
	})
	cli := &httpapi.Client{BaseURL: "http://" + entry.HTTPAddr()}
	pix, pngBytes := refImage(t, 48, 40)
	b64 := base64.StdEncoding.EncodeToString(pngBytes)
	ptr := func(n int) *int { return &n }
	seed, guidance := int64(21), 5.0
	req := func(frames int) httpapi.JobRequest {
		return httpapi.JobRequest{Model: videoModel, Prompt: "a fox running through snow", NegativePrompt: "blurry", Seed: &seed,
			Width: ptr(64), Height: ptr(64), Frames: ptr(frames), Steps: ptr(4), GuidanceScale: &guidance,
			Params: engine.Params{"guidance_rescale": engine.NumberParam(0.7)}, Image: b64}
	}

	// At submission: 81 frames are 21 latent frames; the rest refused.
	long, err := cli.Submit(ctx, req(81))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Cancel(ctx, long.ID); err != nil {
		t.Fatal(err)
	}
	if long.LatentFrames != 21 {
		t.Errorf("81 frames of a 4k+1 model: %d latent frames, want 21", long.LatentFrames)
	}
	for _, tc := range []struct {
		name  string
		edit  func(*httpapi.JobRequest)
		param string
		want  string
	}{
		{"80 frames", func(r *httpapi.JobRequest) { r.Frames = ptr(80) }, "frames", "80: must be 4k+1"},
		{"no image", func(r *httpapi.JobRequest) { r.Image = "" }, "image", "the model needs a reference image"},
		{"an unknown parameter", func(r *httpapi.JobRequest) { r.Params = engine.Params{"shift": engine.NumberParam(3)} }, "params", `"shift": unknown; the model takes guidance_rescale`},
		{"a parameter out of range", func(r *httpapi.JobRequest) { r.Params = engine.Params{"guidance_rescale": engine.NumberParam(2)} }, "params", "2: must be in [0,1]"},
	} {
		r := req(9)
		tc.edit(&r)
		_, err := cli.Submit(ctx, r)
		var ae *httpapi.APIError
		if !errors.As(err, &ae) || ae.Status != 400 || ae.Param != tc.param || !strings.Contains(ae.Message, tc.want) {
			t.Errorf("%s: %v, want a 400 on %s saying %q", tc.name, err, tc.param, tc.want)
		}
	}

	// The video, through the mesh.
	job, err := cli.Submit(ctx, req(9))
	if err != nil {
		t.Fatal(err)
	}
	if job.LatentFrames != 3 || job.Spec.Image == nil || job.Spec.Params["guidance_rescale"] != engine.NumberParam(0.7) {
		t.Fatalf("submitted: latent frames %d, image %+v, params %v", job.LatentFrames, job.Spec.Image, job.Spec.Params)
	}
	done, err := entry.Wait(ctx, job.ID)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job %s: %s %+v (%v)", job.ID, done.State, done.Error, err)
	}
	for st, node := range map[jobs.Stage]string{jobs.Encode: "encode-v", jobs.Denoise: "denoise-v", jobs.Decode: "decode-v"} {
		if got := done.Stages[st].Node; got != node {
			t.Errorf("%s ran on %s, want %s", st, got, node)
		}
	}
	gif, ctype, err := cli.Result(ctx, job.ID)
	if err != nil || ctype != engine.ContentTypeGIF {
		t.Fatalf("result: %s, %v", ctype, err)
	}

	// The same pipeline in one process, without latentmesh; the agent's
	// own frame sink makes its GIF.
	dir := t.TempDir()
	imgPath := filepath.Join(dir, "ref.rgba")
	if err := os.WriteFile(imgPath, pix, 0o600); err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal([]map[string]any{{"model": videoModel, "prompt": "a fox running through snow", "negative_prompt": "blurry",
		"seed": seed, "width": 64, "height": 64, "frames": 9, "steps": 4, "guidance_scale": guidance,
		"params": map[string]any{"guidance_rescale": 0.7}, "image": map[string]any{"path": imgPath, "width": 48, "height": 40}}})
	out := filepath.Join(dir, "ref.out")
	if b, err := exec.Command(SystemPython, WorkerScript("torch_pipeline.py"), "--weights", weights, "--reference", string(js), out).CombinedOutput(); err != nil {
		t.Fatalf("reference run: %v\n%s", err, b)
	}
	want, err := os.ReadFile(out)
	if n := 9 * 64 * 64 * 4; err != nil || len(want) != n {
		t.Fatalf("reference wrote %d bytes (%v), want %d", len(want), err, n)
	}
	limits, _ := entry.ModelLimits(videoModel)
	sink, err := engine.NewFrameSink(done.Spec, limits)
	if err != nil {
		t.Fatal(err)
	}
	for f := range 9 {
		if err := sink.PutRGBA(f, want[f*64*64*4:][:64*64*4]); err != nil {
			t.Fatal(err)
		}
	}
	refGIF, _, err := sink.Finish()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gif, refGIF) {
		t.Errorf("the mesh's GIF (%d bytes) differs from the single-process run's (%d bytes)", len(gif), len(refGIF))
	}
	if bytes.Equal(want[:64*64*4], want[64*64*4:][:64*64*4]) {
		t.Error("video frames 0 and 1 are the same image: the temporal decoder drew nothing")
	}

	// The image object went with its job (and the cancelled job's with
	// it), deleted in the transaction that ended it.
	for _, id := range []string{job.ID, long.ID} {
		v, err := entry.StoreStatus(ctx, id, true)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range v.Objects {
			if o.ID == jobs.ImageID(id) {
				t.Errorf("job %s's image object is still in the Store", id)
			}
		}
	}
}
