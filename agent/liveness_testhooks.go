//go:build latentmesh_testhooks

package agent

import (
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
)

// A binary built with -tags latentmesh_testhooks can wedge one watched
// loop, for the watchdog test (cmd/latentmesh TestSystemdUnitLifecycle):
// $TESTHOOK_WEDGE_LOOP names the loop ("pull encode", "etcd session"; not
// a LATENTMESH_ variable, which the options read). Each SIGUSR1 toggles the
// wedge, which holds the loop at its next beat, as a call that does not
// return would, until the next SIGUSR1. Each toggle is said on stderr
// ("testhook: pull encode wedged", "... released") for the test to wait on.
// No production build has this file.

// wedge is the test build's only state: the gate a wedged loop waits on.
var wedge struct {
	loop string
	mu   sync.Mutex    // guards gate
	gate chan struct{} // nil: not wedged; else closed when the wedge ends
}

func init() {
	wedge.loop = os.Getenv("TESTHOOK_WEDGE_LOOP")
	if wedge.loop == "" {
		return
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	go func() { // lives as long as the test binary's process
		for range sig {
			wedge.mu.Lock()
			if wedge.gate == nil {
				wedge.gate = make(chan struct{})
				fmt.Fprintf(os.Stderr, "testhook: %s wedged\n", wedge.loop)
			} else {
				close(wedge.gate)
				wedge.gate = nil
				fmt.Fprintf(os.Stderr, "testhook: %s released\n", wedge.loop)
			}
			wedge.mu.Unlock()
		}
	}()
}

func wedgePoint(loop string) {
	if loop != wedge.loop {
		return
	}
	wedge.mu.Lock()
	gate := wedge.gate
	wedge.mu.Unlock()
	if gate != nil {
		<-gate
	}
}
