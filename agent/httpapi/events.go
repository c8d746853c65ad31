package httpapi

import (
	"context"
	"net/http"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// EventStreamer is implemented by a Jobs that can follow a job as it runs:
// its changes of state and stage, and each denoise step as the node running
// it reaches it. It is optional: without it the events endpoint answers 501.
type EventStreamer interface {
	// StreamEvents calls onJob with the job as it stands and at each of its
	// changes, and onStep with each denoise step, until the job is
	// terminal; it returns the finished job.
	StreamEvents(ctx context.Context, id string, onJob func(jobs.Job) error, onStep func(jobs.Step) error) (jobs.Job, error)
}

// streamEvents is GET /v1/jobs/{id}/events: a text/event-stream with a
// "job" event carrying the job as it stands and again at each change of
// its state or running stage, a "progress" event per denoise step (stage,
// step, total, node, and when the node reached it), and a last "done"
// event carrying the finished job. Steps come from the node running the
// stage, not from etcd, within milliseconds of the step.
func (s *server) streamEvents(w http.ResponseWriter, r *http.Request) {
	id, ok := jobID(w, r)
	if !ok {
		return
	}
	es, ok := s.jobs.(EventStreamer)
	if !ok {
		writeError(w, apiErr(http.StatusNotImplemented, typeServer, CodeUnavailable, "this server cannot stream job events"))
		return
	}
	// Fail with a proper JSON error before committing to a stream.
	if !s.visible(w, r, id) {
		return
	}
	if _, err := s.jobs.Get(r.Context(), id); err != nil {
		writeError(w, s.storeError(r, "get", id, err))
		return
	}
	send := s.openStream(w)
	job, err := es.StreamEvents(r.Context(), id,
		func(j jobs.Job) error { return send("job", public(j)) },
		func(st jobs.Step) error { return send("progress", st) })
	if err != nil {
		if r.Context().Err() == nil {
			s.log.Warn("event stream ended", zap.String("job", id), zap.Error(err))
			_ = send("error", errorEnvelope{Error: apiErr(http.StatusInternalServerError, typeServer, CodeInternal, "stream interrupted")})
		}
		return
	}
	_ = send("done", public(job))
}
