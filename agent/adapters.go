package agent

// This file holds adapters (issue 20): LoRA-like weight deltas of a model's
// denoiser that an external engine loads and unloads at run time
// (extengine's FeatureAdapters). A request naming one (spec.Adapter,
// "lora" in the APIs) runs its denoise only on a worker whose engine has
// it loaded:
//
//   - the agent advertises the adapters its engine has loaded in its node
//     record's model entry (modelRecord.Adapters), rewritten on every load
//     and unload (gossipEngine); gossip meta has no room for them;
//   - a submission naming an adapter no live agent advertises for the
//     model gets 400 "lora";
//   - the denoise's hint and push go to a worker advertising it, and only
//     such a worker claims it;
//   - should every one unload it while the task waits, any worker of the
//     model claims it once adapterGrace has passed (time for a record
//     written elsewhere to reach this agent's view) and fails the job
//     with code adapter_unavailable, naming the adapter.
//
// The agent never asks an engine to load an adapter: it has no catalogue
// of adapter weights; an engine (or its operator) decides what it loads.

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
)

// adapterGrace is how long a denoise naming an adapter that no live agent
// advertises waits before a worker without it claims it to fail it: a
// node record written elsewhere reaches this agent's view within a watch
// event (milliseconds), so seconds of silence mean the adapter is gone.
const adapterGrace = 5 * time.Second

// errAdapterGone: a denoise names an adapter no agent of the mesh has
// loaded any more; the job fails (code adapter_unavailable).
var errAdapterGone = errors.New("agent: adapter not loaded on any agent")

// adapterRunner is a runner whose engine loads adapters (externalRunner).
type adapterRunner interface {
	HasAdapter(model, adapter string) bool
}

// hasAdapter reports whether this agent's engine has adapter of model loaded.
func (a *Agent) hasAdapter(model, adapter string) bool {
	ar, ok := a.runner.(adapterRunner)
	return ok && ar.HasAdapter(model, adapter)
}

// advertises reports whether peer p's node record says its engine has
// adapter of model loaded.
func advertises(p gossip.Peer, model, adapter string) bool {
	raw, ok := p.Record.Models[model]
	if !ok {
		return false
	}
	var rec modelRecord
	return json.Unmarshal(raw, &rec) == nil && slices.Contains(rec.Adapters, adapter)
}

// takesAdapterOf reports whether peer p may be handed a task of stage st of
// s as far as s's adapter goes: only a denoise names one, and only a peer
// advertising it loaded takes such a denoise.
func takesAdapterOf(p gossip.Peer, st jobs.Stage, s engine.Spec) bool {
	return st != jobs.Denoise || s.Adapter == "" || advertises(p, s.ModelName(), s.Adapter)
}

// adapterServed reports whether some live agent whose denoise serves
// model advertises adapter loaded.
func (a *Agent) adapterServed(model, adapter string) bool {
	for _, p := range a.member.Peers() {
		if p.Alive && p.Record.HasRole(string(jobs.Denoise)) && p.Meta.Serves(string(jobs.Denoise), model, engine.DefaultModel) && advertises(p, model, adapter) {
			return true
		}
	}
	return false
}

// checkAdapter refuses, at submission, a spec naming an adapter no live
// agent has loaded for its model.
func (a *Agent) checkAdapter(s engine.Spec) error {
	switch {
	case s.Adapter == "":
		return nil
	case s.ModelName() == engine.DefaultModel:
		return &engine.FieldError{Field: "lora", Msg: fmt.Sprintf("%q: the built-in model takes no adapter", s.Adapter)}
	case !a.adapterServed(s.ModelName(), s.Adapter):
		return &engine.FieldError{Field: "lora", Msg: fmt.Sprintf("adapter %q of model %q is not loaded on any agent of this mesh", s.Adapter, s.ModelName())}
	}
	return nil
}

// takesAdapter says whether this agent claims t, a task of stage st of a
// model its engine serves, as far as t's adapter goes; when it may later,
// wake is when.
func (a *Agent) takesAdapter(st jobs.Stage, t jobs.Task, now time.Time) (ok bool, wake time.Time) {
	s := t.Spec
	if st != jobs.Denoise || s.Adapter == "" || a.hasAdapter(s.ModelName(), s.Adapter) {
		return true, time.Time{}
	}
	if a.adapterServed(s.ModelName(), s.Adapter) {
		return false, time.Time{} // a worker that has it claims it
	}
	at := t.EnqueuedAt
	if t.NotBefore.After(at) {
		at = t.NotBefore
	}
	if at = at.Add(adapterGrace); now.Before(at) {
		return false, at
	}
	return true, time.Time{} // nobody has it: claimed to fail it (runAdapter)
}

// runAdapter is what a denoise of s must do before it runs: nothing when
// the engine has s's adapter loaded (or s names none); else retry (another
// worker has it, as a lost race leaves it) or fail the job.
func (a *Agent) runAdapter(s engine.Spec) error {
	switch {
	case s.Adapter == "" || a.hasAdapter(s.ModelName(), s.Adapter):
		return nil
	case a.adapterServed(s.ModelName(), s.Adapter):
		return fmt.Errorf("%w: adapter %q of model %q is loaded elsewhere, not here", errTransient, s.Adapter, s.ModelName())
	}
	return fmt.Errorf("%w: adapter %q of model %q was unloaded from every engine after the job was submitted; load it and submit again",
		errAdapterGone, s.Adapter, s.ModelName())
}

// HasAdapter is the registered engine's (extengine.Registration).
func (x *externalRunner) HasAdapter(model, adapter string) bool {
	return x.srv.Engine().HasAdapter(model, adapter)
}

// AdapterServed reports whether, as this agent's view of the node records
// has it, a live agent serving model's denoise has adapter loaded: what a
// submission naming it needs.
func (a *Agent) AdapterServed(model, adapter string) bool { return a.adapterServed(model, adapter) }
