package sim

import (
	"testing"
	"time"
)

// BenchmarkMesh1000 is one simulated minute of 1,000 GPUs on the mesh;
// `latentmesh-dev sim --gpus 10000` times the full hour.
func BenchmarkMesh1000(b *testing.B) {
	cfg := DefaultConfig()
	cfg.Duration = time.Minute
	for b.Loop() {
		if _, err := Run(cfg); err != nil {
			b.Fatal(err)
		}
	}
}
