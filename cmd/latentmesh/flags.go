package main

import (
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cmd/internal/cli"
)

// The flag set, parser and --sim-cost flag are cmd/internal/cli's, which
// latentmesh-dev shares.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	return cli.NewFlagSet("latentmesh", name, synopsis, stderr)
}

func parse(fs *flag.FlagSet, args []string) int { return cli.Parse(fs, args) }

type simCost = cli.SimCost

// slotsFlag is --slots encode=4,denoise=1,decode=2.
type slotsFlag map[jobs.Stage]int

func (s slotsFlag) String() string {
	var parts []string
	for _, st := range jobs.Stages() {
		if n, ok := s[st]; ok {
			parts = append(parts, fmt.Sprintf("%s=%d", st, n))
		}
	}
	return strings.Join(parts, ",")
}

func (s slotsFlag) Set(v string) error {
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("want stage=count, got %q", kv)
		}
		roles, err := agent.ParseRoles([]string{k})
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(val)
		if err != nil || n < 1 || n > 1024 {
			return fmt.Errorf("%s: slot count %q not in [1,1024]", k, val)
		}
		s[roles[0]] = n
	}
	return nil
}

// newLogger builds the process logger: JSON for the daemon, console for
// people at a terminal.
func newLogger(format string, verbose bool, stderr io.Writer) (*zap.Logger, error) {
	return cli.NewLogger(format, verbose, stderr)
}
