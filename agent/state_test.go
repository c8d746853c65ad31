package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// A state directory keeps the node id chosen on first start, and gives
// the agent its key file and the Store's disk tier unless they were set.
func TestStateDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	cfg := DefaultConfig()
	cfg.StateDir = dir
	got, err := cfg.applyStateDir()
	if err != nil {
		t.Fatal(err)
	}
	if got.IdentityFile != filepath.Join(dir, stateIdentity) || got.Store.SpillDir != filepath.Join(dir, stateStore) ||
		got.Store.SpillCapacity != StateSpillCapacity {
		t.Fatalf("identity %q spill %q (%d)", got.IdentityFile, got.Store.SpillDir, got.Store.SpillCapacity)
	}
	cfg.IdentityFile, cfg.Store.SpillDir, cfg.Store.SpillCapacity = "/k", "/spill", 5
	if got, _ := cfg.applyStateDir(); got.IdentityFile != "/k" || got.Store.SpillDir != "/spill" || got.Store.SpillCapacity != 5 {
		t.Fatalf("set values replaced: %+v", got.Store)
	}
	first, err := stateNodeIDOf(dir, "host-abc123")
	if err != nil || first != "host-abc123" {
		t.Fatalf("first start: %q %v", first, err)
	}
	again, err := stateNodeIDOf(dir, "host-def456") // a new key would derive another
	if err != nil || again != "host-abc123" {
		t.Fatalf("restart: %q %v, want the first id", again, err)
	}
	if err := os.WriteFile(filepath.Join(dir, stateNodeID), []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := stateNodeIDOf(dir, "x"); err == nil {
		t.Fatal("an empty node-id file was accepted")
	}
}
