package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// newFlagSet returns a flag set that reports errors instead of exiting.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("latentmesh "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: latentmesh %s %s\n\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses args and returns the exit code to use when parsing ended the
// command (-1 to go on).
func parse(fs *flag.FlagSet, args []string) int {
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

// simCost is the --sim-cost flag: simulated accelerator time per stage.
type simCost struct{ encode, step, decode time.Duration }

func (s *simCost) String() string {
	return fmt.Sprintf("encode=%v,step=%v,decode=%v", s.encode, s.step, s.decode)
}

func (s *simCost) Set(v string) error {
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
			s.encode = d
		case "step":
			s.step = d
		case "decode":
			s.decode = d
		default:
			return fmt.Errorf("unknown stage %q (want encode, step or decode)", k)
		}
	}
	return nil
}

func (s *simCost) apply(c *engine.Config) {
	c.EncodeCost, c.StepCost, c.DecodeCost = s.encode, s.step, s.decode
}

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
