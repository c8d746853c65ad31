package httpapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/agent/videoenc"
	"github.com/latentmesh/latentmesh/cache"
)

// Jobs is what the client API needs from the agent's job store.
type Jobs interface {
	// Submit stores a new job for an already validated spec. The job is
	// durable once Submit returns. It refuses with jobs.ErrStoreFull or
	// jobs.ErrNoSpace when the mesh cannot take more work.
	Submit(ctx context.Context, spec engine.Spec, opts jobs.Options) (jobs.Job, error)
	// Get returns the job, or jobs.ErrNotFound.
	Get(ctx context.Context, id string) (jobs.Job, error)
	// Wait blocks until the job's state is terminal or ctx is done.
	Wait(ctx context.Context, id string) (jobs.Job, error)
	// Result returns the output file, jobs.ErrNotFound, jobs.ErrNotReady
	// when the job has not succeeded, or jobs.ErrExpired when its
	// retention passed.
	Result(ctx context.Context, id string) (data []byte, contentType string, err error)
	// Cancel stops the job, or returns jobs.ErrNotFound or jobs.ErrFinished.
	Cancel(ctx context.Context, id string) (jobs.Job, error)
	// Delete removes a finished job and its result, or returns
	// jobs.ErrNotFound or jobs.ErrNotFinished.
	Delete(ctx context.Context, id string) error
	// ForkPoint returns job id and its checkpoint after step, what a fork
	// from that step starts from; jobs.ErrNotFound or jobs.ErrNoCheckpoint.
	ForkPoint(ctx context.Context, id string, step int) (jobs.Job, jobs.ForkFrom, error)
}

// Config configures the client API handler.
type Config struct {
	Limits engine.Limits // what one job may ask for
	// ModelSteps, if set, is a model's default step count (0: none), for a
	// request that names a model and no steps; otherwise the built-in
	// default applies.
	ModelSteps func(model string) int
	// ModelLimits, if set, returns the limits an external engine
	// registered for a model (ok false: none), which a request naming the
	// model is checked against instead of Limits.
	ModelLimits  func(model string) (l engine.Limits, ok bool)
	MaxN         int           // images per /v1/images/generations request
	MaxBodyBytes int64         // request bodies larger than this get 413
	SyncTimeout  time.Duration // how long /v1/images/generations waits for its jobs
	MaxWait      time.Duration // cap on GET /v1/jobs/{id}?wait=
	Server       ServerConfig  // timeouts and the in-flight cap of the server carrying the handler
	// Tokens, when set, makes every request need a bearer token; a job is
	// then visible only to the token that created it and admin tokens.
	Tokens *Tokens
	// RatePerToken and RateBurst bound each token's requests (a token
	// bucket); 0 means no limit. Only with Tokens.
	RatePerToken float64
	RateBurst    int
	Logger       *zap.Logger
	Metrics      *Metrics // optional: counts requests by route and status
	// FFmpeg is the ffmpeg that makes /v1/videos' MP4s: a path, or a name
	// looked up in $PATH ("" is "ffmpeg"); "none", or none found, serves
	// the engine's GIF instead.
	FFmpeg string
	// StreamKeepAlive is how often an idle event stream sends a comment, so
	// that proxies and clients see it alive while a job waits.
	StreamKeepAlive time.Duration
	// MaxImageBytes bounds a reference image's file (POST /v1/jobs'
	// "image", /v1/images/edits), by which such a body may exceed
	// MaxBodyBytes; MaxUploads bounds the bodies that large read at once.
	MaxImageBytes int64
	MaxUploads    int
}

// DefaultConfig returns a Config with every field set.
func DefaultConfig() Config {
	return Config{
		Limits:       engine.DefaultLimits(),
		MaxN:         4,                // four images is a page of results; more is a batch job
		MaxBodyBytes: 64 << 10,         // two 2000-byte prompts and numbers fit many times over
		SyncTimeout:  10 * time.Minute, // a CPU-only mesh can take minutes per image
		MaxWait:      time.Minute,      // below common proxy idle timeouts
		Server:       DefaultServerConfig(),
		RatePerToken: 20, // a client polling a few jobs; a runaway script is slowed, not the mesh
		RateBurst:    40, // a page of submissions and their first polls at once
		Logger:       zap.NewNop(),
		FFmpeg:       "ffmpeg", // Debian's, on $PATH
		// Below the 30 s idle timeouts of common proxies and of WriteTimeout.
		StreamKeepAlive: 15 * time.Second,
		// A 2048x2048 PNG of a photograph; four such bodies and their
		// decoded pixels are about 100 MiB.
		MaxImageBytes: 8 << 20,
		MaxUploads:    4,
	}
}

// withDefaults fills unset (zero or negative) fields from DefaultConfig.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.Limits == (engine.Limits{}) {
		c.Limits = d.Limits
	}
	if c.MaxN <= 0 {
		c.MaxN = d.MaxN
	}
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = d.MaxBodyBytes
	}
	if c.MaxImageBytes <= 0 {
		c.MaxImageBytes = d.MaxImageBytes
	}
	if c.MaxUploads <= 0 {
		c.MaxUploads = d.MaxUploads
	}
	if c.SyncTimeout <= 0 {
		c.SyncTimeout = d.SyncTimeout
	}
	if c.MaxWait <= 0 {
		c.MaxWait = d.MaxWait
	}
	c.Server = c.Server.withDefaults()
	if c.Logger == nil {
		c.Logger = d.Logger
	}
	if c.FFmpeg == "" {
		c.FFmpeg = d.FFmpeg
	}
	if c.StreamKeepAlive <= 0 {
		c.StreamKeepAlive = d.StreamKeepAlive
	}
	return c
}

type server struct {
	cfg  Config
	jobs Jobs
	log  *zap.Logger
	enc  *videoenc.Encoder // nil: no ffmpeg, videos are served as GIF
	warn *ignoredFields    // the OpenAI fields already warned about
	// uploads holds a slot per request body being read that may carry an
	// image (uploadSlot).
	uploads chan struct{}
}

// NewHandler returns the client API. Unset fields of cfg take their
// DefaultConfig values; cfg is copied. A nil j is a programming error and
// panics at construction, never while serving.
func NewHandler(cfg Config, j Jobs) http.Handler {
	if j == nil {
		panic("httpapi: NewHandler needs a Jobs")
	}
	cfg = cfg.withDefaults()
	s := &server{cfg: cfg, jobs: j, log: cfg.Logger.Named("httpapi"), warn: &ignoredFields{}, uploads: make(chan struct{}, cfg.MaxUploads)}
	s.enc = newEncoder(cfg.FFmpeg, s.log)
	mux := http.NewServeMux()
	rt := router{mux: mux, log: s.log, metrics: cfg.Metrics}
	rt.handle("/v1/images/generations", methods{http.MethodPost: s.imagesGenerations})
	rt.handle("/v1/images/edits", methods{http.MethodPost: s.imagesEdits})
	rt.handle("/v1/jobs", methods{http.MethodPost: s.createJob})
	rt.handle("/v1/jobs/{id}", methods{http.MethodGet: s.getJob, http.MethodDelete: s.cancelJob})
	rt.handle("/v1/jobs/{id}/cancel", methods{http.MethodPost: s.cancelOnly})
	rt.handle("/v1/jobs/{id}/fork", methods{http.MethodPost: s.forkJob})
	rt.handle("/v1/jobs/{id}/result", methods{http.MethodGet: s.getResult})
	rt.handle("/v1/jobs/{id}/frames", methods{http.MethodGet: s.streamFrames})
	rt.handle("/v1/jobs/{id}/events", methods{http.MethodGet: s.streamEvents})
	rt.handle("/v1/videos", methods{http.MethodPost: s.createVideo, http.MethodGet: s.listVideos})
	rt.handle("/v1/videos/{id}", methods{http.MethodGet: s.getVideo, http.MethodDelete: s.deleteVideo})
	rt.handle("/v1/videos/{id}/content", methods{http.MethodGet: s.videoContent})
	rt.handle("/v1/models", methods{http.MethodGet: s.listModels})
	rt.handle("/v1/models/{model...}", methods{http.MethodGet: s.getModel})
	rt.handle("/", methods{"*": notFound})
	var h http.Handler = mux
	if cfg.Tokens != nil {
		h = authenticate(cfg.Tokens, cfg.RatePerToken, cfg.RateBurst, cfg.Metrics, h)
	}
	return limitInFlight(cfg.Server.MaxInFlight, cfg.Metrics, h)
}

// methods maps an HTTP method to its handler; "*" matches any method.
type methods map[string]http.HandlerFunc

// router registers method-less patterns and dispatches on method itself,
// so that a wrong method gets a JSON 405 rather than ServeMux's text one.
type router struct {
	mux     *http.ServeMux
	log     *zap.Logger
	metrics *Metrics
}

func (rt router) handle(pattern string, m methods) {
	allow := make([]string, 0, len(m))
	for k := range m {
		allow = append(allow, k)
	}
	slices.Sort(allow)
	allowHeader := strings.Join(allow, ", ")
	h := func(w http.ResponseWriter, r *http.Request) {
		f, ok := m[r.Method]
		if !ok {
			f, ok = m["*"]
		}
		if !ok && r.Method == http.MethodHead {
			f, ok = m[http.MethodGet]
		}
		if !ok {
			w.Header().Set("Allow", allowHeader)
			writeError(w, apiErr(http.StatusMethodNotAllowed, typeInvalidRequest, CodeMethodNotAllowed,
				"method %s is not allowed on %s; allowed: %s", r.Method, pattern, allowHeader))
			return
		}
		f(w, r)
	}
	rt.mux.Handle(pattern, instrument(rt.log, rt.metrics, pattern, http.HandlerFunc(h)))
}

// statusWriter remembers the status written, for metrics and for knowing
// whether a recovered panic can still send an error body.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// instrument counts requests by route and status and turns a panic into a
// logged 500, so that no input can take the agent down.
func instrument(log *zap.Logger, m *Metrics, route string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				log.Error("handler panic", zap.String("route", route), zap.String("method", r.Method),
					zap.Any("panic", v), zap.ByteString("stack", debug.Stack()))
				if sw.status == 0 {
					writeError(sw, apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "internal error"))
				}
			}
			if m != nil {
				status := sw.status
				if status == 0 {
					status = http.StatusOK
				}
				m.observeRequest(route, status)
			}
		}()
		next.ServeHTTP(sw, r)
	})
}

func notFound(w http.ResponseWriter, r *http.Request) {
	writeError(w, apiErr(http.StatusNotFound, typeNotFound, CodeNotFound, "no such endpoint: %s %s", r.Method, r.URL.Path))
}

// jobID reads and checks the {id} path segment. Ids are opaque, but one
// that could address some other key in the store (a slash, "..") is never
// a job's.
func jobID(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("id")
	if !validID(id) {
		writeError(w, apiErr(http.StatusNotFound, typeNotFound, CodeJobNotFound, "no job %q", id))
		return "", false
	}
	return id, true
}

// validID accepts what could be a key segment: the Store's rule for object
// ids (letters, digits, '-', '_', '.'), at most 128 bytes.
func validID(id string) bool { return len(id) <= 128 && cache.ValidID(id) }

func (s *server) createJob(w http.ResponseWriter, r *http.Request) {
	release, ok := s.uploadSlot(w, r) // the body may carry an image
	if !ok {
		return
	}
	defer release()
	var req JobRequest
	body := &countingBody{ReadCloser: r.Body}
	r.Body = body
	if e := decodeBody(w, r, s.imageBodyBytes(), &req); e != nil {
		writeError(w, e)
		return
	}
	if body.n > s.cfg.MaxBodyBytes && req.Image == "" { // only an image earns the larger bound
		writeError(w, tooLarge(s.cfg.MaxBodyBytes))
		return
	}
	spec, opts, err := req.spec(s.limitsFor(req.Model), s.cfg.ModelSteps)
	if err == nil {
		opts.Image, err = imageField(req.Image, s.cfg.MaxImageBytes)
		req.Image = "" // decoded: let the base64 go
	}
	if err != nil {
		writeError(w, fieldError(err))
		return
	}
	job, ok := s.submit(w, r, spec, opts)
	if !ok {
		return
	}
	s.log.Info("job submitted", zap.String("job", job.ID), zap.Stringer("class", opts.Class))
	w.Header().Set("Location", "/v1/jobs/"+url.PathEscape(job.ID))
	writeJSON(w, http.StatusAccepted, public(job))
}

func (s *server) getJob(w http.ResponseWriter, r *http.Request) {
	id, ok := jobID(w, r)
	if !ok {
		return
	}
	wait, e := s.parseWait(r)
	if e != nil {
		writeError(w, e)
		return
	}
	if wait == 0 {
		if !s.visible(w, r, id) {
			return
		}
		job, err := s.jobs.Get(r.Context(), id)
		if err != nil {
			writeError(w, s.storeError(r, "get", id, err))
			return
		}
		writeJSON(w, http.StatusOK, public(job))
		return
	}
	// A long poll answers within its wait plus lastKnownWithin, whatever
	// etcd does: the checks and reads around the wait share that bound,
	// and running past it is etcd not answering (a 503).
	start := time.Now()
	s.holdOpen(w, wait+lastKnownWithin)
	bound, cancel := context.WithTimeoutCause(r.Context(), wait+lastKnownWithin, errNoAnswerInWait)
	defer cancel()
	br := r.WithContext(bound)
	if !s.visible(w, br, id) {
		return
	}
	wctx, wcancel := context.WithDeadline(bound, start.Add(wait))
	job, err := s.jobs.Wait(wctx, id)
	ranOut := wctx.Err() != nil // whatever error the store made of it
	wcancel()
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, public(job))
		return
	case r.Context().Err() != nil:
		return // the client left; nobody to answer
	case !ranOut:
		writeError(w, s.storeError(br, "wait", id, err))
		return
	}
	// The wait ran out: answer with the job as it stands.
	job, err = s.jobs.Get(bound, id)
	if err != nil {
		writeError(w, s.storeError(br, "get", id, err))
		return
	}
	writeJSON(w, http.StatusOK, public(job))
}

// lastKnownWithin is how long a long poll whose wait ran out may take to
// read the job as it stands (and to check the caller may see it): with it,
// ?wait=D answers within D plus a second.
const lastKnownWithin = 900 * time.Millisecond

// errNoAnswerInWait ends a long poll whose reads did not fit in its bound.
var errNoAnswerInWait = fmt.Errorf("%w: no answer within the long poll's wait", jobs.ErrUnavailable)

// visible answers 404, as for a job that does not exist, when tokens are
// on and the caller's token neither created the job nor is an admin's, so
// that ids cannot be probed. Without tokens it costs nothing.
func (s *server) visible(w http.ResponseWriter, r *http.Request, id string) bool {
	if _, ok := callerOf(r.Context()); !ok {
		return true
	}
	job, err := s.jobs.Get(r.Context(), id)
	if err != nil {
		writeError(w, s.storeError(r, "get", id, err))
		return false
	}
	if !mayAccess(r, job) {
		writeError(w, apiErr(http.StatusNotFound, typeNotFound, CodeJobNotFound, "no job %q", id))
		return false
	}
	return true
}

// public is a job as the API shows it: without its owner's token hash.
func public(j jobs.Job) jobs.Job {
	j.Owner = ""
	return j
}

// parseWait reads ?wait=DURATION, capped at MaxWait.
func (s *server) parseWait(r *http.Request) (time.Duration, *APIError) {
	v := r.URL.Query().Get("wait")
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		// Also accept whole seconds, as many long-poll APIs do.
		n, nerr := strconv.Atoi(v)
		if nerr != nil {
			e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"wait",
				"wait: %q is not a duration such as 30s", v)
			e.Param = "wait"
			return 0, e
		}
		d = time.Duration(n) * time.Second
	}
	if d < 0 {
		e := apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"wait", "wait: %q must not be negative", v)
		e.Param = "wait"
		return 0, e
	}
	return min(d, s.cfg.MaxWait), nil
}

func (s *server) getResult(w http.ResponseWriter, r *http.Request) {
	id, ok := jobID(w, r)
	if !ok || !s.visible(w, r, id) {
		return
	}
	data, ct, err := s.jobs.Result(r.Context(), id)
	if errors.Is(err, jobs.ErrNotReady) {
		job, gerr := s.jobs.Get(r.Context(), id)
		if gerr != nil {
			writeError(w, s.storeError(r, "get", id, gerr))
			return
		}
		writeError(w, notSucceeded(job))
		return
	}
	if err != nil {
		writeError(w, s.storeError(r, "result", id, err))
		return
	}
	if ct == "" {
		ct = "application/octet-stream"
	}
	h := w.Header()
	h.Set("Content-Type", ct)
	h.Set("Content-Length", strconv.Itoa(len(data)))
	h.Set("X-Content-Type-Options", "nosniff")
	// A job's output never changes once it succeeded.
	h.Set("Cache-Control", "private, max-age=31536000, immutable")
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(data)
	}
}

// notSucceeded explains why a job has no result: still running (409
// not_ready), cancelled (409 cancelled) or failed (410 with the job's code).
func notSucceeded(job jobs.Job) *APIError {
	switch job.State {
	case jobs.Failed:
		code, msg := CodeJobFailed, "job failed"
		if job.Error != nil {
			if job.Error.Code != "" {
				code = job.Error.Code
			}
			if job.Error.Message != "" {
				msg = job.Error.Message
			}
		}
		return apiErr(http.StatusGone, typeJob, code, "job %s failed: %s", job.ID, msg)
	case jobs.Cancelled:
		return apiErr(http.StatusConflict, typeConflict, CodeCancelled, "job %s was cancelled", job.ID)
	default:
		stage := ""
		if job.Stage != "" {
			stage = fmt.Sprintf(" (stage %s)", job.Stage)
		}
		return apiErr(http.StatusConflict, typeConflict, CodeNotReady, "job %s is %s%s; its result is not ready", job.ID, job.State, stage)
	}
}

// deleteResponse answers a DELETE of a finished job.
type deleteResponse struct {
	ID      string `json:"id"`
	Object  string `json:"object"` // "job"
	Deleted bool   `json:"deleted"`
}

// cancelOnly is POST /v1/jobs/{id}/cancel: it cancels a queued or running
// job and never deletes one (409 already_finished), so a client that gives
// up on a job cannot remove a result that just arrived.
func (s *server) cancelOnly(w http.ResponseWriter, r *http.Request) {
	s.cancel(w, r, false)
}

// cancelJob is DELETE /v1/jobs/{id}: a queued or running job is cancelled
// (200 with the job); a finished one is deleted with its result (200 with
// {"id","object":"job","deleted":true}), after which it is 404.
func (s *server) cancelJob(w http.ResponseWriter, r *http.Request) {
	s.cancel(w, r, true)
}

func (s *server) cancel(w http.ResponseWriter, r *http.Request, deleteFinished bool) {
	id, ok := jobID(w, r)
	if !ok || !s.visible(w, r, id) {
		return
	}
	job, err := s.jobs.Cancel(r.Context(), id)
	if errors.Is(err, jobs.ErrFinished) && !deleteFinished {
		e := apiErr(http.StatusConflict, typeConflict, CodeAlreadyFinished, "job %s already finished", id)
		if job.State != "" {
			e.Message = fmt.Sprintf("job %s already finished (%s)", id, job.State)
		}
		writeError(w, e)
		return
	}
	if errors.Is(err, jobs.ErrFinished) {
		if err := s.jobs.Delete(r.Context(), id); err != nil {
			writeError(w, s.storeError(r, "delete", id, err))
			return
		}
		s.log.Info("job deleted", zap.String("job", id), zap.String("state", string(job.State)))
		writeJSON(w, http.StatusOK, deleteResponse{ID: id, Object: "job", Deleted: true})
		return
	}
	if err != nil {
		writeError(w, s.storeError(r, "cancel", id, err))
		return
	}
	s.log.Info("job cancelled", zap.String("job", id))
	writeJSON(w, http.StatusOK, public(job))
}

// storeError maps an error from Jobs to an HTTP answer. Unknown errors are
// logged and reported without detail.
func (s *server) storeError(r *http.Request, op, id string, err error) *APIError {
	if ctx := r.Context(); ctx.Err() != nil && errors.Is(context.Cause(ctx), jobs.ErrUnavailable) {
		err = context.Cause(ctx) // a bound of ours on etcd ran out, whatever the call made of it
	}
	if !errors.Is(err, jobs.ErrUnavailable) && jobs.IsUnavailable(err) {
		err = fmt.Errorf("%w: %v", jobs.ErrUnavailable, err) // an outage nobody named: a 503 all the same
	}
	var fe *engine.FieldError
	switch {
	case errors.Is(err, jobs.ErrNotFound):
		return apiErr(http.StatusNotFound, typeNotFound, CodeJobNotFound, "no job %q", id)
	case errors.Is(err, jobs.ErrNotReady):
		return apiErr(http.StatusConflict, typeConflict, CodeNotReady, "job %s: result not ready", id)
	case errors.Is(err, jobs.ErrFinished):
		return apiErr(http.StatusConflict, typeConflict, CodeAlreadyFinished, "job %s already finished", id)
	case errors.Is(err, jobs.ErrNotFinished):
		return apiErr(http.StatusConflict, typeConflict, CodeNotReady, "%s", err.Error())
	case errors.Is(err, jobs.ErrExpired):
		return apiErr(http.StatusGone, typeJob, CodeExpired, "job %s: its result passed its retention and was freed", id)
	case errors.Is(err, jobs.ErrResultLost):
		return apiErr(http.StatusGone, typeJob, CodeResultLost, "job %s: its result was lost: every agent that held a copy died before the Store could copy it elsewhere; submit the job again", id)
	case errors.Is(err, jobs.ErrNoSpace), errors.Is(err, jobs.ErrStoreFull):
		e := apiErr(http.StatusServiceUnavailable, typeServer, CodeOverloaded, "%s", err.Error())
		e.RetryAfter = 30
		return e
	case errors.Is(err, jobs.ErrUnavailable):
		// The job store is etcd; say so, so an operator knows where to look.
		e := apiErr(http.StatusServiceUnavailable, typeServer, CodeUnavailable, "%s; retry shortly",
			strings.TrimPrefix(err.Error(), "jobs: "))
		e.RetryAfter = 5
		return e
	case errors.As(err, &fe):
		return fieldError(err)
	case errors.Is(err, context.DeadlineExceeded):
		return apiErr(http.StatusGatewayTimeout, typeServer, CodeTimeout, "%s timed out", op)
	case errors.Is(err, context.Canceled) && r.Context().Err() != nil:
		return apiErr(http.StatusServiceUnavailable, typeServer, CodeUnavailable, "request cancelled")
	}
	s.log.Error("job store error", zap.String("op", op), zap.String("job", id), zap.Error(err))
	return apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "internal error during %s", op)
}

// limitsFor is what a request for model is checked against: the limits its
// engine registered, or the server's own for the built-in model and for a
// model no engine registered limits for.
func (s *server) limitsFor(model string) engine.Limits {
	if s.cfg.ModelLimits != nil {
		if l, ok := s.cfg.ModelLimits(model); ok {
			return l
		}
	}
	return s.cfg.Limits
}

// submit stores a validated job for the caller; when that fails it answers
// the error itself and ok is false.
func (s *server) submit(w http.ResponseWriter, r *http.Request, spec engine.Spec, opts jobs.Options) (job jobs.Job, ok bool) {
	opts.Owner = owner(r)
	job, err := s.jobs.Submit(r.Context(), spec, opts)
	if err != nil {
		writeError(w, s.storeError(r, "submit", "", err))
		return jobs.Job{}, false
	}
	return job, true
}
