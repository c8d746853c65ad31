package sim

import (
	"testing"
	"time"
)

func smallConfig(m Mode) Config {
	c := DefaultConfig()
	c.Mode = m
	c.GPUs = 100
	c.Duration = 10 * time.Minute
	c.CheckJobs = true
	// An etcd far from saturation, so the throughput check holds; the
	// measured figures saturate it at this size (docs/benchmarks.md).
	c.Etcd.WriteCap, c.Etcd.ReadCap, c.Etcd.WatchCreateCap, c.Etcd.EventCap = 1e6, 1e6, 1e6, 1e7
	return c
}

// A small run of every mode: every job completes exactly once, nothing is
// lost or made up, utilisation is a share, and a seed gives the same run.
func TestInvariants(t *testing.T) {
	for _, m := range Modes() {
		t.Run(m.String(), func(t *testing.T) {
			cfg := smallConfig(m)
			s, r := runSim(t, cfg)
			if r.Submitted == 0 || r.Completed != r.Submitted || r.Unfinished != 0 {
				t.Fatalf("submitted %d completed %d unfinished %d", r.Submitted, r.Completed, r.Unfinished)
			}
			if len(s.seen) != r.Submitted {
				t.Fatalf("%d distinct jobs completed, %d submitted", len(s.seen), r.Submitted)
			}
			for id, n := range s.seen {
				if n != 1 {
					t.Fatalf("job %d completed %d times", id, n)
				}
			}
			for _, st := range s.st {
				if st.free != len(st.workers) || len(st.waiting) != len(st.workers) || st.q.queued != 0 {
					t.Fatalf("stage %d not drained: free %d waiting %d queued %d of %d", st.i, st.free, len(st.waiting), st.q.queued, len(st.workers))
				}
			}
			if !(r.Utilisation > 0.5 && r.Utilisation <= 1) {
				t.Fatalf("utilisation %v", r.Utilisation)
			}
			want := cfg.Load * s.plan.Capacity
			if r.JobsPerSec < 0.9*want || r.JobsPerSec > 1.1*want {
				t.Fatalf("%.2f jobs/s, offered %.2f", r.JobsPerSec, want)
			}
			if m == Central && r.Conflicts != 0 {
				t.Fatalf("central dispatcher had %d claim conflicts", r.Conflicts)
			}
			_, r2 := runSim(t, cfg)
			r.WallSeconds, r2.WallSeconds = 0, 0
			if r != r2 {
				t.Fatalf("same seed, different runs:\n%+v\n%+v", r, r2)
			}
			t.Logf("%+v", r)
		})
	}
}

func runSim(t *testing.T, cfg Config) (*sim, Result) {
	t.Helper()
	s, err := newSim(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, s.run()
}
