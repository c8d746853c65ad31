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
// no latentmesh package other than its own transport subpackages (arena, shm,
// rdma), which import nothing above them.
var allowedImports = map[string]bool{
	"github.com/latentmesh/latentmesh/transfer/arena": true,
	"github.com/latentmesh/latentmesh/transfer/shm":   true,
	"github.com/latentmesh/latentmesh/transfer/rdma":  true,
}

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
			if strings.HasPrefix(p, "github.com/latentmesh/latentmesh/") && !allowedImports[p] {
				t.Errorf("%s imports %s", f, p)
			}
		}
		if af.Doc != nil && strings.HasPrefix(af.Doc.Text(), "Package transfer") && f != "doc.go" {
			t.Errorf("%s: package doc belongs in doc.go", f)
		}
	}
}
