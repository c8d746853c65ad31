package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// The state directory (Config.StateDir) is what an agent keeps across
// restarts, as a node of its own:
//
//	identity.key  the libp2p key: the node's peer id (unless IdentityFile is set)
//	node-id       the node id chosen on first start (unless NodeID is set)
//	store/        the Store's disk tier (unless Store.SpillDir is set): spilled
//	              copies, and durable copies of results, which the next run
//	              verifies and serves again
//
// Without one (tests, the demo) an agent is new at every start.
const (
	stateIdentity = "identity.key"
	stateNodeID   = "node-id"
	stateStore    = "store"
)

// StateSpillCapacity is the disk tier's size when the state directory
// holds it and no capacity was given: a day of results (ResultTTL) at a
// few thousand images an hour, and the spill of a busy node.
const StateSpillCapacity = 16 << 30

// applyStateDir fills what the state directory provides and the config
// left unset, creating the directory.
func (c Config) applyStateDir() (Config, error) {
	if c.StateDir == "" {
		return c, nil
	}
	if err := os.MkdirAll(c.StateDir, 0o700); err != nil {
		return c, fmt.Errorf("agent: state dir: %w", err)
	}
	if c.IdentityFile == "" {
		c.IdentityFile = filepath.Join(c.StateDir, stateIdentity)
	}
	if c.Store.SpillDir == "" {
		c.Store.SpillDir = filepath.Join(c.StateDir, stateStore)
		if c.Store.SpillCapacity == 0 {
			c.Store.SpillCapacity = StateSpillCapacity
		}
	}
	return c, nil
}

// stateNodeIDOf returns the node id kept in dir, writing derived there on
// first start.
func stateNodeIDOf(dir, derived string) (string, error) {
	path := filepath.Join(dir, stateNodeID)
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		id := strings.TrimSpace(string(b))
		if id == "" {
			return "", fmt.Errorf("agent: %s is empty", path)
		}
		return id, nil
	case !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("agent: node id: %w", err)
	}
	if err := os.WriteFile(path, []byte(derived+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("agent: write node id: %w", err)
	}
	return derived, nil
}
