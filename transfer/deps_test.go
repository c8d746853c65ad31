package transfer

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoProjectImports keeps transfer at the bottom of the stack: it imports
// no other latentmesh package (not agent, cache, routing, nor its own
// transport subpackages, which build on it).
func TestNoProjectImports(t *testing.T) {
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
			if strings.HasPrefix(p, "github.com/latentmesh/latentmesh/") {
				t.Errorf("%s imports %s", f, p)
			}
		}
		if af.Doc != nil && strings.HasPrefix(af.Doc.Text(), "Package transfer") && f != "doc.go" {
			t.Errorf("%s: package doc belongs in doc.go", f)
		}
	}
}
