package httpapi

// This file holds what a request carries beyond its text and sizes (issue
// 20): a model's own parameters ("params", checked by the agent against
// the schema the model's engine registered) and a reference image:
// "image" in POST /v1/jobs (base64, or a data: URL) and the "image" file
// of POST /v1/images/edits (OpenAI's multipart shape). An image is bounded
// twice: its encoded size by MaxImageBytes (the body grows by that much,
// so such bodies are read MaxUploads at a time), its pixels by
// engine.MaxImageSide and engine.MaxImagePixels, read from its header
// before anything is decoded. PNG and JPEG are accepted.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"image"
	"image/draw"
	_ "image/jpeg" // registers the JPEG decoder
	_ "image/png"  // registers the PNG decoder
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// imageBodyBytes is how large a body carrying an image may be: the
// image's bytes, base64's third more, and the rest of the request.
func (s *server) imageBodyBytes() int64 {
	return s.cfg.MaxBodyBytes + (s.cfg.MaxImageBytes+2)/3*4 + 4<<10
}

// uploadSlot takes one of MaxUploads slots for a request whose body may
// hold an image (larger than MaxBodyBytes, or of unknown length); release
// gives it back. With none free it answers 503 and ok is false.
func (s *server) uploadSlot(w http.ResponseWriter, r *http.Request) (release func(), ok bool) {
	if r.ContentLength >= 0 && r.ContentLength <= s.cfg.MaxBodyBytes {
		return func() {}, true
	}
	select {
	case s.uploads <- struct{}{}:
		return func() { <-s.uploads }, true
	default:
		e := apiErr(http.StatusServiceUnavailable, typeServer, CodeOverloaded,
			"this agent is reading %d image uploads already; retry shortly or use another agent", cap(s.uploads))
		e.RetryAfter = 1
		writeError(w, e)
		return nil, false
	}
}

// countingBody counts the bytes read of a request body.
type countingBody struct {
	io.ReadCloser
	n int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n += int64(n)
	return n, err
}

// decodeImage checks and decodes an uploaded image (PNG or JPEG) into RGBA
// pixels, bounding its size from its header first. Errors are
// *engine.FieldError of field "image".
func decodeImage(data []byte, maxBytes int64) (*jobs.ImageUpload, error) {
	bad := func(format string, a ...any) error {
		return &engine.FieldError{Field: "image", Msg: fmt.Sprintf(format, a...)}
	}
	if len(data) == 0 {
		return nil, bad("empty")
	}
	if int64(len(data)) > maxBytes {
		return nil, bad("%d bytes, at most %d", len(data), maxBytes)
	}
	cfg, format, err := image.DecodeConfig(bytes.NewReader(data))
	if err != nil {
		return nil, bad("not a PNG or JPEG image: %v", err)
	}
	if format != "png" && format != "jpeg" {
		return nil, bad("a %s image: want PNG or JPEG", format)
	}
	if err := (engine.ModelInputs{Image: &engine.ImageInput{}}).CheckImage(true, cfg.Width, cfg.Height); err != nil {
		return nil, err
	}
	img, _, err := image.Decode(bytes.NewReader(data))
	if err != nil {
		return nil, bad("%s: %v", format, err)
	}
	b := img.Bounds()
	if b.Dx() != cfg.Width || b.Dy() != cfg.Height {
		return nil, bad("%s decodes to %dx%d, its header says %dx%d", format, b.Dx(), b.Dy(), cfg.Width, cfg.Height)
	}
	out := image.NewNRGBA(image.Rect(0, 0, b.Dx(), b.Dy()))
	draw.Draw(out, out.Rect, img, b.Min, draw.Src)
	return &jobs.ImageUpload{Width: b.Dx(), Height: b.Dy(), Pix: out.Pix}, nil
}

// imageField decodes a JSON request's "image": base64 (standard, padded),
// or a data: URL of it.
func imageField(v string, maxBytes int64) (*jobs.ImageUpload, error) {
	if v == "" {
		return nil, nil
	}
	if rest, ok := strings.CutPrefix(v, "data:"); ok {
		_, b64, ok := strings.Cut(rest, ";base64,")
		if !ok {
			return nil, &engine.FieldError{Field: "image", Msg: "a data: URL must be base64 (data:image/png;base64,...)"}
		}
		v = b64
	}
	if int64(base64.StdEncoding.DecodedLen(len(v))) > maxBytes+2 {
		return nil, &engine.FieldError{Field: "image", Msg: fmt.Sprintf("more than %d bytes", maxBytes)}
	}
	data, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		return nil, &engine.FieldError{Field: "image", Msg: fmt.Sprintf("not base64: %v", err)}
	}
	return decodeImage(data, maxBytes)
}

// imagesEdits is POST /v1/images/edits: OpenAI's multipart form with an
// "image" file (or "image[]", one), the generation fields, and "params" as
// a JSON object. Its jobs run as a generation's, each with the image.
func (s *server) imagesEdits(w http.ResponseWriter, r *http.Request) {
	release, ok := s.uploadSlot(w, r)
	if !ok {
		return
	}
	defer release()
	q, img, e := s.decodeEditsRequest(w, r)
	if e != nil {
		writeError(w, e)
		return
	}
	s.generateImages(w, r, q, img)
}

// decodeEditsRequest reads the multipart form of an edits request, parts
// one by one into memory, the whole body bounded.
func (s *server) decodeEditsRequest(w http.ResponseWriter, r *http.Request) (imagesRequest, *jobs.ImageUpload, *APIError) {
	var q imagesRequest
	max := s.imageBodyBytes()
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mt != "multipart/form-data" || params["boundary"] == "" {
		return q, nil, apiErr(http.StatusUnsupportedMediaType, typeInvalidRequest, CodeUnsupportedMedia,
			"Content-Type %q is not supported; send multipart/form-data with an image file", r.Header.Get("Content-Type"))
	}
	if r.ContentLength > max {
		return q, nil, tooLarge(max)
	}
	readErr := func(err error) *APIError {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return tooLarge(max)
		}
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "malformed multipart/form-data body: %v", err)
	}
	r.Body = http.MaxBytesReader(w, r.Body, max)
	mr, err := r.MultipartReader()
	if err != nil {
		return q, nil, readErr(err)
	}
	var img *jobs.ImageUpload
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return q, nil, readErr(err)
		}
		v, err := io.ReadAll(p)
		if err != nil {
			return q, nil, readErr(err)
		}
		name := p.FormName()
		if name == "image" || name == "image[]" {
			if img != nil {
				return q, nil, fieldError(&engine.FieldError{Field: "image", Msg: "one image per request"})
			}
			if img, err = decodeImage(v, s.cfg.MaxImageBytes); err != nil {
				return q, nil, fieldError(err)
			}
			continue
		}
		if e := q.setField(name, string(v)); e != nil {
			return q, nil, e
		}
	}
	if img == nil {
		return q, nil, fieldError(&engine.FieldError{Field: "image", Msg: "an edit needs an image file"})
	}
	return q, img, nil
}

// setField sets one form field of an edits request. Unknown names are an
// error, as in JSON.
func (q *imagesRequest) setField(name, v string) *APIError {
	badType := func(want string) *APIError {
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidType, "%s: %q is not %s", name, v, want)
		e.Param = name
		return e
	}
	atoi := func(dst **int) *APIError {
		n, err := strconv.Atoi(v)
		if err != nil {
			return badType("an integer")
		}
		*dst = &n
		return nil
	}
	switch name {
	case "prompt":
		q.Prompt = v
	case "model":
		q.Model = v
	case "size":
		q.Size = v
	case "response_format":
		q.ResponseFormat = v
	case "user":
		q.User = v
	case "quality":
		q.Quality = v
	case "output_format":
		q.OutputFormat = v
	case "background":
		q.Background = v
	case "negative_prompt":
		q.NegativePrompt = v
	case "priority":
		q.Priority = v
	case "transfer_mode":
		q.TransferMode = v
	case "lora":
		q.Lora = v
	case "n":
		return atoi(&q.N)
	case "num_inference_steps":
		return atoi(&q.NumInferenceSteps)
	case "frames":
		return atoi(&q.Frames)
	case "output_compression":
		return atoi(&q.OutputCompression)
	case "seed":
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return badType("an integer")
		}
		q.Seed = &n
	case "guidance_scale":
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return badType("a number")
		}
		q.GuidanceScale = &f
	case "params":
		if err := json.Unmarshal([]byte(v), &q.Params); err != nil {
			return badType("a JSON object of parameters")
		}
	case "mask":
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"mask", "mask: masked edits are not supported; the model edits the whole image")
		e.Param = "mask"
		return e
	default:
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeUnknownField, "unknown field %q", name)
		e.Param = name
		return e
	}
	return nil
}
