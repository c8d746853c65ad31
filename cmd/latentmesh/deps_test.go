package main

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// The binary nodes run and the package ships links neither the test
// harness nor an etcd server, with or without the rdma tag it ships with
// (in the style of tailscale's tstest/deptest). The demo, the dev cluster,
// the benchmarks and the simulators are cmd/latentmesh-dev's.
func TestDeps(t *testing.T) {
	bad := map[string]string{
		"github.com/latentmesh/latentmesh/testbed":            "the test harness (and its bench, serve, sim, simgpu) is latentmesh-dev's",
		"github.com/latentmesh/latentmesh/agent/etcdembed":    "an embedded etcd is for the dev cluster, the demo and tests",
		"github.com/latentmesh/latentmesh/cmd/latentmesh-dev": "the developer binary",
		"go.etcd.io/etcd/server/v3":                           "the agent is an etcd client, never a server",
	}
	for _, tags := range []string{"", "rdma"} {
		deps := listDeps(t, tags)
		if !deps["github.com/latentmesh/latentmesh/agent"] || !deps["go.etcd.io/etcd/client/v3"] {
			t.Fatalf("tags %q: the deps of cmd/latentmesh lack the agent or the etcd client: the listing is wrong", tags)
		}
		for dep := range deps {
			for prefix, why := range bad {
				if dep == prefix || strings.HasPrefix(dep, prefix+"/") {
					t.Errorf("tags %q: cmd/latentmesh links %s: %s", tags, dep, why)
				}
			}
		}
	}
}

// listDeps is the set of packages `go list -deps` says the binary links.
func listDeps(t *testing.T, tags string) map[string]bool {
	t.Helper()
	args := []string{"list", "-json=ImportPath,Deps"}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	out, err := exec.Command("go", append(args, ".")...).Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var p struct {
		ImportPath string
		Deps       []string
	}
	if err := json.Unmarshal(out, &p); err != nil {
		t.Fatalf("go list: %v", err)
	}
	if p.ImportPath != "github.com/latentmesh/latentmesh/cmd/latentmesh" {
		t.Fatalf("go list listed %q", p.ImportPath)
	}
	deps := make(map[string]bool, len(p.Deps))
	for _, d := range p.Deps {
		deps[d] = true
	}
	return deps
}
