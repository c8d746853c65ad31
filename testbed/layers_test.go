package testbed

import (
	"encoding/json"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const module = "github.com/latentmesh/latentmesh"

type listedPackage struct {
	ImportPath string
	Doc        string
	Deps       []string
}

// listPackages runs `go list -json ./...` at the module root.
func listPackages(t *testing.T) []listedPackage {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	cmd := exec.Command("go", "list", "-json", "-tags", "rdma", "./...")
	cmd.Dir = filepath.Dir(filepath.Dir(file))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var pkgs []listedPackage
	dec := json.NewDecoder(out)
	for {
		var p listedPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, p)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	return pkgs
}

// Lower layers never import higher ones, and routing stays pure policy.
func TestLayering(t *testing.T) {
	forbidden := map[string][]string{
		"routing":  {module + "/", "go.etcd.io/", "github.com/libp2p/", "github.com/hashicorp/memberlist", "net"},
		"transfer": {module + "/agent", module + "/gossip", module + "/routing", module + "/cache", module + "/testbed", module + "/cmd"},
		"gossip":   {module + "/agent", module + "/transfer", module + "/routing", module + "/cache", module + "/testbed", module + "/cmd"},
		"cache":    {module + "/agent", module + "/testbed", module + "/cmd"},
		"agent":    {module + "/testbed", module + "/cmd"},
		// The engine protocol knows stages and tensors, not the mesh: an
		// engine never reaches etcd, gossip or other agents through it.
		"agent/extengine": {module + "/agent/jobs", module + "/agent/httpapi", module + "/gossip", module + "/cache", module + "/routing"},
		// Live progress is peer to peer: nothing of it reaches etcd.
		"agent/progress": {module + "/agent/jobs", module + "/gossip", module + "/cache", module + "/routing", "go.etcd.io/"},
		// Credit grants are peer to peer too; what they mean is routing's.
		"agent/grant": {module + "/agent/jobs", module + "/gossip", module + "/cache", module + "/routing", "go.etcd.io/"},
	}
	// Leaves any layer may use: they import nothing of latentmesh.
	leaves := map[string]bool{
		module + "/gossip/msgpackcheck": true, // bounds msgpack before decoding: gossip meta and engine frames
	}
	for _, p := range listPackages(t) {
		rel := strings.TrimPrefix(p.ImportPath, module+"/")
		layer, _, _ := strings.Cut(rel, "/")
		rules := append(forbidden[layer], forbidden[rel]...)
		if leaves[p.ImportPath] {
			rules = []string{module + "/"}
		}
		for _, dep := range p.Deps {
			if leaves[dep] {
				continue
			}
			for _, bad := range rules {
				if dep == bad || (strings.HasSuffix(bad, "/") && strings.HasPrefix(dep, bad)) || strings.HasPrefix(dep, bad+"/") {
					// routing may import itself
					if strings.HasPrefix(dep, module+"/routing") && layer == "routing" {
						continue
					}
					t.Errorf("%s imports %s (forbidden for %s)", p.ImportPath, dep, layer)
				}
			}
		}
	}
}

// Every package says what it owns and who may use it.
func TestPackageDocs(t *testing.T) {
	for _, p := range listPackages(t) {
		if strings.TrimSpace(p.Doc) == "" {
			t.Errorf("%s has no package comment", p.ImportPath)
		}
	}
}
