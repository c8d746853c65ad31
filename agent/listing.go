package agent

import (
	"context"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// ListJobs returns a page of jobs in creation order (httpapi.JobLister,
// for GET /v1/videos).
func (a *Agent) ListJobs(ctx context.Context, q jobs.ListQuery) (page []jobs.Job, more bool, err error) {
	err = a.onEtcd(ctx, func(ctx context.Context) error {
		page, more, err = a.store.List(ctx, q)
		return err
	})
	return page, more, err
}

// Models lists the models live members serve on every stage, as gossip
// tells (httpapi.ModelLister, for GET /v1/models): what a submission of
// them would be accepted for.
func (a *Agent) Models() []httpapi.ServedModel {
	nodes := map[string]int{}
	for _, p := range a.member.Peers() {
		if !p.Alive {
			continue
		}
		if len(p.Meta.Models) == 0 {
			nodes[engine.DefaultModel]++ // an agent from before models: the built-in one
			continue
		}
		for _, m := range p.Meta.Models {
			nodes[m.Name]++
		}
	}
	out := make([]httpapi.ServedModel, 0, len(nodes))
	for name, n := range nodes {
		if a.modelServed(name) {
			out = append(out, httpapi.ServedModel{Name: name, Nodes: n})
		}
	}
	return out
}
