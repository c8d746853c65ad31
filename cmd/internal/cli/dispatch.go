package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// A Command runs one subcommand and returns its exit code: 0 ok, 1
// failure, 2 bad usage.
type Command func(ctx context.Context, args []string, stdout, stderr io.Writer) int

// Main runs run with the process's arguments and a context that SIGINT and
// SIGTERM cancel, and exits with its code.
func Main(run func(ctx context.Context, args []string, stdout, stderr io.Writer) int) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Dispatch runs the subcommand args[0] of prog from cmds: usage on -h or
// with no command, a clear error on an unknown one.
func Dispatch(ctx context.Context, prog, usage string, cmds map[string]Command, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	cmd, ok := cmds[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "%s: unknown command %q\n\n%s", prog, args[0], usage)
		return 2
	}
	return cmd(ctx, args[1:], stdout, stderr)
}
