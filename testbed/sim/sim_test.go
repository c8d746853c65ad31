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

// The mesh's etcd ops per job are the new claim loop's (docs/benchmarks.md,
// "What a job costs etcd"): waking workers reads nothing and opens no watch,
// so the only watches are the client's long poll and a cancel watch per
// stage, and every write is the submit, a claim per stage, a claim per
// conflict, the denoise progress and a commit per stage.
func TestMeshEtcdOpsPerJob(t *testing.T) {
	for _, m := range []Mode{Mesh, MeshNoHints} {
		t.Run(m.String(), func(t *testing.T) {
			s, r := runSim(t, smallConfig(m))
			jobs := uint64(r.Completed)
			if s.etcd.watches != 4*jobs {
				t.Fatalf("%d watches for %d jobs, want 4 per job", s.etcd.watches, jobs)
			}
			want := jobs*(1+3+3+uint64(s.progressWritesPerDenoise())) + r.Conflicts
			if s.etcd.writes != want {
				t.Fatalf("%d writes, want %d (%d jobs, %d conflicts)", s.etcd.writes, want, jobs, r.Conflicts)
			}
			// Per job: the long poll's read, a cancel watch's read per
			// stage, a ticket check per pulled input; the rest is the
			// agents' background.
			background := s.etcd.reads - 6*jobs
			perAgentPerSec := float64(background) / float64(r.GPUs) / r.Duration.Seconds()
			if perAgentPerSec < 0.45 || perAgentPerSec > 0.55 {
				t.Fatalf("background reads %.3f per agent per second, want 0.5 (0.2 safety net, 0.3 keepalive)", perAgentPerSec)
			}
		})
	}
}
