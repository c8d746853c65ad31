package gossip

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoLatentmeshImports keeps gossip at the bottom of the stack: it may
// not import any other latentmesh package. Its tests may import
// testbed/attack, the hostile frames, which imports nothing of latentmesh.
func TestNoLatentmeshImports(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	docs := 0
	for _, name := range files {
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		if f.Doc != nil && strings.HasPrefix(f.Doc.Text(), "Package gossip ") {
			docs++
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasSuffix(name, "_test.go") && path == "github.com/latentmesh/latentmesh/testbed/attack" {
				continue
			}
			if path == "github.com/latentmesh/latentmesh/gossip/msgpackcheck" {
				continue // gossip's own leaf package, which imports nothing of latentmesh
			}
			if strings.HasPrefix(path, "github.com/latentmesh/latentmesh/") {
				t.Errorf("%s imports %s", name, path)
			}
		}
	}
	if docs != 1 {
		t.Errorf("%d files carry a package comment, want exactly one", docs)
	}
}
