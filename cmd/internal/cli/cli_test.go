package cli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
)

func TestParseExitCodes(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string // in the flag set's output
	}{
		{[]string{"-n", "3"}, -1, ""},
		{[]string{"-h"}, 0, "usage: prog cmd [flags]"},
		{[]string{"-n", "many"}, 2, "invalid value"},
		{[]string{"extra"}, 2, `unexpected argument "extra"`},
	}
	for _, tc := range tests {
		var out bytes.Buffer
		fs := NewFlagSet("prog", "cmd", "[flags]", &out)
		fs.Int("n", 0, "a number")
		if code := Parse(fs, tc.args); code != tc.code || !strings.Contains(out.String(), tc.want) {
			t.Errorf("%q: code %d, output %q; want %d and %q", tc.args, code, out.String(), tc.code, tc.want)
		}
	}
}

func TestSimCost(t *testing.T) {
	var s SimCost
	if err := s.Set("encode=5ms,decode=50ms"); err != nil {
		t.Fatal(err)
	}
	if err := s.Set("step=20ms"); err != nil {
		t.Fatal(err)
	}
	var c engine.Config
	s.Apply(&c)
	if c.EncodeCost != 5*time.Millisecond || c.StepCost != 20*time.Millisecond || c.DecodeCost != 50*time.Millisecond {
		t.Fatalf("applied %v %v %v", c.EncodeCost, c.StepCost, c.DecodeCost)
	}
	for _, bad := range []string{"step", "step=fast", "step=-1s", "paint=1s"} {
		if err := s.Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
	if _, err := NewLogger("xml", false, &bytes.Buffer{}); err == nil {
		t.Error("NewLogger took format xml")
	}
}
