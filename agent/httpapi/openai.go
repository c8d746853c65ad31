package httpapi

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// imagesRequest is OpenAI's images request plus latentmesh extensions.
// Pointers tell an absent field from an explicit zero.
type imagesRequest struct {
	Prompt         string `json:"prompt"`
	N              *int   `json:"n"`
	Size           string `json:"size"`
	ResponseFormat string `json:"response_format"`
	Model          string `json:"model"` // "" or "latentmesh-reference": the built-in engine
	User           string `json:"user"`  // accepted and ignored

	// OpenAI's other fields: applied where they mean something here,
	// otherwise accepted and ignored with one logged warning (openaiExtras).
	Quality           string `json:"quality"`            // low, medium, high, standard, hd, auto: the step count
	Style             string `json:"style"`              // vivid, natural: ignored
	OutputFormat      string `json:"output_format"`      // png; jpeg re-encodes; webp is ignored
	OutputCompression *int   `json:"output_compression"` // 0-100: the JPEG quality
	Background        string `json:"background"`         // auto, opaque; transparent is ignored
	Moderation        string `json:"moderation"`         // low, auto: ignored, nothing is moderated here
	PartialImages     *int   `json:"partial_images"`     // ignored: no streaming here
	Stream            *bool  `json:"stream"`             // true is refused: see /v1/jobs/{id}/events

	NegativePrompt    string   `json:"negative_prompt"`
	NumInferenceSteps *int     `json:"num_inference_steps"`
	GuidanceScale     *float64 `json:"guidance_scale"`
	Seed              *int64   `json:"seed"`
	Priority          string   `json:"priority"`
	TransferMode      string   `json:"transfer_mode"`
	Frames            *int     `json:"frames"`
	DeadlineMS        *int64   `json:"deadline_ms"` // see JobRequest.DeadlineMS
	// Params are the model's own parameters (JobRequest.Params).
	Params engine.Params `json:"params"`
	// Lora names an adapter of the model (JobRequest.Lora).
	Lora string `json:"lora"`
}

// ImagesResponse is the body of a successful POST /v1/images/generations.
type ImagesResponse struct {
	Created      int64        `json:"created"`
	Data         []ImageDatum `json:"data"`
	OutputFormat string       `json:"output_format,omitempty"` // png, jpeg or gif: what data holds
	Quality      string       `json:"quality,omitempty"`       // as asked
	Size         string       `json:"size,omitempty"`          // "WxH"
}

// ImageDatum is one generated image in OpenAI's shape, with the job that
// made it under "latentmesh".
type ImageDatum struct {
	B64JSON       string    `json:"b64_json,omitempty"`
	URL           string    `json:"url,omitempty"` // with response_format url: the job's result
	RevisedPrompt string    `json:"revised_prompt,omitempty"`
	Latentmesh    ImageInfo `json:"latentmesh"`
}

// ImageInfo is the latentmesh extension of an ImageDatum.
type ImageInfo struct {
	JobID       string `json:"job_id"`
	Seed        int64  `json:"seed"`
	ContentType string `json:"content_type"`
}

// specs validates q and returns one spec per requested image, with seeds
// seed, seed+1, ...
func (q imagesRequest) specs(l engine.Limits, maxN int, modelSteps func(string) int) ([]engine.Spec, JobRequest, error) {
	n := 1
	if q.N != nil {
		n = *q.N
	}
	if n < 1 || n > maxN {
		return nil, JobRequest{}, &engine.FieldError{Field: "n", Msg: "must be in [1," + strconv.Itoa(maxN) + "]"}
	}
	switch q.ResponseFormat {
	case "", "b64_json", "url":
	default:
		return nil, JobRequest{}, &engine.FieldError{Field: "response_format", Msg: "must be b64_json or url"}
	}
	if err := q.checkExtras(); err != nil {
		return nil, JobRequest{}, err
	}
	req := JobRequest{
		Model:          q.Model,
		Prompt:         q.Prompt,
		NegativePrompt: q.NegativePrompt,
		Seed:           q.Seed,
		Frames:         q.Frames,
		Steps:          q.NumInferenceSteps,
		GuidanceScale:  q.GuidanceScale,
		Priority:       q.Priority,
		TransferMode:   q.TransferMode,
		DeadlineMS:     q.DeadlineMS,
		Params:         q.Params,
		Lora:           q.Lora,
	}
	if q.Size != "" && q.Size != "auto" {
		w, h, err := parseSize(q.Size)
		if err != nil {
			return nil, JobRequest{}, err
		}
		req.Width, req.Height = &w, &h
	}
	if req.Steps == nil {
		if n, ok := qualitySteps(q.Quality, q.Model, l, modelSteps); ok {
			req.Steps = &n
		}
	}
	spec, _, err := req.spec(l, modelSteps)
	if err != nil {
		var fe *engine.FieldError
		if errors.As(err, &fe) {
			switch fe.Field {
			case "width", "height":
				fe = &engine.FieldError{Field: "size", Msg: fe.Field + " " + fe.Msg}
			case "steps":
				fe = &engine.FieldError{Field: "num_inference_steps", Msg: fe.Msg}
			}
			return nil, JobRequest{}, fe
		}
		return nil, JobRequest{}, err
	}
	specs := make([]engine.Spec, n)
	for i := range specs {
		specs[i] = spec
		specs[i].Seed = spec.Seed + int64(i)
	}
	return specs, req, nil
}

func (s *server) imagesGenerations(w http.ResponseWriter, r *http.Request) {
	var q imagesRequest
	if e := decodeBody(w, r, s.cfg.MaxBodyBytes, &q); e != nil {
		writeError(w, e)
		return
	}
	s.generateImages(w, r, q, nil)
}

// generateImages runs an images request (generations; edits, with img)
// and answers it when its jobs are done.
func (s *server) generateImages(w http.ResponseWriter, r *http.Request, q imagesRequest, img *jobs.ImageUpload) {
	specs, req, err := q.specs(s.limitsFor(q.Model), s.cfg.MaxN, s.cfg.ModelSteps)
	var fe *engine.FieldError
	if errors.As(err, &fe) && fe.Field == "stream" {
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeUnsupportedFormat, "%s", fe.Error())
		e.Param = "stream"
		writeError(w, e)
		return
	}
	if err != nil {
		writeError(w, fieldError(err))
		return
	}
	_, opts, _ := req.spec(s.limitsFor(q.Model), s.cfg.ModelSteps) // validated by specs
	opts.Owner, opts.Image = owner(r), img
	s.warnIgnored(q)

	s.holdOpen(w, s.cfg.SyncTimeout)
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.SyncTimeout)
	defer cancel()

	submitted := make([]jobs.Job, 0, len(specs))
	for _, spec := range specs {
		job, err := s.jobs.Submit(ctx, spec, opts)
		if err != nil {
			s.cancelAll(submitted)
			writeError(w, s.storeError(r, "submit", "", err))
			return
		}
		submitted = append(submitted, job)
	}
	s.log.Info("images request submitted", zap.Int("n", len(submitted)), zap.String("job", submitted[0].ID))

	// Waiting in turn costs no more than waiting in parallel: the answer
	// needs every job, so it takes as long as the slowest.
	out := ImagesResponse{Created: time.Now().Unix(), Data: make([]ImageDatum, 0, len(submitted)),
		Quality: q.Quality, Size: fmt.Sprintf("%dx%d", specs[0].Width, specs[0].Height)}
	for i, job := range submitted {
		done, err := s.jobs.Wait(ctx, job.ID)
		if err != nil {
			if r.Context().Err() != nil {
				return // the client left; the jobs stay, fetchable by id
			}
			if errors.Is(err, context.DeadlineExceeded) {
				writeError(w, apiErr(http.StatusGatewayTimeout, typeServer, CodeTimeout,
					"jobs did not finish within %v; they keep running: poll GET /v1/jobs/{id} for %s",
					s.cfg.SyncTimeout, strings.Join(ids(submitted[i:]), ", ")))
				return
			}
			writeError(w, s.storeError(r, "wait", job.ID, err))
			return
		}
		if done.State != jobs.Succeeded {
			s.cancelAll(submitted[i+1:])
			e := notSucceeded(done)
			if done.State == jobs.Failed {
				e.Status = http.StatusBadGateway
			}
			writeError(w, e)
			return
		}
		info := ImageInfo{JobID: job.ID, Seed: specs[i].Seed}
		if q.ResponseFormat == "url" {
			// The result is hosted already; nothing to fetch here.
			if done.Result != nil {
				info.ContentType = done.Result.ContentType
			}
			out.Data = append(out.Data, ImageDatum{URL: resultURL(r, job.ID), Latentmesh: info})
			out.OutputFormat = formatOf(info.ContentType)
			continue
		}
		data, ct, err := s.jobs.Result(ctx, job.ID)
		if err != nil {
			writeError(w, s.storeError(r, "result", job.ID, err))
			return
		}
		if q.OutputFormat == "jpeg" && ct == engine.ContentTypePNG {
			if data, err = toJPEG(data, q.OutputCompression, s.limitsFor(q.Model)); err != nil {
				s.log.Error("jpeg conversion", zap.String("job", job.ID), zap.Error(err))
				writeError(w, apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "converting job %s's image to JPEG failed", job.ID))
				return
			}
			ct = "image/jpeg"
		}
		info.ContentType = ct
		out.OutputFormat = formatOf(ct)
		out.Data = append(out.Data, ImageDatum{B64JSON: base64.StdEncoding.EncodeToString(data), Latentmesh: info})
	}
	writeJSON(w, http.StatusOK, out)
}

// cancelAll withdraws jobs whose request is being answered with an error,
// so that they stop holding mesh capacity. Best effort: a job that
// finished meanwhile is left as it is.
func (s *server) cancelAll(js []jobs.Job) {
	if len(js) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, j := range js {
		if _, err := s.jobs.Cancel(ctx, j.ID); err != nil && !errors.Is(err, jobs.ErrFinished) {
			s.log.Warn("cancel after failed request", zap.String("job", j.ID), zap.Error(err))
		}
	}
}

func ids(js []jobs.Job) []string {
	out := make([]string, len(js))
	for i, j := range js {
		out[i] = j.ID
	}
	return out
}
