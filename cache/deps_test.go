package cache

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoProjectImports keeps cache beside transfer: it imports transfer (and
// its arena) and etcd, never agent or anything above it. Tests may use
// agent/etcdembed, which imports nothing of ours.
func TestNoProjectImports(t *testing.T) {
	allowed := map[string]bool{
		"github.com/latentmesh/latentmesh/transfer":       true,
		"github.com/latentmesh/latentmesh/transfer/arena": true,
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range af.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(p, "github.com/latentmesh/latentmesh/") && !allowed[p] {
				t.Errorf("%s imports %s", f, p)
			}
		}
		if af.Doc != nil && strings.HasPrefix(af.Doc.Text(), "Package cache") && f != "doc.go" {
			t.Errorf("%s: package doc belongs in doc.go", f)
		}
	}
}
