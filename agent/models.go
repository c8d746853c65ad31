package agent

import (
	"encoding/json"
	"maps"
	"slices"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// A request for a model served by an external engine is checked, by the
// agent that takes it, against that model's own limits (a video model takes
// far more frames and pixels than the built-in engine's defaults). The
// engine registers them with its models (extengine.Model); this agent puts
// them in its node record, which every agent's view of nodes/ follows.

// modelRecord is what NodeRecord.Models holds for one model.
type modelRecord struct {
	Limits engine.Limits `json:"limits"`
}

// publishModels writes the limits of the models the registered engine
// serves into this node's record (none while no engine is registered).
func (a *Agent) publishModels() {
	if a.ext == nil {
		return
	}
	models := map[string]json.RawMessage{}
	if reg := a.ext.Engine(); reg != nil {
		for _, m := range reg.Models {
			b, err := json.Marshal(modelRecord{Limits: m.Limits(a.cfg.Engine.Limits)})
			if err != nil {
				continue // a struct of numbers always encodes
			}
			models[m.Name] = b
		}
	}
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
	if model == "" || model == engine.DefaultModel {
		return engine.Limits{}, false
	}
	for _, p := range a.member.Peers() {
		raw, has := p.Record.Models[model]
		if !p.Alive || !has {
			continue
		}
		var rec modelRecord
		if err := json.Unmarshal(raw, &rec); err != nil || rec.Limits.MaxSide == 0 {
			continue // an agent that writes something else: not ours to read
		}
		if !ok || rec.Limits.MaxPixels > l.MaxPixels {
			l, ok = rec.Limits, true
		}
	}
	return l, ok
}

// ModelLimits returns the limits a request for model is checked against at
// submission, as this agent's view of the node records has them (ok false:
// the agent's own limits apply).
func (a *Agent) ModelLimits(model string) (engine.Limits, bool) { return a.modelLimits(model) }
