package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/coreos/go-systemd/v22/daemon"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
)

// systemd (Type=notify): the agent says READY=1 once it is registered in
// etcd and has joined gossip, STATUS= what it serves or waits for, and
// STOPPING=1 when it drains. go-systemd's daemon.SdNotify speaks the
// protocol; outside systemd ($NOTIFY_SOCKET unset) every call is a no-op.

// notify sends one state to systemd; a failure is logged, never fatal.
func notify(log *zap.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		log.Warn("sd_notify", zap.String("state", state), zap.Error(err))
	}
}

// engineStatus is the STATUS= line for what a has to serve: the built-in
// engine, an external engine's models, or the socket it waits on.
func engineStatus(a *agent.Agent) string {
	sock := a.EngineSocket()
	if sock == "" {
		return "serving the built-in engine"
	}
	reg := a.Engine()
	if reg == nil {
		return "ready; waiting for an engine on " + sock
	}
	models := make([]string, 0, len(reg.Models))
	for _, m := range reg.Models {
		models = append(models, m.Name)
	}
	return fmt.Sprintf("serving %s from engine %s (pid %d)", strings.Join(models, ", "), reg.Engine, reg.PID)
}

// notifyReady says READY=1 with the status, then keeps STATUS= in step
// with the engine until ctx ends.
func notifyReady(ctx context.Context, log *zap.Logger, a *agent.Agent) {
	for {
		changed := a.EngineChanged() // before the status is read
		state := "STATUS=" + engineStatus(a)
		if ctx.Err() == nil {
			notify(log, "READY=1\n"+state)
		}
		if changed == nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

// notifyStopping tells systemd the agent drains: the stop has begun.
func notifyStopping(log *zap.Logger) {
	notify(log, "STOPPING=1\nSTATUS=draining: finishing or requeuing running tasks")
}
