// Package bytesize parses and writes byte counts as people type them in
// flags and config ("4MiB", "16GiB", "64MB").
package bytesize

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// sizeUnits maps a size suffix (lower case) to its multiplier.
var sizeUnits = map[string]int64{
	"":    1,
	"b":   1,
	"kib": 1 << 10,
	"mib": 1 << 20,
	"gib": 1 << 30,
	"kb":  1e3,
	"mb":  1e6,
	"gb":  1e9,
}

// Parse parses a byte count such as "4MiB", "256MiB", "1GiB", "64MB" or
// "1048576". Units are case-insensitive; KiB/MiB/GiB are binary, KB/MB/GB
// decimal. The size must be positive.
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := strings.IndexFunc(t, func(r rune) bool { return r < '0' || r > '9' })
	if i < 0 {
		i = len(t)
	}
	if i == 0 {
		return 0, fmt.Errorf("bytesize: size %q: want a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB)", s)
	}
	mult, ok := sizeUnits[strings.ToLower(strings.TrimSpace(t[i:]))]
	if !ok {
		return 0, fmt.Errorf("bytesize: size %q: unknown unit %q (want B, KiB, MiB, GiB, KB, MB or GB)", s, t[i:])
	}
	n, err := strconv.ParseInt(t[:i], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("bytesize: size %q: %w", s, err)
	}
	if n <= 0 {
		return 0, fmt.Errorf("bytesize: size %q: must be positive", s)
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("bytesize: size %q: too large", s)
	}
	return n * mult, nil
}

// ParseList parses a comma-separated list of sizes, e.g. "4MiB,64MiB,1GiB".
func ParseList(s string) ([]int64, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("bytesize: empty size list")
	}
	var out []int64
	for _, f := range strings.Split(s, ",") {
		n, err := Parse(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// Format writes n in the largest binary unit that divides it exactly.
func Format(n int64) string {
	for _, u := range []struct {
		name string
		mult int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n >= u.mult && n%u.mult == 0 {
			return strconv.FormatInt(n/u.mult, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10) + "B"
}
