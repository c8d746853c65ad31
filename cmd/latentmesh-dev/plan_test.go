package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// plan with a conditioning cache's hit rates sizes the encode pool with
// and without it.
func TestPlanCached(t *testing.T) {
	code, out, errOut := runCmd("plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "16", "--rate", "4", "--prompt-hit-rate", "0.5", "--negative-hit-rate", "0.9", "--json")
	var p struct {
		Cache struct {
			EncodeGPUs [2]int `json:"encode_gpus"`
			Pools      string `json:"pools"`
		} `json:"cache"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &p) != nil || p.Cache.EncodeGPUs != [2]int{3, 1} || p.Cache.Pools != "1:14:1" {
		t.Fatalf("plan --json with hit rates: %d %q %q", code, out, errOut)
	}
	if code, _, errOut := runCmd("plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "16", "--prompt-hit-rate", "1.5"); code != 2 || !strings.Contains(errOut, "want 0 to 1") {
		t.Fatalf("hit rate 1.5: %d %q", code, errOut)
	}
}
