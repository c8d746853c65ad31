package httpapi

// This file holds what the images API does with OpenAI's fields beyond
// the prompt and size: quality sets the step count, output_format jpeg
// re-encodes, response_format url points at the hosted result; the rest
// is accepted and ignored with one logged warning per field.

import (
	"bytes"
	"fmt"
	"image/jpeg"
	"image/png"
	"net/http"
	"net/url"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// checkExtras refuses values OpenAI itself would refuse, and stream:true,
// which asks for an answer this endpoint does not give.
func (q imagesRequest) checkExtras() error {
	oneOf := func(field, v string, ok ...string) error {
		if v == "" {
			return nil
		}
		for _, o := range ok {
			if v == o {
				return nil
			}
		}
		return &engine.FieldError{Field: field, Msg: fmt.Sprintf("%q: must be one of %s", v, strings.Join(ok, ", "))}
	}
	for _, err := range []error{
		oneOf("quality", q.Quality, "auto", "low", "medium", "high", "standard", "hd"),
		oneOf("style", q.Style, "vivid", "natural"),
		oneOf("output_format", q.OutputFormat, "png", "jpeg", "webp"),
		oneOf("background", q.Background, "auto", "opaque", "transparent"),
		oneOf("moderation", q.Moderation, "auto", "low"),
	} {
		if err != nil {
			return err
		}
	}
	if c := q.OutputCompression; c != nil && (*c < 0 || *c > 100) {
		return &engine.FieldError{Field: "output_compression", Msg: fmt.Sprintf("%d: must be in [0,100]", *c)}
	}
	if p := q.PartialImages; p != nil && (*p < 0 || *p > 3) {
		return &engine.FieldError{Field: "partial_images", Msg: fmt.Sprintf("%d: must be in [0,3]", *p)}
	}
	if q.Stream != nil && *q.Stream {
		return &engine.FieldError{Field: "stream", Msg: "streaming is not supported here; follow a job's steps at GET /v1/jobs/{id}/events"}
	}
	return nil
}

// qualitySteps maps quality to a step count from the one the request
// would get: low halves it, high and hd double it (capped), the others keep
// it. ok is false when quality changes nothing.
func qualitySteps(quality, model string, l engine.Limits, modelSteps func(string) int) (int, bool) {
	base := engine.DefaultSpec().Steps
	if model != "" && modelSteps != nil {
		if n := modelSteps(model); n > 0 {
			base = n
		}
	}
	switch quality {
	case "low":
		return max(1, base/2), true
	case "high", "hd":
		return min(2*base, l.MaxSteps), true
	}
	return 0, false
}

// ignored lists the fields of q this server accepts without acting on.
func (q imagesRequest) ignored() map[string]string {
	out := map[string]string{}
	if q.Style != "" {
		out["style"] = q.Style
	}
	if q.Background == "transparent" {
		out["background"] = q.Background // results are opaque
	}
	if q.Moderation != "" {
		out["moderation"] = q.Moderation
	}
	if q.OutputFormat == "webp" || (q.OutputFormat == "jpeg" && q.ResponseFormat == "url") {
		out["output_format"] = q.OutputFormat // served as stored: PNG
	}
	if q.PartialImages != nil {
		out["partial_images"] = fmt.Sprint(*q.PartialImages)
	}
	return out
}

// ignoredFields remembers the fields already warned about, so that a
// client sending style on every request logs one warning, not one each.
type ignoredFields struct {
	mu     sync.Mutex
	warned map[string]bool // guarded by mu
}

// first reports whether field is warned about for the first time.
func (f *ignoredFields) first(field string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.warned[field] {
		return false
	}
	if f.warned == nil {
		f.warned = map[string]bool{}
	}
	f.warned[field] = true
	return true
}

func (s *server) warnIgnored(q imagesRequest) {
	for field, v := range q.ignored() {
		if s.warn.first(field) {
			s.log.Warn("images request field accepted and ignored (logged once per field)",
				zap.String("field", field), zap.String("value", v))
		}
	}
}

// resultURL is the absolute URL of job id's result, as the client reached
// this server: its Host, and https when the request came over TLS or a
// proxy says it did.
func resultURL(r *http.Request, id string) string {
	scheme := "http"
	if r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https") {
		scheme = "https"
	}
	u := url.URL{Scheme: scheme, Host: r.Host, Path: "/v1/jobs/" + id + "/result"}
	return u.String()
}

// formatOf names a content type as output_format does.
func formatOf(contentType string) string {
	switch contentType {
	case engine.ContentTypePNG:
		return "png"
	case engine.ContentTypeGIF:
		return "gif"
	case "image/jpeg":
		return "jpeg"
	}
	return ""
}

// toJPEG re-encodes a PNG result at quality (OpenAI's output_compression;
// nil is 100, its default).
func toJPEG(data []byte, quality *int, l engine.Limits) ([]byte, error) {
	cfg, err := png.DecodeConfig(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	if cfg.Width > l.MaxSide || cfg.Height > l.MaxSide {
		return nil, fmt.Errorf("png %dx%d is larger than %d a side", cfg.Width, cfg.Height, l.MaxSide)
	}
	img, err := png.Decode(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	q := 100
	if quality != nil {
		q = max(1, *quality)
	}
	var buf bytes.Buffer
	if err := jpeg.Encode(&buf, img, &jpeg.Options{Quality: q}); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
