package agent

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/transfer"
)

// A decode stream's chunks reach the decoder in index order however they
// land, each once; one whose predecessor never lands is held back.
func TestInOrder(t *testing.T) {
	for _, tc := range []struct {
		landed, want []int
	}{
		{[]int{0, 1, 2, 3}, []int{0, 1, 2, 3}},
		{[]int{1, 0, 3, 2}, []int{0, 1, 2, 3}},
		{[]int{3, 2, 1, 0}, []int{0, 1, 2, 3}},
		{[]int{0, 2, 3}, []int{0}}, // chunk 1 never landed
	} {
		ch := make(chan transfer.Chunk, len(tc.landed))
		for _, k := range tc.landed {
			ch <- transfer.Chunk{Index: k}
		}
		close(ch)
		var got []int
		for c := range inOrder(ch) {
			got = append(got, c.Index)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("landed %v: decoded %v, want %v", tc.landed, got, tc.want)
		}
	}
}

// A node record's model entry lists the adapters its engine has loaded;
// routing reads them, and a record of another shape names none.
func TestAdvertises(t *testing.T) {
	rec, err := json.Marshal(modelRecord{Adapters: []string{"a1", "paint-v1"}})
	if err != nil {
		t.Fatal(err)
	}
	p := gossip.Peer{Record: gossip.NodeRecord{Models: map[string]json.RawMessage{"m": rec, "x": json.RawMessage(`{"adapters":7}`)}}}
	for _, tc := range []struct {
		model, adapter string
		want           bool
	}{
		{"m", "paint-v1", true}, {"m", "a2", false}, {"other", "paint-v1", false}, {"x", "7", false},
	} {
		if got := advertises(p, tc.model, tc.adapter); got != tc.want {
			t.Errorf("advertises(%s, %s) = %v, want %v", tc.model, tc.adapter, got, tc.want)
		}
	}
}
