package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/latentmesh/latentmesh/agent/extengine"
)

// runEngine is `latentmesh engine check`: a conformance run of an external
// engine against the worker protocol.
func runEngine(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "check" {
		fmt.Fprintln(stderr, "usage: latentmesh engine check --socket PATH [flags] [-- COMMAND ARGS...]")
		return 2
	}
	def := extengine.DefaultCheckConfig("")
	fs := newFlagSet("engine check", "--socket PATH [flags] [-- COMMAND ARGS...]", stderr)
	var (
		socket   = fs.String("socket", "", "Unix socket `PATH` to listen on as an agent would (the engine connects to it)")
		steps    = fs.Int("steps", def.Steps, "least denoise steps of the cancellation check (more when steps are fast, up to the model's max_steps)")
		cancelAt = fs.Int("cancel-at", def.CancelAt, "cancel after this denoise step; the engine must stop within one more")
		regWait  = fs.Duration("register-timeout", def.RegisterTimeout, "how long the engine may take to load and register")
		taskWait = fs.Duration("task-timeout", def.TaskTimeout, "bound on each task")
		grace    = fs.Duration("cancel-grace", def.Server.CancelGrace, "how long a cancelled task may take to answer")
		lands    = fs.Duration("cancel-lands", def.CancelLands, "how long a cancel may take to reach the engine: one that runs past a cancel only sooner than this is too fast to judge (inconclusive)")
	)
	// Everything after "--" is the engine's command line, not our flags.
	flags, command := args[1:], []string(nil)
	if i := slices.Index(flags, "--"); i >= 0 {
		flags, command = flags[:i], flags[i+1:]
	}
	if code := parse(fs, flags); code >= 0 {
		return code
	}
	if *socket == "" || *steps < 2 || *cancelAt < 1 || *cancelAt >= *steps || *lands <= 0 {
		fmt.Fprintln(stderr, "latentmesh engine check: --socket is required, 1 <= --cancel-at < --steps, and --cancel-lands > 0")
		return 2
	}
	cfg := def
	cfg.Socket, cfg.Steps, cfg.CancelAt, cfg.CancelLands = *socket, *steps, *cancelAt, *lands
	cfg.RegisterTimeout, cfg.TaskTimeout, cfg.Server.CancelGrace = *regWait, *taskWait, *grace
	cfg.Command = command // the engine to start (enables the crash-restart check)
	start := time.Now()
	results, ok, err := extengine.Check(ctx, cfg, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh engine check: %v\n", err)
		return 1
	}
	passed, failed, skipped, unsure := 0, 0, 0, 0
	for _, r := range results {
		switch {
		case r.Skip:
			skipped++
		case r.Inconclusive:
			unsure++
		case r.Pass:
			passed++
		default:
			failed++
		}
	}
	fmt.Fprintf(stdout, "engine check: %d passed, %d failed, %d skipped, %d inconclusive in %v\n", passed, failed, skipped, unsure, time.Since(start).Round(time.Millisecond))
	if !ok {
		return 1
	}
	return 0
}
