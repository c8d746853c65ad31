package main

import (
	"context"
	"fmt"
	"io"

	"github.com/latentmesh/latentmesh/agent"
)

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("version", "", stderr)
	if code := parse(fs, args); code >= 0 {
		return code
	}
	fmt.Fprintln(stdout, "latentmesh", agent.Version)
	return 0
}
