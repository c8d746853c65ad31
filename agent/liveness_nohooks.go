//go:build !latentmesh_testhooks

package agent

// wedgePoint is where a binary built for the watchdog test wedges a loop
// (liveness_testhooks.go); in every other build it does nothing.
func wedgePoint(string) {}
