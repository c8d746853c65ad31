// Package cli is what the latentmesh binaries (cmd/latentmesh and
// cmd/latentmesh-dev) share on the command line: the subcommand dispatch
// and process entry (Dispatch, Main), flag sets that report errors instead
// of exiting, the process logger, and the --sim-cost flag. Only those
// commands use it.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// NewFlagSet returns the flag set of `prog name`, which reports errors
// instead of exiting.
func NewFlagSet(prog, name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(prog+" "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: %s %s %s\n\n", prog, name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// Parse parses args and returns the exit code to use when parsing ended the
// command (-1 to go on): 0 for -h, 2 for bad flags or a stray argument.
func Parse(fs *flag.FlagSet, args []string) int {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		fs.Usage()
		return 2
	}
	return -1
}

// NewLogger builds the process logger: JSON for the daemon, console for
// people at a terminal.
func NewLogger(format string, verbose bool, stderr io.Writer) (*zap.Logger, error) {
	level := zapcore.InfoLevel
	if verbose {
		level = zapcore.DebugLevel
	}
	var enc zapcore.Encoder
	switch format {
	case "json":
		ec := zap.NewProductionEncoderConfig()
		ec.EncodeTime = zapcore.ISO8601TimeEncoder
		enc = zapcore.NewJSONEncoder(ec)
	case "console":
		ec := zap.NewDevelopmentEncoderConfig()
		ec.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		enc = zapcore.NewConsoleEncoder(ec)
	default:
		return nil, fmt.Errorf("unknown log format %q (want json or console)", format)
	}
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(stderr), level)), nil
}

// SimCost is the --sim-cost flag (`encode=5ms,step=20ms,decode=50ms`):
// simulated accelerator time per stage of the built-in engine.
type SimCost struct{ Encode, Step, Decode time.Duration }

func (s *SimCost) String() string {
	return fmt.Sprintf("encode=%v,step=%v,decode=%v", s.Encode, s.Step, s.Decode)
}

// Set parses key=duration pairs; keys left out keep their value.
func (s *SimCost) Set(v string) error {
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("want key=duration, got %q", kv)
		}
		d, err := time.ParseDuration(val)
		if err != nil || d < 0 {
			return fmt.Errorf("%s: bad duration %q", k, val)
		}
		switch k {
		case "encode":
			s.Encode = d
		case "step":
			s.Step = d
		case "decode":
			s.Decode = d
		default:
			return fmt.Errorf("unknown stage %q (want encode, step or decode)", k)
		}
	}
	return nil
}

// Apply sets the costs on an engine config.
func (s *SimCost) Apply(c *engine.Config) {
	c.EncodeCost, c.StepCost, c.DecodeCost = s.Encode, s.Step, s.Decode
}
