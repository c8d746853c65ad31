package httpapi

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// ForkRequest is the body of POST /v1/jobs/{id}/fork: a new job that
// re-denoises job id from its checkpoint after FromStep with some
// parameters changed. The job must have kept its checkpoints
// (keep_checkpoints) and have one at FromStep (checkpoint_every divides
// it). Its seed, size and model stay; a nil field keeps the job's value.
type ForkRequest struct {
	FromStep       int      `json:"from_step"`
	Prompt         *string  `json:"prompt,omitempty"`
	NegativePrompt *string  `json:"negative_prompt,omitempty"`
	GuidanceScale  *float64 `json:"guidance_scale,omitempty"`
	// Steps is the fork's total step count (more than FromStep); when it
	// differs from the job's, the remaining steps spread the rest of the
	// schedule evenly.
	Steps           *int   `json:"steps,omitempty"`
	Priority        string `json:"priority,omitempty"`
	CheckpointEvery *int   `json:"checkpoint_every,omitempty"`
	KeepCheckpoints string `json:"keep_checkpoints,omitempty"`
}

// CodeNoCheckpoint: a fork named a step its job has no checkpoint of.
const CodeNoCheckpoint = "no_checkpoint"

func (s *server) forkJob(w http.ResponseWriter, r *http.Request) {
	id, ok := jobID(w, r)
	if !ok || !s.visible(w, r, id) {
		return
	}
	var req ForkRequest
	if e := decodeBody(w, r, s.cfg.MaxBodyBytes, &req); e != nil {
		writeError(w, e)
		return
	}
	if req.FromStep < 1 {
		writeError(w, fieldError(&engine.FieldError{Field: "from_step", Msg: fmt.Sprintf("%d: want a step the job checkpointed (1 or more)", req.FromStep)}))
		return
	}
	orig, from, err := s.jobs.ForkPoint(r.Context(), id, req.FromStep)
	switch {
	case errors.Is(err, jobs.ErrNoCheckpoint):
		writeError(w, apiErr(http.StatusConflict, typeConflict, CodeNoCheckpoint,
			"job %s has no checkpoint after step %d: submit it with keep_checkpoints and a checkpoint_every that divides the step", id, req.FromStep))
		return
	case err != nil:
		writeError(w, s.storeError(r, "fork", id, err))
		return
	}
	spec := orig.Spec
	setIf(&spec.Prompt, req.Prompt)
	setIf(&spec.NegativePrompt, req.NegativePrompt)
	setIf(&spec.GuidanceScale, req.GuidanceScale)
	setIf(&spec.Steps, req.Steps)
	if spec.Steps <= req.FromStep {
		writeError(w, fieldError(&engine.FieldError{Field: "steps", Msg: fmt.Sprintf("%d: a fork from step %d needs more steps than that", spec.Steps, req.FromStep)}))
		return
	}
	class := orig.Class
	if req.Priority != "" {
		if class, err = parseClass(req.Priority); err != nil {
			writeError(w, fieldError(err))
			return
		}
	}
	opts := jobs.Options{Class: class, Transfer: orig.Transfer, Fork: &from}
	if opts.Checkpointing, err = checkpointing(req.CheckpointEvery, req.KeepCheckpoints, spec.Steps); err != nil {
		writeError(w, fieldError(err))
		return
	}
	if err := spec.Validate(s.limitsFor(spec.Model)); err != nil {
		writeError(w, fieldError(err))
		return
	}
	job, ok := s.submit(w, r, spec, opts)
	if !ok {
		return
	}
	s.log.Info("job forked", zap.String("job", job.ID), zap.String("from", id), zap.Int("step", req.FromStep))
	w.Header().Set("Location", "/v1/jobs/"+url.PathEscape(job.ID))
	writeJSON(w, http.StatusAccepted, public(job))
}
