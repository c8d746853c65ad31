package httpapi

// This file is OpenAI's videos API (/v1/videos) over latentmesh jobs: a
// video is a job of more than one frame, and its id is the job's, so the
// native API (/v1/jobs/{id}, its events and frames) works on it too.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/agent/videoenc"
)

// VideoFrameRate is the frame rate of every video: OpenAI's seconds map
// to round(seconds × VideoFrameRate) frames (4 s: 50 frames), and MP4s play
// at it. It is the built-in engine's GIF rate (8 centiseconds a frame), so
// a GIF and the MP4 made from it last the same.
const VideoFrameRate = 12.5

// JobLister is implemented by a Jobs that can list jobs in creation order.
// It is optional: without it GET /v1/videos answers 501.
type JobLister interface {
	// ListJobs returns a page of jobs and whether more may follow
	// (jobs.Store.List).
	ListJobs(ctx context.Context, q jobs.ListQuery) ([]jobs.Job, bool, error)
}

// Video is OpenAI's video object, with latentmesh's details under
// "latentmesh".
type Video struct {
	ID                 string      `json:"id"`
	Object             string      `json:"object"` // "video"
	Model              string      `json:"model"`
	Status             string      `json:"status"`   // queued, in_progress, completed, failed
	Progress           int         `json:"progress"` // 0-100
	CreatedAt          int64       `json:"created_at"`
	CompletedAt        *int64      `json:"completed_at"`
	ExpiresAt          *int64      `json:"expires_at"`
	Prompt             string      `json:"prompt"`
	Size               string      `json:"size"`    // "WxH"
	Seconds            string      `json:"seconds"` // frames / VideoFrameRate
	RemixedFromVideoID *string     `json:"remixed_from_video_id"`
	Error              *VideoError `json:"error"`
	Latentmesh         VideoInfo   `json:"latentmesh"`
}

// VideoError says why a video failed.
type VideoError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// VideoInfo is the latentmesh extension of a Video: the job behind it and
// what GET /v1/videos/{id}/content serves from this agent.
type VideoInfo struct {
	State       jobs.State `json:"state"`           // the job's own state
	Stage       jobs.Stage `json:"stage,omitempty"` // the stage queued or running
	Frames      int        `json:"frames"`
	FrameRate   float64    `json:"frame_rate"`
	Seed        int64      `json:"seed"`
	Format      string     `json:"format"`       // mp4, or gif where this agent has no ffmpeg
	ContentType string     `json:"content_type"` // video/mp4 or image/gif
}

// VideoList is OpenAI's list shape for GET /v1/videos.
type VideoList struct {
	Object  string  `json:"object"` // "list"
	Data    []Video `json:"data"`
	FirstID *string `json:"first_id"`
	LastID  *string `json:"last_id"`
	HasMore bool    `json:"has_more"`
}

// videoDeleted answers DELETE /v1/videos/{id}.
type videoDeleted struct {
	ID      string `json:"id"`
	Object  string `json:"object"` // "video.deleted"
	Deleted bool   `json:"deleted"`
}

// videoRequest is OpenAI's create-video body plus latentmesh extensions,
// read from JSON or from form fields (the official clients send
// multipart/form-data).
type videoRequest struct {
	Prompt         string          `json:"prompt"`
	Model          string          `json:"model"`
	Seconds        flexString      `json:"seconds"` // "4", or 4
	Size           string          `json:"size"`
	InputReference json.RawMessage `json:"input_reference"`
	User           string          `json:"user"` // accepted and ignored

	NegativePrompt    string   `json:"negative_prompt"`
	NumInferenceSteps *int     `json:"num_inference_steps"`
	GuidanceScale     *float64 `json:"guidance_scale"`
	Seed              *int64   `json:"seed"`
	Priority          string   `json:"priority"`
	TransferMode      string   `json:"transfer_mode"`
	DeadlineMS        *int64   `json:"deadline_ms"`
}

// flexString is a JSON string or number, kept as its text.
type flexString string

func (f *flexString) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*f = flexString(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return &json.UnmarshalTypeError{Value: string(b), Type: reflect.TypeOf("")}
	}
	*f = flexString(n.String())
	return nil
}

// setField sets one form field. Unknown names are an error, as in JSON.
func (q *videoRequest) setField(name, v string) *APIError {
	badNum := func(want string) *APIError {
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidType, "%s: %q is not %s", name, v, want)
		e.Param = name
		return e
	}
	switch name {
	case "prompt":
		q.Prompt = v
	case "model":
		q.Model = v
	case "seconds":
		q.Seconds = flexString(v)
	case "size":
		q.Size = v
	case "user":
		q.User = v
	case "negative_prompt":
		q.NegativePrompt = v
	case "priority":
		q.Priority = v
	case "transfer_mode":
		q.TransferMode = v
	case "num_inference_steps":
		n, err := strconv.Atoi(v)
		if err != nil {
			return badNum("an integer")
		}
		q.NumInferenceSteps = &n
	case "seed":
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return badNum("an integer")
		}
		q.Seed = &n
	case "deadline_ms":
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return badNum("an integer")
		}
		q.DeadlineMS = &n
	case "guidance_scale":
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return badNum("a number")
		}
		q.GuidanceScale = &f
	case "input_reference":
		return errInputReference()
	default:
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, CodeUnknownField, "unknown field %q", name)
		e.Param = name
		return e
	}
	return nil
}

func errInputReference() *APIError {
	e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"input_reference",
		"input_reference: image inputs are not supported by this mesh's engines yet; send a prompt only")
	e.Param = "input_reference"
	return e
}

// decodeVideoRequest reads a create body: JSON, multipart/form-data or a
// URL-encoded form, at most max bytes.
func decodeVideoRequest(w http.ResponseWriter, r *http.Request, max int64) (videoRequest, *APIError) {
	var q videoRequest
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch mt {
	case "multipart/form-data", "application/x-www-form-urlencoded":
	default:
		if e := decodeBody(w, r, max, &q); e != nil {
			return q, e
		}
		if len(q.InputReference) > 0 && string(q.InputReference) != "null" {
			return q, errInputReference()
		}
		return q, nil
	}
	if r.ContentLength > max {
		return q, tooLarge(max)
	}
	body := http.MaxBytesReader(w, r.Body, max)
	readErr := func(err error) *APIError {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return tooLarge(max)
		}
		return apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "malformed %s body: %v", mt, err)
	}
	if mt == "application/x-www-form-urlencoded" {
		b, err := io.ReadAll(body)
		if err != nil {
			return q, readErr(err)
		}
		vals, err := url.ParseQuery(string(b))
		if err != nil {
			return q, readErr(err)
		}
		for k, vs := range vals {
			if e := q.setField(k, vs[len(vs)-1]); e != nil {
				return q, e
			}
		}
		return q, nil
	}
	if params["boundary"] == "" {
		return q, apiErr(http.StatusBadRequest, typeInvalidRequest, CodeInvalidJSON, "multipart/form-data without a boundary")
	}
	// Parts are read one by one into memory, never to temporary files:
	// the whole body is bounded by max.
	r.Body = body
	mr, err := r.MultipartReader()
	if err != nil {
		return q, readErr(err)
	}
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			return q, nil
		}
		if err != nil {
			return q, readErr(err)
		}
		name := p.FormName()
		if name == "input_reference" || p.FileName() != "" {
			return q, errInputReference()
		}
		v, err := io.ReadAll(p)
		if err != nil {
			return q, readErr(err)
		}
		if e := q.setField(name, string(v)); e != nil {
			return q, e
		}
	}
}

// framesFor maps OpenAI's seconds ("" is OpenAI's default, 4) to frames.
func framesFor(seconds string, l engine.Limits) (int, error) {
	if seconds == "" {
		seconds = "4"
	}
	maxSec := strconv.FormatFloat(float64(l.MaxFrames)/VideoFrameRate, 'f', -1, 64)
	sec, err := strconv.ParseFloat(seconds, 64)
	if err != nil || math.IsNaN(sec) || math.IsInf(sec, 0) {
		return 0, &engine.FieldError{Field: "seconds", Msg: fmt.Sprintf("%q: want a number of seconds such as \"4\"", seconds)}
	}
	frames := int(math.Round(sec * VideoFrameRate))
	if frames < 2 || frames > l.MaxFrames {
		return 0, &engine.FieldError{Field: "seconds", Msg: fmt.Sprintf("%s: is %d frames at %v frames a second; this server makes videos of 2 to %d frames (%.2f to %s seconds)",
			seconds, frames, VideoFrameRate, l.MaxFrames, 2/VideoFrameRate, maxSec)}
	}
	return frames, nil
}

// videoSizes are common shapes offered in the error for a size the engine
// cannot make; those that fit the limits at the asked length are named.
var videoSizes = [][2]int{{128, 128}, {256, 256}, {256, 144}, {144, 256}, {384, 216}, {216, 384}, {512, 288}, {288, 512}, {512, 512}, {1024, 576}, {576, 1024}}

// sizeError is the 400 for a size the engine cannot make at frames frames.
func sizeError(size string, frames int, l engine.Limits, cause string) *APIError {
	var fit []string
	for _, s := range videoSizes {
		if (engine.Spec{Prompt: "x", Width: s[0], Height: s[1], Frames: frames, Steps: 1}).Validate(l) == nil {
			fit = append(fit, fmt.Sprintf("%dx%d", s[0], s[1]))
		}
	}
	e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"size",
		"size %q is not supported (%s): this server makes sides that are multiples of 8 in [%d,%d], with width x height x frames at most %d; at %d frames (%s seconds) that includes %s",
		size, cause, l.MinSide, l.MaxSide, l.MaxPixels, frames, secondsOf(frames), strings.Join(fit, ", "))
	e.Param = "size"
	return e
}

func secondsOf(frames int) string {
	return strconv.FormatFloat(float64(frames)/VideoFrameRate, 'f', -1, 64)
}

func (s *server) createVideo(w http.ResponseWriter, r *http.Request) {
	q, e := decodeVideoRequest(w, r, s.cfg.MaxBodyBytes)
	if e != nil {
		writeError(w, e)
		return
	}
	limits := s.limitsFor(q.Model) // the model's engine's, or the server's own
	frames, err := framesFor(string(q.Seconds), limits)
	if err != nil {
		writeError(w, fieldError(err))
		return
	}
	req := JobRequest{
		Model: q.Model, Prompt: q.Prompt, NegativePrompt: q.NegativePrompt, Seed: q.Seed, Frames: &frames,
		Steps: q.NumInferenceSteps, GuidanceScale: q.GuidanceScale, Priority: q.Priority,
		TransferMode: q.TransferMode, DeadlineMS: q.DeadlineMS,
	}
	if q.Size != "" {
		wd, ht, err := parseSize(q.Size)
		if err != nil {
			writeError(w, fieldError(err))
			return
		}
		req.Width, req.Height = &wd, &ht
	}
	spec, opts, err := req.spec(limits, s.cfg.ModelSteps)
	var fe *engine.FieldError
	if errors.As(err, &fe) {
		switch fe.Field {
		case "width", "height":
			writeError(w, sizeError(q.Size, frames, limits, fe.Field+" "+fe.Msg))
			return
		case "frames": // too many pixels for the length
			size := q.Size
			if size == "" {
				d := engine.DefaultSpec()
				size = fmt.Sprintf("%dx%d", d.Width, d.Height)
			}
			writeError(w, sizeError(size, frames, limits, fe.Msg))
			return
		case "steps":
			err = &engine.FieldError{Field: "num_inference_steps", Msg: fe.Msg}
		}
	}
	if err != nil {
		writeError(w, fieldError(err))
		return
	}
	job, ok := s.submit(w, r, spec, opts)
	if !ok {
		return
	}
	s.log.Info("video submitted", zap.String("job", job.ID), zap.Int("frames", frames))
	w.Header().Set("Location", "/v1/videos/"+url.PathEscape(job.ID))
	writeJSON(w, http.StatusOK, s.video(job))
}

// videoJob reads the video {id} names: 404 for a job that is not a video
// or not the caller's.
func (s *server) videoJob(w http.ResponseWriter, r *http.Request) (jobs.Job, bool) {
	id := r.PathValue("id")
	notFound := apiErr(http.StatusNotFound, typeNotFound, CodeJobNotFound, "no video %q", id)
	if !validID(id) {
		writeError(w, notFound)
		return jobs.Job{}, false
	}
	job, err := s.jobs.Get(r.Context(), id)
	if err != nil {
		e := s.storeError(r, "get", id, err)
		if e.Code == CodeJobNotFound {
			e = notFound
		}
		writeError(w, e)
		return jobs.Job{}, false
	}
	if job.Spec.Frames < 2 || !mayAccess(r, job) {
		writeError(w, notFound)
		return jobs.Job{}, false
	}
	return job, true
}

func (s *server) getVideo(w http.ResponseWriter, r *http.Request) {
	if job, ok := s.videoJob(w, r); ok {
		writeJSON(w, http.StatusOK, s.video(job))
	}
}

func (s *server) listVideos(w http.ResponseWriter, r *http.Request) {
	jl, ok := s.jobs.(JobLister)
	if !ok {
		writeError(w, apiErr(http.StatusNotImplemented, typeServer, CodeUnavailable, "this server cannot list videos"))
		return
	}
	qv := r.URL.Query()
	q := jobs.ListQuery{After: qv.Get("after"), Limit: 20, Newest: true}
	if v := qv.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > jobs.MaxListLimit {
			e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"limit", "limit: %q: want an integer in [1,%d]", v, jobs.MaxListLimit)
			e.Param = "limit"
			writeError(w, e)
			return
		}
		q.Limit = n
	}
	switch qv.Get("order") {
	case "", "desc":
	case "asc":
		q.Newest = false
	default:
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"order", "order: %q: want asc or desc", qv.Get("order"))
		e.Param = "order"
		writeError(w, e)
		return
	}
	q.Match = func(j jobs.Job) bool { return j.Spec.Frames > 1 && mayAccess(r, j) }
	page, more, err := jl.ListJobs(r.Context(), q)
	if errors.Is(err, jobs.ErrNotFound) {
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"after", "after: no video %q to list after", q.After)
		e.Param = "after"
		writeError(w, e)
		return
	}
	if err != nil {
		writeError(w, s.storeError(r, "list", "", err))
		return
	}
	s.refresh(r.Context(), page)
	out := VideoList{Object: "list", Data: make([]Video, len(page)), HasMore: more}
	for i, j := range page {
		out.Data[i] = s.video(j)
	}
	if n := len(page); n > 0 {
		out.FirstID, out.LastID = &page[0].ID, &page[n-1].ID
	}
	writeJSON(w, http.StatusOK, out)
}

// refresh reads the listed jobs that are not finished again through Get,
// which adds the running stage and its live step (a listed record has
// neither), a few at a time. A job that cannot be read is shown as listed.
func (s *server) refresh(ctx context.Context, page []jobs.Job) {
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for i := range page {
		if page[i].State.Terminal() {
			continue
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if j, err := s.jobs.Get(ctx, page[i].ID); err == nil {
				page[i] = j
			}
		})
	}
	wg.Wait()
}

func (s *server) deleteVideo(w http.ResponseWriter, r *http.Request) {
	job, ok := s.videoJob(w, r)
	if !ok {
		return
	}
	// A video still being made is cancelled first, so that it stops
	// holding the mesh, then deleted with whatever it left.
	if !job.State.Terminal() {
		if _, err := s.jobs.Cancel(r.Context(), job.ID); err != nil && !errors.Is(err, jobs.ErrFinished) {
			writeError(w, s.storeError(r, "cancel", job.ID, err))
			return
		}
	}
	if err := s.jobs.Delete(r.Context(), job.ID); err != nil {
		writeError(w, s.storeError(r, "delete", job.ID, err))
		return
	}
	s.log.Info("video deleted", zap.String("job", job.ID), zap.String("state", string(job.State)))
	writeJSON(w, http.StatusOK, videoDeleted{ID: job.ID, Object: "video.deleted", Deleted: true})
}

func (s *server) videoContent(w http.ResponseWriter, r *http.Request) {
	variant := r.URL.Query().Get("variant")
	switch variant {
	case "", "video", "thumbnail":
	default:
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"variant", "variant %q is not supported: want video or thumbnail", variant)
		e.Param = "variant"
		writeError(w, e)
		return
	}
	job, ok := s.videoJob(w, r)
	if !ok {
		return
	}
	if job.State != jobs.Succeeded {
		writeError(w, notSucceeded(job))
		return
	}
	data, ct, err := s.jobs.Result(r.Context(), job.ID)
	if err != nil {
		writeError(w, s.storeError(r, "result", job.ID, err))
		return
	}
	ext := "gif"
	if ct == engine.ContentTypeGIF && (variant == "thumbnail" || s.enc != nil) {
		s.holdOpen(w, videoenc.DefaultConfig().Timeout)
		data, ct, ext, err = s.convert(r.Context(), data, s.limitsFor(job.Spec.Model), variant == "thumbnail")
		if err != nil {
			s.log.Error("video conversion", zap.String("job", job.ID), zap.String("variant", variant), zap.Error(err))
			writeError(w, apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "converting video %s failed; its GIF is at /v1/jobs/%s/result", job.ID, job.ID))
			return
		}
	}
	h := w.Header()
	h.Set("Content-Type", ct)
	h.Set("Content-Length", strconv.Itoa(len(data)))
	h.Set("Content-Disposition", fmt.Sprintf("inline; filename=%q", job.ID+"."+ext))
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "private, max-age=31536000, immutable") // a finished video never changes
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(data)
	}
}

// convert makes the MP4 (or the PNG thumbnail) of a committed GIF.
func (s *server) convert(ctx context.Context, gifData []byte, l engine.Limits, thumbnail bool) (data []byte, contentType, ext string, err error) {
	frames, err := videoenc.Frames(gifData, videoenc.Bounds{MaxSide: l.MaxSide, MaxFrames: l.MaxFrames, MaxPixels: l.MaxPixels})
	if err != nil {
		return nil, "", "", err
	}
	if thumbnail {
		b, err := videoenc.Thumbnail(frames)
		return b, videoenc.ContentTypePNG, "png", err
	}
	b, err := s.enc.MP4(ctx, frames, VideoFrameRate)
	return b, videoenc.ContentTypeMP4, "mp4", err
}

// video is job in OpenAI's shape.
func (s *server) video(j jobs.Job) Video {
	v := Video{
		ID: j.ID, Object: "video", Model: j.Spec.ModelName(), Status: videoStatus(j.State), Progress: videoProgress(j),
		CreatedAt: j.CreatedAt.Unix(), Prompt: j.Spec.Prompt, Size: fmt.Sprintf("%dx%d", j.Spec.Width, j.Spec.Height),
		Seconds: secondsOf(j.Spec.Frames),
		Latentmesh: VideoInfo{State: j.State, Stage: j.Stage, Frames: j.Spec.Frames, FrameRate: VideoFrameRate, Seed: j.Spec.Seed,
			Format: "gif", ContentType: engine.ContentTypeGIF},
	}
	if s.enc != nil {
		v.Latentmesh.Format, v.Latentmesh.ContentType = "mp4", videoenc.ContentTypeMP4
	}
	if j.State.Terminal() {
		v.CompletedAt = unixPtr(j.UpdatedAt)
	}
	if j.Result != nil && !j.Result.ExpiresAt.IsZero() {
		v.ExpiresAt = unixPtr(j.Result.ExpiresAt)
	}
	switch {
	case j.State == jobs.Cancelled:
		v.Error = &VideoError{Code: CodeCancelled, Message: "the video was cancelled"}
	case j.State == jobs.Failed && j.Error != nil:
		v.Error = &VideoError{Code: j.Error.Code, Message: j.Error.Message}
	case j.State == jobs.Failed:
		v.Error = &VideoError{Code: CodeJobFailed, Message: "the video failed"}
	}
	return v
}

func unixPtr(t time.Time) *int64 {
	u := t.Unix()
	return &u
}

func videoStatus(st jobs.State) string {
	switch st {
	case jobs.Queued:
		return "queued"
	case jobs.Running:
		return "in_progress"
	case jobs.Succeeded:
		return "completed"
	}
	return "failed" // failed and cancelled: OpenAI has no cancelled
}

// videoProgress is how far a job is, 0-100: encode is its first 5, the
// denoise steps the next 85 (from the running node's live step), decode
// the last 10.
func videoProgress(j jobs.Job) int {
	switch {
	case j.State == jobs.Succeeded:
		return 100
	case j.State == jobs.Queued && len(j.Stages) == 0:
		return 0
	}
	stage := j.Stage
	if j.Progress != nil {
		stage = j.Progress.Stage
	}
	switch stage {
	case jobs.Encode:
		return 0
	case jobs.Denoise:
		if p := j.Progress; p != nil && p.Stage == jobs.Denoise && p.Total > 0 {
			return 5 + 85*min(p.Step, p.Total)/p.Total
		}
		return 5
	case jobs.Decode:
		return 90
	}
	// Terminal without success: as far as its committed stages went.
	switch {
	case j.Stages[jobs.Denoise] != nil:
		return 90
	case j.Stages[jobs.Encode] != nil:
		return 5
	}
	return 0
}
