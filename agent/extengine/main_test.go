package extengine

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine the server starts (accept loop, connections, heartbeats,
// process watchers) must be gone after Close.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
