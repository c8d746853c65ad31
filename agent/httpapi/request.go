package httpapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// JobRequest is the body of POST /v1/jobs, shared by the server and Client.
// A nil pointer means "use the engine default" (engine.DefaultSpec); a nil
// Seed means "pick one at random", and the chosen seed is in the returned
// Job's spec. An explicit value is validated as given, so "steps": 0 is an
// error rather than a request for the default.
type JobRequest struct {
	// Model names the model to run; "" is the built-in engine's
	// (engine.DefaultModel). Agents advertise the models they serve.
	Model          string   `json:"model,omitempty"`
	Prompt         string   `json:"prompt"`
	NegativePrompt string   `json:"negative_prompt,omitempty"`
	Seed           *int64   `json:"seed,omitempty"`
	Width          *int     `json:"width,omitempty"`
	Height         *int     `json:"height,omitempty"`
	Frames         *int     `json:"frames,omitempty"`
	Steps          *int     `json:"steps,omitempty"`
	GuidanceScale  *float64 `json:"guidance_scale,omitempty"`
	Priority       string   `json:"priority,omitempty"` // interactive, standard (default) or batch
	// TransferMode overrides how this job's payloads move between stages:
	// p2p, store or auto ("" keeps the agents' default).
	TransferMode string `json:"transfer_mode,omitempty"`
	// DeadlineMS is when the caller wants the result, in milliseconds from
	// submission: within its priority class the earliest deadline is served
	// first. A missed deadline does not cancel the job.
	DeadlineMS *int64 `json:"deadline_ms,omitempty"`
	// CheckpointEvery is the denoise steps between step checkpoints, which
	// a retried denoise resumes from (0: none; absent: the model's or the
	// agent's default).
	CheckpointEvery *int `json:"checkpoint_every,omitempty"`
	// KeepCheckpoints keeps the checkpoints that long (a Go duration such
	// as "1h"), for forks (POST /v1/jobs/{id}/fork); otherwise they are
	// released when the denoise finishes.
	KeepCheckpoints string `json:"keep_checkpoints,omitempty"`
	// Params are the model's own parameters (its engine registers their
	// schema: names, types, ranges, defaults); those left out get their
	// defaults, and the job's spec holds them all.
	Params engine.Params `json:"params,omitempty"`
	// Image is a reference image (image-to-video, edits) for a model
	// that takes one: a PNG or JPEG file, base64 or a data: URL.
	Image string `json:"image,omitempty"`
	// Lora names an adapter of the model (a LoRA-like weight delta of its
	// denoiser, 1-32 bytes of letters, digits and . _ -) that an engine of
	// the mesh has loaded: the denoise runs on a worker that has it, and a
	// name no agent has loaded is refused (400 "lora").
	Lora string `json:"lora,omitempty"`
}

// MaxDeadline bounds deadline_ms: a day, longer than any job should queue.
const MaxDeadline = 24 * time.Hour

// spec turns r into a validated engine spec and scheduling options. Errors
// are *engine.FieldError.
func (r JobRequest) spec(l engine.Limits, modelSteps func(string) int) (engine.Spec, jobs.Options, error) {
	s := engine.DefaultSpec()
	s.Model = r.Model
	s.Prompt = r.Prompt
	s.NegativePrompt = r.NegativePrompt
	s.Params = r.Params
	s.Adapter = r.Lora
	s.Seed = randomSeed()
	if r.Steps == nil && r.Model != "" && modelSteps != nil {
		if n := modelSteps(r.Model); n > 0 {
			s.Steps = n // the model's own default, as its engine registered it
		}
	}
	setIf(&s.Seed, r.Seed)
	setIf(&s.Width, r.Width)
	setIf(&s.Height, r.Height)
	setIf(&s.Frames, r.Frames)
	setIf(&s.Steps, r.Steps)
	setIf(&s.GuidanceScale, r.GuidanceScale)
	class, err := parseClass(r.Priority)
	if err != nil {
		return engine.Spec{}, jobs.Options{}, err
	}
	mode, err := jobs.ParseTransferMode(r.TransferMode)
	if err != nil {
		return engine.Spec{}, jobs.Options{}, &engine.FieldError{Field: "transfer_mode", Msg: fmt.Sprintf("%q: must be p2p, store or auto", r.TransferMode)}
	}
	opts := jobs.Options{Class: class, Transfer: mode}
	if r.DeadlineMS != nil {
		ms := *r.DeadlineMS
		if ms < 1 || ms > MaxDeadline.Milliseconds() {
			return engine.Spec{}, jobs.Options{}, &engine.FieldError{Field: "deadline_ms", Msg: fmt.Sprintf("must be in [1,%d]", MaxDeadline.Milliseconds())}
		}
		opts.Deadline = time.Now().Add(time.Duration(ms) * time.Millisecond).UTC()
	}
	if opts.Checkpointing, err = checkpointing(r.CheckpointEvery, r.KeepCheckpoints, s.Steps); err != nil {
		return engine.Spec{}, jobs.Options{}, err
	}
	if err := s.Validate(l); err != nil {
		return engine.Spec{}, jobs.Options{}, err
	}
	return s, opts, nil
}

// checkpointing reads a request's checkpoint fields (nil when it has none).
func checkpointing(every *int, keep string, steps int) (*jobs.Checkpointing, error) {
	if every == nil && keep == "" {
		return nil, nil
	}
	c := &jobs.Checkpointing{Every: every}
	if keep != "" {
		d, err := time.ParseDuration(keep)
		if err != nil || d <= 0 || d > jobs.MaxCheckpointKeep {
			return nil, &engine.FieldError{Field: "keep_checkpoints", Msg: fmt.Sprintf("%q: want a duration such as \"1h\", at most %s", keep, jobs.MaxCheckpointKeep)}
		}
		c.Keep = d
	}
	if every != nil && (*every < 0 || *every != 0 && *every >= steps) {
		return nil, &engine.FieldError{Field: "checkpoint_every", Msg: fmt.Sprintf("%d: want 0 (none) or 1 to %d (fewer than the steps)", *every, steps-1)}
	}
	return c, nil
}

func setIf[T any](dst *T, v *T) {
	if v != nil {
		*dst = *v
	}
}

// randomSeed stays below 2^53 so that the seed survives a round trip
// through JavaScript clients, which read JSON numbers as doubles.
func randomSeed() int64 { return rand.Int64N(1 << 53) }

func parseClass(s string) (routing.Class, error) {
	c, err := routing.ParseClass(s)
	if err != nil {
		return 0, &engine.FieldError{Field: "priority", Msg: fmt.Sprintf("%q: must be interactive, standard or batch", s)}
	}
	return c, nil
}

// parseSize reads "WxH" as OpenAI writes it ("1024x1024"). Only decimal
// digits are accepted: no signs, spaces or exponents.
func parseSize(s string) (w, h int, err error) {
	ws, hs, ok := strings.Cut(s, "x")
	if !ok || !allDigits(ws) || !allDigits(hs) || len(ws) > 6 || len(hs) > 6 {
		return 0, 0, &engine.FieldError{Field: "size", Msg: fmt.Sprintf("%q: want WIDTHxHEIGHT, e.g. 512x512", s)}
	}
	w, _ = strconv.Atoi(ws)
	h, _ = strconv.Atoi(hs)
	return w, h, nil
}

func allDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// fieldError maps a validation failure to a 400 naming the field.
func fieldError(err error) *APIError {
	var fe *engine.FieldError
	if !errors.As(err, &fe) {
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "%v", err)
	}
	e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+fe.Field, "%s", fe.Error())
	e.Param = fe.Field
	return e
}

// decodeBody reads exactly one JSON object of at most max bytes from r
// into dst, rejecting unknown fields and trailing data.
func decodeBody(w http.ResponseWriter, r *http.Request, max int64, dst any) *APIError {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || !(mt == "application/json" || strings.HasSuffix(mt, "+json")) {
			return apiErr(http.StatusUnsupportedMediaType, typeInvalidRequest, CodeUnsupportedMedia,
				"Content-Type %q is not supported; send application/json", ct)
		}
	}
	if r.ContentLength > max {
		return tooLarge(max)
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, max))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return decodeError(err, max)
	}
	if _, err := dec.Token(); err != io.EOF {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return tooLarge(max)
		}
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "unexpected data after the JSON object")
	}
	return nil
}

func tooLarge(max int64) *APIError {
	return apiErr(http.StatusRequestEntityTooLarge, typeInvalidRequest, CodeBodyTooLarge,
		"request body is larger than %d bytes", max)
}

func decodeError(err error, max int64) *APIError {
	var (
		mbe *http.MaxBytesError
		se  *json.SyntaxError
		ute *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &mbe):
		return tooLarge(max)
	case errors.Is(err, io.EOF):
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "request body is empty; want a JSON object")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "request body is truncated JSON")
	case errors.As(err, &se):
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "malformed JSON at byte %d: %v", se.Offset, se)
	case errors.As(err, &ute):
		field := ute.Field
		if field == "" {
			e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidType, "request body must be a JSON object, not %s", ute.Value)
			return e
		}
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidType, "%s: got JSON %s, want %s", field, ute.Value, jsonKind(ute.Type.String()))
		e.Param = field
		return e
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		// encoding/json has no typed error for this; the message is stable.
		name, _ := strconv.Unquote(strings.TrimPrefix(err.Error(), "json: unknown field "))
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeUnknownField, "unknown field %q", name)
		e.Param = name
		return e
	default:
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "malformed JSON: %v", err)
	}
}

// jsonKind names a Go type the way a JSON client thinks of it.
func jsonKind(goType string) string {
	t := strings.TrimLeft(goType, "*")
	switch {
	case t == "string":
		return "a string"
	case strings.HasPrefix(t, "int") || strings.HasPrefix(t, "uint"):
		return "an integer"
	case strings.HasPrefix(t, "float"):
		return "a number"
	case t == "bool":
		return "a boolean"
	default:
		return "a " + t
	}
}
