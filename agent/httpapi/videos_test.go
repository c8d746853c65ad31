package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"image"
	"image/color"
	"image/color/palette"
	"image/gif"
	"image/png"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// listingJobs is fakeJobs with a job list (by submission order) and models.
type listingJobs struct {
	*fakeJobs
	models []ServedModel
}

func (l listingJobs) ListJobs(ctx context.Context, q jobs.ListQuery) ([]jobs.Job, bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ids := make([]int, 0, len(l.jobs))
	for id := range l.jobs {
		n, _ := strconv.Atoi(strings.TrimPrefix(id, "job-"))
		ids = append(ids, n)
	}
	slices.Sort(ids)
	if q.Newest {
		slices.Reverse(ids)
	}
	var out []jobs.Job
	after := q.After == ""
	if !after {
		if _, ok := l.jobs[q.After]; !ok {
			return nil, false, jobs.ErrNotFound
		}
	}
	for i, n := range ids {
		j := *l.jobs["job-"+strconv.Itoa(n)]
		if !after {
			after = j.ID == q.After
			continue
		}
		if q.Match == nil || q.Match(j) {
			out = append(out, j)
		}
		if len(out) == q.Limit {
			return out, i < len(ids)-1, nil
		}
	}
	return out, false, nil
}

func (l listingJobs) Models() []ServedModel { return l.models }

func decodeVideo(t *testing.T, w *httptest.ResponseRecorder) Video {
	t.Helper()
	if w.Code != http.StatusOK {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	var v Video
	if err := json.Unmarshal(w.Body.Bytes(), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

func multipartBody(t *testing.T, fields map[string]string) (string, string) {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for k, v := range fields {
		if err := mw.WriteField(k, v); err != nil {
			t.Fatal(err)
		}
	}
	mw.Close()
	return mw.FormDataContentType(), buf.String()
}

// JSON and multipart bodies (the official clients send the latter) make
// the same video: seconds map to frames at VideoFrameRate.
func TestVideoCreate(t *testing.T) {
	ct, mp := multipartBody(t, map[string]string{"prompt": "a fox", "seconds": "4", "size": "128x64", "seed": "7", "num_inference_steps": "3"})
	for _, tc := range []struct{ name, ct, body string }{
		{"json", "application/json", `{"prompt":"a fox","seconds":"4","size":"128x64","seed":7,"num_inference_steps":3}`},
		{"json number seconds", "application/json", `{"prompt":"a fox","seconds":4,"size":"128x64","seed":7,"num_inference_steps":3}`},
		{"multipart", ct, mp},
		{"form", "application/x-www-form-urlencoded", "prompt=a+fox&seconds=4&size=128x64&seed=7&num_inference_steps=3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeJobs(false)
			v := decodeVideo(t, do(NewHandler(testConfig(t), f), "POST", "/v1/videos", tc.ct, tc.body))
			if v.Object != "video" || v.Status != "queued" || v.Progress != 0 || v.Seconds != "4" || v.Size != "128x64" ||
				v.Model != engine.DefaultModel || v.CreatedAt != 1700000000 || v.CompletedAt != nil || v.Prompt != "a fox" {
				t.Fatalf("video %+v", v)
			}
			j := f.jobs[v.ID]
			if j.Spec.Frames != 50 || j.Spec.Width != 128 || j.Spec.Height != 64 || j.Spec.Seed != 7 || j.Spec.Steps != 3 {
				t.Fatalf("job spec %+v", j.Spec)
			}
		})
	}
}

func TestVideoCreateRefusals(t *testing.T) {
	refImg, refBody := func() (string, string) {
		var buf bytes.Buffer
		mw := multipart.NewWriter(&buf)
		_ = mw.WriteField("prompt", "x")
		fw, _ := mw.CreateFormFile("input_reference", "ref.png")
		_, _ = fw.Write([]byte("png"))
		mw.Close()
		return mw.FormDataContentType(), buf.String()
	}()
	js := "application/json"
	for _, tc := range []struct {
		name, ct, body, code string
		says                 []string
	}{
		{"openai default size", js, `{"prompt":"x","size":"720x1280"}`, "invalid_size", []string{"720x1280", "[64,1024]", "256x256"}},
		{"too many pixels", js, `{"prompt":"x","size":"1024x1024"}`, "invalid_size", []string{"1024x1024", "128x128"}},
		{"too long", js, `{"prompt":"x","seconds":"12"}`, "invalid_seconds", []string{"150 frames", "5.12"}},
		{"one frame", js, `{"prompt":"x","seconds":"0.01"}`, "invalid_seconds", []string{"2 to 64"}},
		{"seconds word", js, `{"prompt":"x","seconds":"four"}`, "invalid_seconds", []string{"four"}},
		{"input reference json", js, `{"prompt":"x","input_reference":{"image_url":"http://x"}}`, "invalid_input_reference", []string{"not supported"}},
		{"input reference file", refImg, refBody, "invalid_input_reference", []string{"not supported"}},
		{"unknown form field", "application/x-www-form-urlencoded", "prompt=x&colour=red", CodeUnknownField, []string{"colour"}},
		{"bad form number", "application/x-www-form-urlencoded", "prompt=x&seed=seven", CodeInvalidType, []string{"seed"}},
		{"no prompt", js, `{"seconds":"4"}`, "invalid_prompt", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeJobs(false)
			w := do(NewHandler(testConfig(t), f), "POST", "/v1/videos", tc.ct, tc.body)
			if w.Code != http.StatusBadRequest {
				t.Fatalf("status %d: %s", w.Code, w.Body)
			}
			e := decodeAPIError(t, w)
			if e.Code != tc.code {
				t.Errorf("code %q, want %q: %s", e.Code, tc.code, e.Message)
			}
			for _, s := range tc.says {
				if !strings.Contains(e.Message, s) {
					t.Errorf("message %q does not say %q", e.Message, s)
				}
			}
			if len(f.jobs) != 0 {
				t.Error("a refused request submitted a job")
			}
		})
	}
}

// testGIF is a small animated GIF of n frames, as the engine writes them.
func testGIF(t *testing.T, w, h, n int) []byte {
	t.Helper()
	g := &gif.GIF{}
	for i := range n {
		img := image.NewPaletted(image.Rect(0, 0, w, h), palette.Plan9)
		for y := range h {
			for x := range w {
				img.Set(x, y, color.RGBA{uint8(x * 4), uint8(y * 4), uint8(i * 30), 255})
			}
		}
		g.Image = append(g.Image, img)
		g.Delay = append(g.Delay, 8)
	}
	var buf bytes.Buffer
	if err := gif.EncodeAll(&buf, g); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// A video goes queued, in progress (with its denoise step), completed;
// lists page by after and limit; its content is an MP4 and a thumbnail;
// delete removes it.
func TestVideoLifecycle(t *testing.T) {
	if _, err := exec.LookPath("ffmpeg"); err != nil && !testing.Short() {
		t.Fatalf("ffmpeg not installed (scripts/install-deps.sh): %v", err)
	}
	f := newFakeJobs(false)
	f.stepOnGet = true
	lj := listingJobs{fakeJobs: f}
	h := NewHandler(testConfig(t), lj)
	ctx := context.Background()
	img, _ := f.Submit(ctx, engine.Spec{Prompt: "an image"}.WithDefaults(), jobs.Options{}) // not a video
	var ids []string
	for range 3 {
		v := decodeVideo(t, do(h, "POST", "/v1/videos", "", `{"prompt":"x","size":"64x64","seconds":"0.32","num_inference_steps":2}`))
		ids = append(ids, v.ID)
	}
	if v := decodeVideo(t, do(h, "GET", "/v1/videos/"+ids[0], "", "")); v.Status != "in_progress" || v.Seconds != "0.32" {
		t.Fatalf("first poll: %+v", v)
	}
	var seen []int
	for {
		v := decodeVideo(t, do(h, "GET", "/v1/videos/"+ids[0], "", ""))
		seen = append(seen, v.Progress)
		if v.Status == "completed" {
			if v.CompletedAt == nil || v.Error != nil {
				t.Fatalf("completed video %+v", v)
			}
			break
		}
		if len(seen) > 20 {
			t.Fatalf("never completed: progress %v", seen)
		}
	}
	if !slices.IsSorted(seen) || seen[len(seen)-1] != 100 || !slices.Contains(seen, 47) {
		t.Fatalf("progress %v: want rising to 100 through step 1 of 2 (47)", seen)
	}
	if w := do(h, "GET", "/v1/videos/"+img.ID, "", ""); w.Code != 404 {
		t.Fatalf("an image as a video: %d", w.Code)
	}

	// The list: newest first, images left out, paged with after.
	var l VideoList
	w := do(h, "GET", "/v1/videos?limit=2", "", "")
	if err := json.Unmarshal(w.Body.Bytes(), &l); err != nil || w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if l.Object != "list" || len(l.Data) != 2 || l.Data[0].ID != ids[2] || l.Data[1].ID != ids[1] || !l.HasMore || *l.LastID != ids[1] || *l.FirstID != ids[2] {
		t.Fatalf("first page %s", w.Body)
	}
	w = do(h, "GET", "/v1/videos?limit=2&after="+ids[1], "", "")
	if err := json.Unmarshal(w.Body.Bytes(), &l); err != nil || len(l.Data) != 1 || l.Data[0].ID != ids[0] || l.HasMore {
		t.Fatalf("second page %s", w.Body)
	}
	w = do(h, "GET", "/v1/videos?order=asc&limit=1", "", "")
	if err := json.Unmarshal(w.Body.Bytes(), &l); err != nil || len(l.Data) != 1 || l.Data[0].ID != ids[0] {
		t.Fatalf("ascending %s", w.Body)
	}
	for _, q := range []string{"limit=0", "limit=101", "order=sideways", "after=job-99"} {
		if w := do(h, "GET", "/v1/videos?"+q, "", ""); w.Code != 400 {
			t.Errorf("%s: %d %s", q, w.Code, w.Body)
		}
	}

	// Content: the engine's GIF served as MP4, or its first frame.
	f.mu.Lock()
	f.data[ids[0]] = testGIF(t, 64, 64, 4)
	f.jobs[ids[0]].Result.ContentType = engine.ContentTypeGIF
	f.mu.Unlock()
	w = do(h, "GET", "/v1/videos/"+ids[0]+"/content", "", "")
	if w.Code != 200 || w.Header().Get("Content-Type") != "video/mp4" || !bytes.Equal(w.Body.Bytes()[4:8], []byte("ftyp")) {
		t.Fatalf("content: %d %q %q", w.Code, w.Header().Get("Content-Type"), w.Body.Bytes()[:min(16, w.Body.Len())])
	}
	w = do(h, "GET", "/v1/videos/"+ids[0]+"/content?variant=thumbnail", "", "")
	if th, err := png.Decode(w.Body); err != nil || th.Bounds().Dx() != 64 || w.Header().Get("Content-Type") != "image/png" {
		t.Fatalf("thumbnail: %v %v", err, w.Header())
	}
	if w := do(h, "GET", "/v1/videos/"+ids[0]+"/content?variant=spritesheet", "", ""); w.Code != 400 {
		t.Fatalf("spritesheet: %d", w.Code)
	}
	if w := do(h, "GET", "/v1/videos/"+ids[1]+"/content", "", ""); w.Code != 409 {
		t.Fatalf("content of a running video: %d %s", w.Code, w.Body)
	}

	// Delete: a finished video goes; a running one is cancelled, then goes.
	for _, id := range ids[:2] {
		w = do(h, "DELETE", "/v1/videos/"+id, "", "")
		var d videoDeleted
		if err := json.Unmarshal(w.Body.Bytes(), &d); err != nil || w.Code != 200 || d != (videoDeleted{ID: id, Object: "video.deleted", Deleted: true}) {
			t.Fatalf("delete %s: %d %s", id, w.Code, w.Body)
		}
		if w := do(h, "GET", "/v1/videos/"+id, "", ""); w.Code != 404 {
			t.Fatalf("after delete: %d", w.Code)
		}
	}
}

// Without ffmpeg the content is the engine's GIF, and the video says so.
func TestVideoWithoutFFmpeg(t *testing.T) {
	f := newFakeJobs(true)
	cfg := testConfig(t)
	cfg.FFmpeg = "none"
	h := NewHandler(cfg, f)
	v := decodeVideo(t, do(h, "POST", "/v1/videos", "", `{"prompt":"x","size":"64x64"}`))
	if v.Status != "completed" || v.Latentmesh.Format != "gif" || v.Latentmesh.ContentType != "image/gif" {
		t.Fatalf("video %+v", v)
	}
	want := testGIF(t, 64, 64, 3)
	f.mu.Lock()
	f.data[v.ID] = want
	f.jobs[v.ID].Result.ContentType = engine.ContentTypeGIF
	f.mu.Unlock()
	w := do(h, "GET", "/v1/videos/"+v.ID+"/content", "", "")
	if w.Code != 200 || w.Header().Get("Content-Type") != "image/gif" || !bytes.Equal(w.Body.Bytes(), want) {
		t.Fatalf("content: %d %q", w.Code, w.Header().Get("Content-Type"))
	}
}

func TestModels(t *testing.T) {
	var l ModelList
	w := do(NewHandler(testConfig(t), newFakeJobs(true)), "GET", "/v1/models", "", "")
	if err := json.Unmarshal(w.Body.Bytes(), &l); err != nil || l.Object != "list" || len(l.Data) != 1 || l.Data[0].ID != engine.DefaultModel || l.Data[0].Object != "model" {
		t.Fatalf("without a lister: %s", w.Body)
	}
	h := NewHandler(testConfig(t), listingJobs{fakeJobs: newFakeJobs(true), models: []ServedModel{{Name: "wan/2.1", Nodes: 3}, {Name: engine.DefaultModel, Nodes: 1}}})
	w = do(h, "GET", "/v1/models", "", "")
	if err := json.Unmarshal(w.Body.Bytes(), &l); err != nil || len(l.Data) != 2 || l.Data[0].ID != engine.DefaultModel || l.Data[1].ID != "wan/2.1" || l.Data[1].Latentmesh.Nodes != 3 {
		t.Fatalf("with a lister: %s", w.Body)
	}
	var m Model
	if w := do(h, "GET", "/v1/models/wan/2.1", "", ""); json.Unmarshal(w.Body.Bytes(), &m) != nil || m.ID != "wan/2.1" || m.OwnedBy != "latentmesh" {
		t.Fatalf("retrieve: %d %s", w.Code, w.Body)
	}
	if w := do(h, "GET", "/v1/models/sora-2", "", ""); w.Code != 404 {
		t.Fatalf("unserved model: %d", w.Code)
	}
}

// pngJobs is fakeJobs whose results are real PNGs.
type pngJobs struct{ *fakeJobs }

func (p pngJobs) Result(ctx context.Context, id string) ([]byte, string, error) {
	if _, _, err := p.fakeJobs.Result(ctx, id); err != nil {
		return nil, "", err
	}
	var buf bytes.Buffer
	_ = png.Encode(&buf, image.NewRGBA(image.Rect(0, 0, 64, 64)))
	return buf.Bytes(), engine.ContentTypePNG, nil
}

// OpenAI's other image fields: quality sets the steps, jpeg re-encodes,
// url points at the hosted result; the rest is accepted.
func TestImagesOpenAIFields(t *testing.T) {
	f := newFakeJobs(true)
	h := NewHandler(testConfig(t), pngJobs{f})
	r := httptest.NewRequest("POST", "/v1/images/generations", strings.NewReader(
		`{"prompt":"x","size":"64x64","response_format":"url","quality":"high","style":"vivid","background":"transparent","moderation":"low","output_format":"png"}`))
	r.Host = "mesh.example:8080"
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	resp := decodeImages(t, w)
	d := resp.Data[0]
	if d.URL != "http://mesh.example:8080/v1/jobs/"+d.Latentmesh.JobID+"/result" || d.B64JSON != "" || resp.OutputFormat != "png" {
		t.Fatalf("url answer %s", w.Body)
	}
	if j := f.jobs[d.Latentmesh.JobID]; j.Spec.Steps != 2*engine.DefaultSpec().Steps {
		t.Fatalf("quality high: %d steps", j.Spec.Steps)
	}
	resp = decodeImages(t, do(h, "POST", "/v1/images/generations", "", `{"prompt":"x","quality":"low","output_format":"jpeg","output_compression":50}`))
	if resp.OutputFormat != "jpeg" || resp.Data[0].Latentmesh.ContentType != "image/jpeg" || !strings.HasPrefix(resp.Data[0].B64JSON, "/9j/") {
		t.Fatalf("jpeg answer: %+v", resp)
	}
	if j := f.jobs[resp.Data[0].Latentmesh.JobID]; j.Spec.Steps != engine.DefaultSpec().Steps/2 {
		t.Fatalf("quality low: %d steps", j.Spec.Steps)
	}
}

// An idle event stream sends keep-alive comments.
func TestEventStreamKeepAlive(t *testing.T) {
	fj := newFakeJobs(false)
	cfg := DefaultConfig()
	cfg.StreamKeepAlive = 20 * time.Millisecond
	release := make(chan struct{})
	srv := httptest.NewServer(NewHandler(cfg, blockedStream{fj, release}))
	defer srv.Close()
	job, _ := fj.Submit(context.Background(), engine.Spec{Prompt: "x"}.WithDefaults(), jobs.Options{})
	resp, err := http.Get(srv.URL + "/v1/jobs/" + job.ID + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got bytes.Buffer
	buf := make([]byte, 512)
	for !bytes.Contains(got.Bytes(), []byte("\n: keep-alive\n\n")) {
		n, err := resp.Body.Read(buf)
		got.Write(buf[:n])
		if err != nil {
			t.Fatalf("stream ended before a keep-alive: %v; read %q", err, got.String())
		}
	}
	close(release)
	rest := new(strings.Builder)
	_, _ = io.Copy(rest, resp.Body)
	if !strings.Contains(rest.String(), "event: done\n") {
		t.Fatalf("no done after the keep-alives: %q", rest.String())
	}
}

// blockedStream sends the job, then waits for release before finishing.
type blockedStream struct {
	*fakeJobs
	release chan struct{}
}

func (b blockedStream) StreamEvents(ctx context.Context, id string, onJob func(jobs.Job) error, onStep func(jobs.Step) error) (jobs.Job, error) {
	j, err := b.Get(ctx, id)
	if err != nil {
		return jobs.Job{}, err
	}
	if err := onJob(j); err != nil {
		return jobs.Job{}, err
	}
	select {
	case <-b.release:
	case <-ctx.Done():
		return jobs.Job{}, ctx.Err()
	}
	j.State = jobs.Succeeded
	return j, nil
}
