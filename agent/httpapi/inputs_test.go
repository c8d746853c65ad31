package httpapi

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"image"
	"image/color"
	"image/gif"
	"image/png"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// pngOf is a w x h PNG whose pixel (x, y) is (x, y, 7, 255).
func pngOf(t *testing.T, w, h int) []byte {
	t.Helper()
	img := image.NewNRGBA(image.Rect(0, 0, w, h))
	for y := range h {
		for x := range w {
			img.SetNRGBA(x, y, color.NRGBA{uint8(x), uint8(y), 7, 255})
		}
	}
	var b bytes.Buffer
	if err := png.Encode(&b, img); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// gifOf is a 2x2 GIF.
func gifOf(t *testing.T) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := gif.Encode(&b, image.NewPaletted(image.Rect(0, 0, 2, 2), color.Palette{color.Black, color.White}), nil); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// multipartFile is a form of fields and one file part named file.
func multipartFile(t *testing.T, fields map[string]string, file string, data []byte) (string, string) {
	t.Helper()
	var b bytes.Buffer
	mw := multipart.NewWriter(&b)
	for k, v := range fields {
		mw.WriteField(k, v)
	}
	if file != "" {
		fw, err := mw.CreateFormFile(file, "in.png")
		if err != nil {
			t.Fatal(err)
		}
		fw.Write(data)
	}
	mw.Close()
	return mw.FormDataContentType(), b.String()
}

// POST /v1/jobs takes "params" and a base64 "image" (or a data: URL),
// decoded to RGBA pixels for the agent; a body that large needs an upload
// slot, and a bad image is a 400 naming the field.
func TestJobWithImageAndParams(t *testing.T) {
	f := newFakeJobs(false)
	h := NewHandler(testConfig(t), f)
	b64 := base64.StdEncoding.EncodeToString(pngOf(t, 40, 30))
	for i, img := range []string{b64, "data:image/png;base64," + b64} {
		body := `{"prompt":"a fox","model":"m","frames":9,"params":{"shift":5,"sampler":"unipc","rescale":0.7,"true_cfg":true},"image":"` + img + `"}`
		j := decodeJob(t, do(h, "POST", "/v1/jobs", "application/json", body), http.StatusAccepted)
		want := engine.Params{"shift": engine.IntegerParam(5), "sampler": engine.StringParam("unipc"), "rescale": engine.NumberParam(0.7), "true_cfg": engine.BoolParam(true)}
		if len(j.Spec.Params) != 4 || j.Spec.Params["shift"] != want["shift"] || j.Spec.Params["rescale"] != want["rescale"] || j.Spec.Params["true_cfg"] != want["true_cfg"] {
			t.Errorf("case %d: params %v, want %v (the agent checks them against the model)", i, j.Spec.Params, want)
		}
		up := f.images[j.ID]
		if up == nil || up.Width != 40 || up.Height != 30 || len(up.Pix) != 40*30*4 || !bytes.Equal(up.Pix[4*(2*40+3):][:4], []byte{3, 2, 7, 255}) {
			t.Fatalf("case %d: the image the agent got: %+v", i, up)
		}
	}
	for _, tc := range []struct {
		name, image, want string
	}{
		{"not base64", "***", "image: not base64"},
		{"not an image", base64.StdEncoding.EncodeToString([]byte("plain text")), "image: not a PNG or JPEG image"},
		{"a GIF", base64.StdEncoding.EncodeToString(gifOf(t)), "image: a gif image: want PNG or JPEG"},
		{"a data: URL not base64", "data:image/png,abc", "must be base64"},
		{"too many pixels", base64.StdEncoding.EncodeToString(pngOf(t, 4097, 1)), "image: 4097x1"},
	} {
		w := do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"x","image":"`+tc.image+`"}`)
		e := decodeAPIError(t, w)
		if w.Code != http.StatusBadRequest || e.Param != "image" || !strings.Contains(e.Message, tc.want) {
			t.Errorf("%s: %d %+v, want 400 on image saying %q", tc.name, w.Code, e, tc.want)
		}
	}
	w := do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"x","params":{"shift":null}}`)
	if w.Code != http.StatusBadRequest {
		t.Errorf("a null parameter: %d, want 400", w.Code)
	}
}

// Bodies that may hold an image are read a few at a time: with every
// upload slot taken, one more is refused at once, 503 with Retry-After;
// a small body needs no slot.
func TestUploadSlots(t *testing.T) {
	cfg := testConfig(t)
	cfg.MaxUploads = 1
	h := NewHandler(cfg, newFakeJobs(false))
	inner := serverOf(t, cfg)
	inner.uploads <- struct{}{} // the one slot taken
	big := strings.Repeat(" ", int(cfg.MaxBodyBytes)) + `{"prompt":"x"}`
	r := httptest.NewRequest("POST", "/v1/jobs", strings.NewReader(big))
	w := httptest.NewRecorder()
	inner.createJob(w, r)
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") == "" {
		t.Errorf("a large body with no upload slot: %d, want 503 with Retry-After", w.Code)
	}
	if w := do(h, "POST", "/v1/jobs", "application/json", `{"prompt":"x"}`); w.Code != http.StatusAccepted {
		t.Errorf("a small body: %d, want 202", w.Code)
	}
}

// serverOf is the server behind a handler of cfg, for calling handlers
// directly.
func serverOf(t *testing.T, cfg Config) *server {
	t.Helper()
	cfg = cfg.withDefaults()
	return &server{cfg: cfg, jobs: newFakeJobs(false), log: cfg.Logger, warn: &ignoredFields{}, uploads: make(chan struct{}, cfg.MaxUploads)}
}

// POST /v1/images/edits: OpenAI's multipart form, the image a file part,
// the other fields as form fields (params as JSON); its jobs carry the
// image. Without an image, with a mask or not multipart, it is refused.
func TestImagesEdits(t *testing.T) {
	f := newFakeJobs(true)
	h := NewHandler(testConfig(t), f)
	ct, body := multipartFile(t, map[string]string{"prompt": "make it blue", "model": "m", "n": "2", "size": "64x64", "seed": "5", "params": `{"strength":0.5}`}, "image", pngOf(t, 16, 16))
	w := do(h, "POST", "/v1/images/edits", ct, body)
	if w.Code != http.StatusOK {
		t.Fatalf("edits: %d %s", w.Code, w.Body)
	}
	var resp ImagesResponse
	if err := json.Unmarshal(w.Body.Bytes(), &resp); err != nil || len(resp.Data) != 2 {
		t.Fatalf("edits answer %s: %v", w.Body, err)
	}
	for _, d := range resp.Data {
		j := f.jobs[d.Latentmesh.JobID]
		if up := f.images[j.ID]; up == nil || up.Width != 16 || j.Spec.Prompt != "make it blue" || j.Spec.Params["strength"] != engine.NumberParam(0.5) || j.Spec.Width != 64 {
			t.Errorf("job %s: spec %+v, image %v", j.ID, j.Spec, up)
		}
	}
	for _, tc := range []struct {
		name       string
		ct, body   string
		status     int
		param, msg string
	}{
		{"no image", "", "", http.StatusBadRequest, "image", "an edit needs an image file"},
		{"a mask", "", "", http.StatusBadRequest, "mask", "masked edits are not supported"},
		{"JSON", "application/json", `{"prompt":"x"}`, http.StatusUnsupportedMediaType, "", "send multipart/form-data"},
		{"an unknown field", "", "", http.StatusBadRequest, "colour", `unknown field "colour"`},
	} {
		ct, body := tc.ct, tc.body
		switch tc.name {
		case "no image":
			ct, body = multipartFile(t, map[string]string{"prompt": "x"}, "", nil)
		case "a mask":
			ct, body = multipartFile(t, map[string]string{"prompt": "x", "mask": "m"}, "image", pngOf(t, 8, 8))
		case "an unknown field":
			ct, body = multipartFile(t, map[string]string{"prompt": "x", "colour": "blue"}, "image", pngOf(t, 8, 8))
		}
		w := do(h, "POST", "/v1/images/edits", ct, body)
		e := decodeAPIError(t, w)
		if w.Code != tc.status || e.Param != tc.param || !strings.Contains(e.Message, tc.msg) {
			t.Errorf("%s: %d %+v, want %d on %q saying %q", tc.name, w.Code, e, tc.status, tc.param, tc.msg)
		}
	}
}
