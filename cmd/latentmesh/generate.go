package main

import (
	"context"
	"io"

	"github.com/latentmesh/latentmesh/agent/httpapi"
)

func runGenerate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return httpapi.RunGenerate(ctx, args, stdout, stderr)
}
