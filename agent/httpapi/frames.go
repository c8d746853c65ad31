package httpapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// FrameStreamer is implemented by a Jobs that can stream a video's decoded
// frames while the decode stage runs. It is optional: without it the frames
// endpoint answers 501.
type FrameStreamer interface {
	// StreamFrames calls emit with each frame preview as it is decoded, until
	// the job is terminal; it returns the finished job.
	StreamFrames(ctx context.Context, id string, emit func(jobs.Frame) error) (jobs.Job, error)
}

// frameEvent is the data of one "frame" server-sent event.
type frameEvent struct {
	Index       int    `json:"index"`
	ContentType string `json:"content_type"`
	B64         string `json:"b64_png"`
}

// streamFrames is GET /v1/jobs/{id}/frames: a text/event-stream with one
// "frame" event per decoded frame (a PNG preview, base64) as the decode
// agent produces it, then one "done" event carrying the finished job. A
// client sees the first frames of a video while the rest still decodes.
func (s *server) streamFrames(w http.ResponseWriter, r *http.Request) {
	fs, ok := s.jobs.(FrameStreamer)
	if !ok {
		writeError(w, apiErr(http.StatusNotImplemented, typeServer, CodeUnavailable, "this server cannot stream frames"))
		return
	}
	s.streamJob(w, r, "frame", func(id string, send sender) (jobs.Job, error) {
		return fs.StreamFrames(r.Context(), id, func(f jobs.Frame) error {
			return send("frame", frameEvent{Index: f.Index, ContentType: "image/png", B64: base64.StdEncoding.EncodeToString(f.PNG)})
		})
	})
}

// sender writes one server-sent event.
type sender func(event string, v any) error

// streamJob answers a GET of one of a job's event streams: it checks the
// job as any GET does (a proper JSON error before committing to a stream),
// opens the stream, runs follow on it, and ends it with a "done" event
// carrying the finished job, or an "error" event if follow broke off.
func (s *server) streamJob(w http.ResponseWriter, r *http.Request, what string, follow func(id string, send sender) (jobs.Job, error)) {
	id, ok := jobID(w, r)
	if !ok || !s.visible(w, r, id) {
		return
	}
	if _, err := s.jobs.Get(r.Context(), id); err != nil {
		writeError(w, s.storeError(r, "get", id, err))
		return
	}
	send, stop := s.openStream(w)
	defer stop()
	job, err := follow(id, send)
	if err != nil {
		if r.Context().Err() == nil {
			s.log.Warn(what+" stream ended", zap.String("job", id), zap.Error(err))
			_ = send("error", errorEnvelope{Error: apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "stream interrupted")})
		}
		return
	}
	_ = send("done", public(job))
}

// openStream starts a text/event-stream answer and returns its sender: one
// event, written and flushed, per call. The stream lasts as long as the
// job: no read deadline (a GET has no body), and each event, not the
// stream, must be written within WriteTimeout, so a client that stops
// reading is dropped. While no event goes for StreamKeepAlive, a comment
// line (": keep-alive") does, so that proxies and clients see the stream
// alive while a job waits in a queue; stop ends that before the handler
// returns.
func (s *server) openStream(w http.ResponseWriter) (send sender, stop func()) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{})
	_ = rc.SetWriteDeadline(time.Now().Add(s.cfg.Server.WriteTimeout))
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	var mu sync.Mutex // serializes events and keep-alives on w
	write := func(format string, a ...any) error {
		mu.Lock()
		defer mu.Unlock()
		_ = rc.SetWriteDeadline(time.Now().Add(s.cfg.Server.WriteTimeout))
		if _, err := fmt.Fprintf(w, format, a...); err != nil {
			return err
		}
		return rc.Flush()
	}
	sent := make(chan struct{}, 1)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(s.cfg.StreamKeepAlive)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-sent:
				t.Reset(s.cfg.StreamKeepAlive) // an event went: idle from now
			case <-t.C:
				if write(": keep-alive\n\n") != nil {
					return // the client left; the next event says so to follow
				}
			}
		}
	})
	send = func(event string, v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		if err := write("event: %s\ndata: %s\n\n", event, b); err != nil {
			return err
		}
		select {
		case sent <- struct{}{}:
		default: // a reset is pending already
		}
		return nil
	}
	return send, sync.OnceFunc(func() { close(done); wg.Wait() })
}
