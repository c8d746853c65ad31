package rdma

import (
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestImports keeps the package at the bottom of the data plane: it may not
// import any latentmesh package (not even the transfer root or its arena).
func TestImports(t *testing.T) {
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".go") {
			continue
		}
		f, err := parser.ParseFile(fset, e.Name(), nil, parser.ImportsOnly|parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(e.Name(), "_test.go") && e.Name() != "doc.go" && f.Doc != nil {
			t.Errorf("%s: package comment belongs in doc.go", e.Name())
		}
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if strings.HasPrefix(p, "github.com/latentmesh/latentmesh") {
				t.Errorf("%s imports %s", e.Name(), p)
			}
		}
	}
}
