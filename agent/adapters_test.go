package agent

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/gossip"
)

// Adapters ride in the node record's model entry (gossip meta has 512
// bytes, all but taken by the models served): a model with its limits, an
// encoder version, a parameter and the most adapters an engine may load,
// each of the longest name, stays within what a record entry may hold.
func TestAdapterRecordSize(t *testing.T) {
	l := engine.DefaultLimits()
	l.MaxSide, l.MaxPixels, l.MaxFramePixels, l.FrameStep, l.FrameOffset, l.SideMultiple = 16384, 1<<31, 1<<28, 4, 1, 16
	rec := modelRecord{Limits: l, Encoder: "diffusers-wan2.1-t2v-14b/0.3.1", SplitCond: true, Temporal: 4,
		Inputs: engine.ModelInputs{Params: []engine.ParamSpec{{Name: "guidance_rescale", Type: "number", Min: 0, Max: 1, Default: engine.NumberParam(0)}},
			Image: &engine.ImageInput{Required: true}}}
	for i := range extengine.MaxAdapters {
		rec.Adapters = append(rec.Adapters, fmt.Sprintf("%02d%s", i, strings.Repeat("x", engine.MaxAdapterLen-2)))
	}
	b, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("a model entry with %d adapters of %d bytes: %d bytes of JSON (at most %d)", extengine.MaxAdapters, engine.MaxAdapterLen, len(b), gossip.MaxRecordModelSize)
	if len(b) > gossip.MaxRecordModelSize {
		t.Fatalf("a model entry with %d adapters is %d bytes, more than a record entry's %d", extengine.MaxAdapters, len(b), gossip.MaxRecordModelSize)
	}
}
