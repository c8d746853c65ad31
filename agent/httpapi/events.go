package httpapi

import (
	"context"
	"net/http"

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
	es, ok := s.jobs.(EventStreamer)
	if !ok {
		writeError(w, apiErr(http.StatusNotImplemented, typeServer, CodeUnavailable, "this server cannot stream job events"))
		return
	}
	s.streamJob(w, r, "event", func(id string, send sender) (jobs.Job, error) {
		return es.StreamEvents(r.Context(), id,
			func(j jobs.Job) error { return send("job", public(j)) },
			func(st jobs.Step) error { return send("progress", st) })
	})
}
