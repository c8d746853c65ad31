package bench

import (
	"encoding/binary"
	"slices"
	"time"
)

// summary is the median, minimum and maximum of a set of samples.
type summary struct{ median, min, max float64 }

// summarize returns the summary of xs; the median of an even count is the
// mean of the middle two. An empty xs gives zeros.
func summarize(xs []float64) summary {
	if len(xs) == 0 {
		return summary{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + m) / 2
	}
	return summary{median: m, min: s[0], max: s[len(s)-1]}
}

// gbps is bytes moved in d, in GB/s (GB = 1e9 bytes).
func gbps(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		d = time.Nanosecond
	}
	return float64(bytes) / d.Seconds() / 1e9
}

// ms is d in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// touch writes one byte per page of b so that its pages are faulted in
// before any timed copy lands in them.
func touch(b []byte) {
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1
	}
}

// fill writes a cheap pseudo-random pattern (xorshift64) into b.
func fill(b []byte, seed uint64) {
	x := seed | 1
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(w[:], x)
		copy(b[i:], w[:])
	}
}
