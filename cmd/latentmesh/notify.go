package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
)

// systemd (Type=notify): the agent says READY=1 once it is registered in
// etcd and has joined gossip, STATUS= what it serves or waits for, and
// STOPPING=1 when it drains. With WatchdogSec= ($WATCHDOG_USEC) it pings
// WATCHDOG=1 at half that interval while agent.Alive says its pull loops
// and its etcd session are alive, an etcd outage included, and stops once
// one is wedged, saying so in STATUS=: systemd then aborts the agent
// (SIGABRT: Go prints every goroutine's stack) and Restart= starts it
// again. go-systemd's daemon package speaks the protocol; outside systemd
// ($NOTIFY_SOCKET unset) every call is a no-op.

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
// with the engine and pings the watchdog until ctx ends.
func notifyReady(ctx context.Context, log *zap.Logger, a *agent.Agent) {
	var pinging chan struct{} // closed when the watchdog pings end
	defer func() { <-pinging }()
	for {
		changed := a.EngineChanged() // before the status is read
		state := "STATUS=" + engineStatus(a)
		if ctx.Err() == nil {
			notify(log, "READY=1\n"+state)
		}
		if pinging == nil { // after READY=1: systemd's watchdog runs from then on
			pinging = make(chan struct{})
			go func() {
				defer close(pinging)
				watchdog(ctx, log, a.Alive, func() string { return engineStatus(a) })
			}()
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

// watchdog pings WATCHDOG=1 every half of systemd's watchdog interval
// while alive is nil, until ctx ends; nothing without WatchdogSec=. Once
// alive fails it stops pinging and says why in STATUS=; should the loops
// come back before systemd acts, pings resume with the status restored.
func watchdog(ctx context.Context, log *zap.Logger, alive func() error, status func() string) {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		log.Warn("sd_watchdog: no watchdog pings", zap.Error(err))
		return
	}
	if interval <= 0 {
		return
	}
	t := time.NewTicker(interval / 2) // systemd's advice: half the interval
	defer t.Stop()
	var wedged error
	for ctx.Err() == nil {
		err := alive()
		switch {
		case err == nil && wedged != nil:
			log.Info("loops alive again: watchdog pings resume")
			notify(log, "WATCHDOG=1\nSTATUS="+status())
		case err == nil:
			notify(log, "WATCHDOG=1")
		case wedged == nil:
			log.Error("wedged: watchdog pings stop, systemd will abort and restart the agent", zap.Error(err))
			notify(log, "STATUS=wedged, watchdog pings stopped: "+err.Error())
		}
		wedged = err
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}

// notifyStopping tells systemd the agent drains: the stop has begun.
func notifyStopping(log *zap.Logger) {
	notify(log, "STOPPING=1\nSTATUS=draining: finishing or requeuing running tasks")
}
