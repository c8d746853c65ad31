package agent

import (
	"fmt"
	"slices"
	"testing"
)

// The ring keeps the newest recentCap ids, newest first, each once.
func TestRecentJobsRing(t *testing.T) {
	var r recentJobs
	for i := range recentCap + 10 {
		r.note(fmt.Sprintf("job%d", i))
	}
	r.note("job20") // seen again: moves to the front
	got := r.newest(3)
	if want := []string{"job20", fmt.Sprintf("job%d", recentCap+9), fmt.Sprintf("job%d", recentCap+8)}; !slices.Equal(got, want) {
		t.Fatalf("newest(3) = %v, want %v", got, want)
	}
	all := r.newest(1000)
	if len(all) != recentCap {
		t.Fatalf("kept %d ids, want %d", len(all), recentCap)
	}
	if slices.Contains(all, "job0") || slices.Index(all, "job20") != 0 || len(slices.Compact(slices.Sorted(slices.Values(all)))) != recentCap {
		t.Fatalf("ring %v: want the oldest dropped, job20 first, no repeats", all)
	}
	if n := len(r.newest(0)); n != 0 {
		t.Fatalf("newest(0) gave %d ids", n)
	}
}
