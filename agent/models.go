package agent

import (
	"encoding/json"
	"maps"
	"slices"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// A request for a model served by an external engine is checked, by the
// agent that takes it, against that model's own limits (a video model takes
// far more frames and pixels than the built-in engine's defaults). The
// engine registers them with its models (extengine.Model); this agent puts
// them in its node record, which every agent's view of nodes/ follows.

// modelRecord is what NodeRecord.Models holds for one model.
type modelRecord struct {
	// Limits are an external model's (absent for the built-in model,
	// whose are every agent's own).
	Limits engine.Limits `json:"limits,omitzero"`
	// Encoder is the version of the model's encoder on this node, when it
	// serves the model's encode and can name it: the conditioning cache's
	// entries are keyed by it (condcache.go). SplitCond says the encoder
	// makes the prompt's and the negative prompt's halves apart.
	Encoder   string `json:"encoder,omitempty"`
	SplitCond bool   `json:"split_cond,omitempty"`
	// Inputs are what an external model takes beyond the spec (a
	// parameter schema, a reference image) and Temporal its latent's
	// temporal compression (protocol v2, inputs.go): checked at
	// submission like the limits.
	Inputs   engine.ModelInputs `json:"inputs,omitzero"`
	Temporal int                `json:"temporal,omitempty"`
	// Adapters are the model's adapters the engine has loaded now
	// (adapters.go): a denoise naming one goes to a node listing it.
	Adapters []string `json:"adapters,omitempty"`
}

// modelRecords is what this node's record says of the models its runner
// serves: an external engine's limits, and each encoder's version.
func (a *Agent) modelRecords() map[string]json.RawMessage {
	cv, _ := a.runner.(condVersioned)
	_, split := a.runner.(textEncoder)
	recs := map[string]modelRecord{}
	if a.ext != nil {
		if reg := a.ext.Engine(); reg != nil {
			for _, m := range reg.Models {
				recs[m.Name] = modelRecord{Limits: m.Limits(a.cfg.Engine.Limits), Inputs: m.Inputs(), Temporal: int(m.Latent.Temporal), Adapters: reg.Adapters[m.Name]}
			}
		}
	}
	if cv != nil && a.condCaching() {
		for model, stages := range a.runner.Models() {
			if v := cv.EncoderVersion(model); v != "" && slices.Contains(stages, jobs.Encode) {
				r := recs[model]
				r.Encoder, r.SplitCond = v, split
				recs[model] = r
			}
		}
	}
	models := map[string]json.RawMessage{}
	for name, r := range recs {
		if b, err := json.Marshal(r); err == nil { // a struct of numbers and strings always encodes
			models[name] = b
		}
	}
	return models
}

// publishModels writes what the runner serves (modelRecords) into this
// node's record. Called before registration (Start), it costs no write of
// its own: the registration carries it.
func (a *Agent) publishModels() {
	models := a.modelRecords()
	if err := a.member.SetModels(a.ctx, models); err != nil && a.ctx.Err() == nil {
		a.log.Warn("model limits not written to the node record; submissions check the agent's defaults until the next registration",
			zap.Strings("models", slices.Sorted(maps.Keys(models))), zap.Error(err))
	}
}

// modelLimits returns the limits a request for model is checked against at
// submission: those registered by a live agent serving it, the largest
// pixel budget first (agents serving one model should register the same);
// ok is false for the built-in model and for a model no record names, which
// get the agent's own limits.
func (a *Agent) modelLimits(model string) (l engine.Limits, ok bool) {
	rec, ok := a.modelRecordFor(model)
	return rec.Limits, ok
}

// modelRecordFor is what a live agent serving model registered for it,
// the largest pixel budget first (modelLimits); ok is false for the
// built-in model and a model no record names.
func (a *Agent) modelRecordFor(model string) (r modelRecord, ok bool) {
	if model == "" || model == engine.DefaultModel {
		return modelRecord{}, false
	}
	for _, p := range a.member.Peers() {
		raw, has := p.Record.Models[model]
		if !p.Alive || !has {
			continue
		}
		var rec modelRecord
		if err := json.Unmarshal(raw, &rec); err != nil || rec.Limits.MaxSide == 0 || engine.ValidateSchema(rec.Inputs.Params) != nil {
			continue // an agent that writes something else: not ours to read
		}
		if !ok || rec.Limits.MaxPixels > r.Limits.MaxPixels {
			r, ok = rec, true
		}
	}
	return r, ok
}

// ModelLimits returns the limits a request for model is checked against at
// submission, as this agent's view of the node records has them (ok false:
// the agent's own limits apply).
func (a *Agent) ModelLimits(model string) (engine.Limits, bool) { return a.modelLimits(model) }
