package engine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"testing"
)

// run is one DenoiseWith call's outcome: the latent, the decoded file, the
// progress steps reported and the checkpoints taken.
type run struct {
	latent, file []byte
	steps        []int
	cks          []Checkpoint
	err          error
}

// denoise runs DenoiseWith with o (Progress and Checkpoint are filled in)
// and decodes the result when it completes. stopAt > 0 closes o.Stop from
// the progress callback of that step.
func denoise(t *testing.T, e *Engine, s Spec, cond Tensor, o DenoiseOptions, stopAt int) run {
	t.Helper()
	ctx := context.Background()
	var r run
	stop := make(chan struct{})
	if stopAt > 0 {
		o.Stop = stop
	}
	o.Progress = func(step, total int) {
		if total != s.Steps {
			t.Errorf("progress total %d, want %d", total, s.Steps)
		}
		r.steps = append(r.steps, step)
		if step == stopAt {
			close(stop)
		}
	}
	o.Checkpoint = func(ck Checkpoint) {
		// Through the encoding, as a store would keep it.
		b, err := ck.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		var back Checkpoint
		if err := back.UnmarshalBinary(b); err != nil {
			t.Fatal(err)
		}
		r.cks = append(r.cks, back)
	}
	dst := dirty(int(e.LatentMeta(s).Bytes()))
	if _, r.err = e.DenoiseWith(ctx, s, wire(cond), dst, o); r.err != nil {
		return r
	}
	r.latent = dst
	file, _, err := e.Decode(ctx, s, Tensor{Meta: e.LatentMeta(s), Data: dst})
	if err != nil {
		t.Fatal(err)
	}
	r.file = file
	return r
}

func encode(t *testing.T, e *Engine, s Spec) Tensor {
	t.Helper()
	cond, err := e.Encode(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	return cond
}

func span(from, to int) []int {
	var v []int
	for i := from; i <= to; i++ {
		v = append(v, i)
	}
	return v
}

// TestResumeByteIdentical resumes an image and a video from every
// checkpoint of a run and gets the run's latent and file, byte for byte,
// with progress from the step after the checkpoint's and the same later
// checkpoints.
func TestResumeByteIdentical(t *testing.T) {
	e := newEngine(t)
	for _, s := range []Spec{
		{Prompt: "a red fox in the snow", NegativePrompt: "blurry", Seed: 3, Width: 64, Height: 64, Frames: 1, Steps: 7, GuidanceScale: 5},
		{Prompt: "jellyfish", Seed: 5, Width: 64, Height: 80, Frames: 3, Steps: 5, GuidanceScale: 7},
	} {
		cond := encode(t, e, s)
		ref := denoise(t, e, s, cond, DenoiseOptions{CheckpointEvery: 1}, 0)
		if ref.err != nil {
			t.Fatal(ref.err)
		}
		plain := denoise(t, e, s, cond, DenoiseOptions{}, 0)
		if !bytes.Equal(plain.latent, ref.latent) {
			t.Fatal("taking checkpoints changed the latent")
		}
		if len(ref.cks) != s.Steps-1 {
			t.Fatalf("%d checkpoints for %d steps, want one after each but the last", len(ref.cks), s.Steps)
		}
		for k, ck := range ref.cks {
			if ck.Step != k+1 || ck.Total != s.Steps || ck.Sampler != "builtin/v4/ddim-cosine" {
				t.Fatalf("checkpoint %d: step %d of %d, sampler %q", k, ck.Step, ck.Total, ck.Sampler)
			}
			got := denoise(t, e, s, cond, DenoiseOptions{Resume: &ck, CheckpointEvery: 1}, 0)
			if got.err != nil {
				t.Fatalf("resume at %d: %v", ck.Step, got.err)
			}
			if !bytes.Equal(got.latent, ref.latent) || !bytes.Equal(got.file, ref.file) {
				t.Errorf("%d frames: resumed at step %d, the latent or the file differs", s.Frames, ck.Step)
			}
			if want := span(ck.Step+1, s.Steps); !slices.Equal(got.steps, want) {
				t.Errorf("resumed at step %d: progress %v, want %v", ck.Step, got.steps, want)
			}
			if len(got.cks) != len(ref.cks[k+1:]) {
				t.Fatalf("resumed at step %d: %d checkpoints, want %d", ck.Step, len(got.cks), len(ref.cks[k+1:]))
			}
			for j, c := range got.cks {
				if w := ref.cks[k+1+j]; c.Step != w.Step || !bytes.Equal(c.State, w.State) {
					t.Errorf("resumed at step %d: checkpoint at %d differs from the run's", ck.Step, c.Step)
				}
			}
		}
	}
}

// TestStop checks Stop: the sampler finishes its step, checkpoints it once,
// returns ErrStopped, and the checkpoint resumes to the run's bytes.
func TestStop(t *testing.T) {
	e := newEngine(t)
	s := small("a lighthouse at dusk", 2)
	cond := encode(t, e, s)
	ref := denoise(t, e, s, cond, DenoiseOptions{}, 0)
	for _, every := range []int{0, 3} { // 3: the stop's step is also a periodic one
		got := denoise(t, e, s, cond, DenoiseOptions{CheckpointEvery: every}, 3)
		if !errors.Is(got.err, ErrStopped) {
			t.Fatalf("every %d: %v, want ErrStopped", every, got.err)
		}
		if !slices.Equal(got.steps, span(1, 3)) || len(got.cks) != 1 || got.cks[0].Step != 3 {
			t.Fatalf("every %d: progress %v, checkpoints %d, want steps 1-3 and one checkpoint at 3", every, got.steps, len(got.cks))
		}
		res := denoise(t, e, s, cond, DenoiseOptions{Resume: &got.cks[0]}, 0)
		if res.err != nil || !bytes.Equal(res.file, ref.file) {
			t.Fatalf("every %d: resumed after a stop: %v, or the file differs", every, res.err)
		}
	}
	// Closed before the first step: nothing done, nothing to checkpoint.
	stop := make(chan struct{})
	close(stop)
	called := false
	_, err := e.DenoiseWith(context.Background(), s, cond, make([]byte, len(ref.latent)), DenoiseOptions{
		Stop: stop, Checkpoint: func(Checkpoint) { called = true },
	})
	if !errors.Is(err, ErrStopped) || called {
		t.Fatalf("stopped before the first step: %v, checkpoint called %v", err, called)
	}
	// Closed during the last step: the run is complete and says so.
	last := denoise(t, e, s, cond, DenoiseOptions{CheckpointEvery: 1}, s.Steps)
	if last.err != nil || !bytes.Equal(last.file, ref.file) || len(last.cks) != s.Steps-1 {
		t.Fatalf("stopped in the last step: %v, %d checkpoints", last.err, len(last.cks))
	}
}

// TestFork resumes a checkpoint of prompt A's run with prompt B's
// conditioning, another guidance and another step count.
func TestFork(t *testing.T) {
	e := newEngine(t)
	a := Spec{Prompt: "a red fox in the snow", Seed: 4, Width: 64, Height: 64, Frames: 1, Steps: 40, GuidanceScale: 5}
	b := a
	b.Prompt = "ocean waves at night"
	condA, condB := encode(t, e, a), encode(t, e, b)

	full := denoise(t, e, a, condA, DenoiseOptions{CheckpointEvery: 10}, 0)
	if full.err != nil || len(full.cks) != 3 || full.cks[1].Step != 20 {
		t.Fatalf("run A: %v, %d checkpoints", full.err, len(full.cks))
	}
	ck20 := full.cks[1]
	fork := denoise(t, e, b, condB, DenoiseOptions{Resume: &ck20}, 0)
	if fork.err != nil {
		t.Fatal(fork.err)
	}
	if !slices.Equal(fork.steps, span(21, 40)) {
		t.Errorf("fork progress %v", fork.steps)
	}
	// The reference: steps 1-20 with A's conditioning, stopped there, and
	// 21-40 with B's.
	stopped := denoise(t, e, a, condA, DenoiseOptions{}, 20)
	if !errors.Is(stopped.err, ErrStopped) || len(stopped.cks) != 1 {
		t.Fatalf("A stopped at 20: %v, %d checkpoints", stopped.err, len(stopped.cks))
	}
	ref := denoise(t, e, b, condB, DenoiseOptions{Resume: &stopped.cks[0]}, 0)
	if ref.err != nil || !bytes.Equal(fork.latent, ref.latent) || !bytes.Equal(fork.file, ref.file) {
		t.Fatalf("fork differs from A for 20 steps then B for 20: %v", ref.err)
	}
	// Not a pure-B run: the first 20 steps' latent carries on. But the
	// second half's prompt decides what the picture shows.
	pureB := denoise(t, e, b, condB, DenoiseOptions{}, 0)
	if bytes.Equal(fork.latent, pureB.latent) {
		t.Error("the fork's latent is a pure-B run's: the checkpoint was ignored")
	}
	img := decodePNG(t, fork.file)
	toA, toB := meanAbsDiff(img, decodePNG(t, full.file)), meanAbsDiff(img, decodePNG(t, pureB.file))
	if !(toB < toA) {
		t.Errorf("fork differs from pure B by %.1f and from pure A by %.1f: B's prompt should show", toB, toA)
	}

	// Another guidance scale continues the same latent.
	g := b
	g.GuidanceScale = 12
	if r := denoise(t, e, g, condB, DenoiseOptions{Resume: &ck20}, 0); r.err != nil || bytes.Equal(r.latent, fork.latent) {
		t.Errorf("fork with guidance 12: %v, or the same latent as at 5", r.err)
	}

	// Another step count: from t=0.5 to 0 in the steps left. Its own
	// checkpoints resume byte-identical.
	short := b
	short.Steps = 30
	r := denoise(t, e, short, condB, DenoiseOptions{Resume: &ck20, CheckpointEvery: 5}, 0)
	if r.err != nil || !slices.Equal(r.steps, span(21, 30)) || bytes.Equal(r.latent, fork.latent) {
		t.Fatalf("fork to 30 steps: %v, progress %v", r.err, r.steps)
	}
	if len(r.cks) != 1 || r.cks[0].Step != 25 || r.cks[0].Total != 30 {
		t.Fatalf("fork to 30 steps: checkpoints %+v", r.cks)
	}
	again := denoise(t, e, short, condB, DenoiseOptions{Resume: &r.cks[0]}, 0)
	if again.err != nil || !bytes.Equal(again.latent, r.latent) {
		t.Errorf("resuming the shortened fork's checkpoint: %v, or its latent differs", again.err)
	}
	for _, steps := range []int{20, 10} {
		short.Steps = steps
		if r := denoise(t, e, short, condB, DenoiseOptions{Resume: &ck20}, 0); !errors.Is(r.err, ErrBadCheckpoint) {
			t.Errorf("resume after step 20 with %d steps: %v, want ErrBadCheckpoint", steps, r.err)
		}
	}
}

// TestResumeRejects checks that a checkpoint that does not fit the spec or
// the engine is refused with ErrBadCheckpoint, never resumed or panicked on.
func TestResumeRejects(t *testing.T) {
	e := newEngine(t)
	s := small("a kite", 1)
	cond := encode(t, e, s)
	ref := denoise(t, e, s, cond, DenoiseOptions{CheckpointEvery: 4}, 0)
	if ref.err != nil || len(ref.cks) != 1 {
		t.Fatalf("%v, %d checkpoints", ref.err, len(ref.cks))
	}
	good := ref.cks[0]
	state := func(edit func([]byte) []byte) func(*Checkpoint, *Spec) {
		return func(c *Checkpoint, _ *Spec) { c.State = edit(bytes.Clone(c.State)) }
	}
	cases := []struct {
		name string
		edit func(*Checkpoint, *Spec)
	}{
		{"sampler", func(c *Checkpoint, _ *Spec) { c.Sampler = "builtin/v3/ddim-cosine" }},
		{"seed", func(_ *Checkpoint, s *Spec) { s.Seed++ }},
		{"width", func(_ *Checkpoint, s *Spec) { s.Width = 72 }},
		{"frames", func(_ *Checkpoint, s *Spec) { s.Frames = 2 }},
		{"steps done", func(_ *Checkpoint, s *Spec) { s.Steps = 4 }},
		{"step past total", func(c *Checkpoint, _ *Spec) { c.Step = c.Total }},
		{"no step", func(c *Checkpoint, _ *Spec) { c.Step = 0 }},
		{"empty state", state(func([]byte) []byte { return nil })},
		{"garbage state", state(func(b []byte) []byte { return bytes.Repeat([]byte{0x5a}, len(b)) })},
		{"state version", state(func(b []byte) []byte { b[4]++; return b })},
		{"short latent", state(func(b []byte) []byte { return b[:len(b)-8] })},
		{"long latent", state(func(b []byte) []byte { return append(b, make([]byte, 8)...) })},
		{"channels", state(func(b []byte) []byte { b[25]++; return b })},
		{"schedule start", state(func(b []byte) []byte { b[29] = 9; return b })},
		{"schedule time", state(func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[33:], math.Float64bits(math.NaN()))
			return b
		})},
		{"nan latent", state(func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[len(b)-8:], math.Float64bits(math.Inf(1)))
			return b
		})},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ck, sp := good, s
			ck.State = bytes.Clone(good.State)
			tc.edit(&ck, &sp)
			c := cond
			if sp.Width != s.Width || sp.Frames != s.Frames {
				c = encode(t, e, sp)
			}
			r := denoise(t, e, sp, c, DenoiseOptions{Resume: &ck}, 0)
			if !errors.Is(r.err, ErrBadCheckpoint) {
				t.Fatalf("%v, want ErrBadCheckpoint", r.err)
			}
			t.Log(r.err)
		})
	}
}

func TestCheckpointEncoding(t *testing.T) {
	ck := Checkpoint{Sampler: "builtin/v4/ddim-cosine", Step: 3, Total: 8, State: []byte{1, 2, 3, 4, 5}}
	b, err := ck.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var back Checkpoint
	if err := back.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if back.Sampler != ck.Sampler || back.Step != 3 || back.Total != 8 || !bytes.Equal(back.State, ck.State) {
		t.Fatalf("round trip %+v", back)
	}
	b[len(b)-6]++ // in the state
	if err := back.UnmarshalBinary(b); !errors.Is(err, ErrBadCheckpoint) {
		t.Fatalf("damaged: %v", err)
	}
	for _, bad := range []Checkpoint{
		{Sampler: "", Step: 1, Total: 2},
		{Sampler: string(make([]byte, maxSamplerLen+1)), Step: 1, Total: 2},
		{Sampler: "s", Step: 2, Total: 2},
		{Sampler: "s", Step: 1, Total: maxCheckpointSteps + 1},
	} {
		if _, err := bad.MarshalBinary(); !errors.Is(err, ErrBadCheckpoint) {
			t.Errorf("%.20q step %d of %d: %v", bad.Sampler, bad.Step, bad.Total, err)
		}
	}
}

func FuzzCheckpoint(f *testing.F) {
	e := newEngine(f)
	s := Spec{Prompt: "x", Seed: 1, Width: 64, Height: 64, Frames: 1, Steps: 3, GuidanceScale: 5}
	cond, err := e.Encode(context.Background(), s)
	if err != nil {
		f.Fatal(err)
	}
	var seed []byte
	if _, err := e.DenoiseWith(context.Background(), s, cond, make([]byte, e.LatentMeta(s).Bytes()), DenoiseOptions{
		CheckpointEvery: 1,
		Checkpoint: func(ck Checkpoint) {
			if seed == nil {
				seed, _ = ck.MarshalBinary()
			}
		},
	}); err != nil {
		f.Fatal(err)
	}
	f.Add(seed)
	f.Add(seed[:40])
	f.Add([]byte("LMCK\x01"))
	dst := make([]byte, e.LatentMeta(s).Bytes())
	f.Add(seed[6+len("builtin/v4/ddim-cosine")+12 : len(seed)-4]) // the bare state
	resume := func(t *testing.T, ck *Checkpoint) {
		// Whatever decodes must resume or be refused, never panic.
		if _, err := e.DenoiseWith(context.Background(), s, cond, dst, DenoiseOptions{Resume: ck}); err != nil && !errors.Is(err, ErrBadCheckpoint) {
			t.Fatalf("resume: %v", err)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var ck Checkpoint
		if err := ck.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrBadCheckpoint) {
				t.Fatalf("error %v is not ErrBadCheckpoint", err)
			}
			// The checksum keeps mutations from reaching the state's
			// decoder through the encoding, so feed it b directly too.
			resume(t, &Checkpoint{Sampler: e.samplerName(), Step: 1, Total: s.Steps, State: b})
			return
		}
		again, err := ck.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("decoded checkpoint re-encodes differently: %v", err)
		}
		resume(t, &ck)
	})
}
