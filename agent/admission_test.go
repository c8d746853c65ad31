package agent

import (
	"math"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// A worker offers producers no credit beyond its admission: once its
// share of the next stage's budget is full, it grants none of its free
// slots and gossips no queue credit. Not where it is the stage's only
// worker (what is pushed to it waits in its inbox, never given back), nor
// for a stage admission does not bound (the last).
func TestCreditGoesNoFurtherThanAdmission(t *testing.T) {
	ctx, a, cli, _ := startRunning(t, "adm-1", nil)
	// The worker's loop computes its quota as it looks for work; until
	// then nothing caps the credit.
	for a.quota[jobs.Denoise].Load() < 0 {
		if ctx.Err() != nil {
			t.Fatal("admission never computed a quota")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := a.admissionRoom(jobs.Denoise); got != math.MaxInt {
		t.Fatalf("the stage's only worker: admission room %d, want no bound", got)
	}
	// A second denoise worker joins.
	cfg := DefaultLocalConfig()
	cfg.NodeID, cfg.Roles = "adm-2", []jobs.Stage{jobs.Denoise}
	cfg.HTTPListen, cfg.AdminListen = "", ""
	b, err := New(cfg, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for !a.otherWorker(jobs.Denoise) {
		if ctx.Err() != nil {
			t.Fatal("the second denoise worker never showed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Its quota is a share among two producers now.
	for n := a.quota[jobs.Denoise].Load(); ; n = a.quota[jobs.Denoise].Load() {
		if got := a.admissionRoom(jobs.Denoise); got != math.MaxInt && got == int(n) {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("admission room %d with a second worker, want the quota %d", a.admissionRoom(jobs.Denoise), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	quota := int(a.quota[jobs.Denoise].Load())
	if quota < 1 {
		t.Fatalf("denoise quota %d, want at least one", quota)
	}
	_, free := a.slots(jobs.Denoise)
	if got := a.grantable(jobs.Denoise); free == 0 || got != min(free, quota) {
		t.Fatalf("idle: %d denoise slots grantable, want %d (free %d, quota %d)", got, min(free, quota), free, quota)
	}
	// Its outputs' commits fill the share: nothing to grant, no queue
	// credit, though its slots are free.
	uncount := make([]func(), quota)
	for i := range uncount {
		uncount[i] = a.countCommitting(jobs.Denoise)
	}
	if got := a.admissionRoom(jobs.Denoise); got != 0 {
		t.Fatalf("share full: admission room %d, want 0", got)
	}
	if g, q := a.grantable(jobs.Denoise), a.queueCredit(jobs.Denoise); g != 0 || q != 0 {
		t.Fatalf("share full: %d slots grantable, %d queue credit; want none", g, q)
	}
	// One commit done with no output downstream yet counted (the ledger
	// counts it once the commit lands): one task's room again.
	uncount[0]()
	if got := a.admissionRoom(jobs.Denoise); got != 1 {
		t.Fatalf("one share free: admission room %d, want 1", got)
	}
	for _, u := range uncount[1:] {
		u()
	}
	// Decode feeds no stage: admission does not bound it.
	if got := a.admissionRoom(jobs.Decode); got != math.MaxInt {
		t.Fatalf("decode's admission room %d, want no bound", got)
	}
}
