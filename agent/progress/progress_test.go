package progress

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/p2ptest"
)

// get is the job's latest step on b, false when no stage of it runs or
// just ran there; running counts the stages not ended. The agent asks a
// board only through Next; these look inside.
func get(b *Board, job string) (Step, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e := b.jobs[job]; e != nil {
		return e.step, true
	}
	return Step{}, false
}

func running(b *Board) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, e := range b.jobs {
		if !e.ended {
			n++
		}
	}
	return n
}

func TestBoardNextWakesOnStepAndEnd(t *testing.T) {
	b := NewBoard()
	b.linger = 50 * time.Millisecond
	if _, ok := get(b, "j"); ok {
		t.Fatal("an empty board has a job")
	}
	report, end := b.Start("j", "denoise", 50)
	first, _ := get(b, "j")
	run := first.Run
	if run == 0 {
		t.Fatal("a run without an id")
	}
	at := func(step int) Cursor { return Cursor{Run: run, Step: step} }
	// A cursor of another run has seen nothing: answered at once.
	if st, ok := b.Next(context.Background(), "j", Cursor{}); !ok || st.Step != 0 || st.Run != run {
		t.Fatalf("Next(zero cursor) = %+v %v, want step 0 of the run at once", st, ok)
	}
	got := make(chan Step, 1)
	go func() {
		st, ok := b.Next(context.Background(), "j", at(0))
		if !ok {
			t.Error("Next: not running")
		}
		got <- st
	}()
	time.Sleep(10 * time.Millisecond) // let it wait (a race here only makes the test weaker)
	report(1, 50)
	st := <-got
	if st.Step != 1 || st.Total != 50 || st.Stage != "denoise" || st.At.IsZero() {
		t.Fatalf("Next = %+v, want step 1 of 50 with a time", st)
	}
	// A step already past after is answered at once.
	if st, ok := b.Next(context.Background(), "j", at(0)); !ok || st.Step != 1 {
		t.Fatalf("Next(after 0) = %+v %v", st, ok)
	}
	done := make(chan bool, 1)
	go func() {
		_, ok := b.Next(context.Background(), "j", at(1))
		done <- ok
	}()
	time.Sleep(10 * time.Millisecond)
	end()
	if <-done {
		t.Fatal("Next woken by the end says more steps will come")
	}
	report(2, 50) // after end: ignored, no panic
	if running(b) != 0 {
		t.Fatal("an ended stage still counts as running")
	}
	// A follower that asks after the end still gets the last step.
	if st, ok := b.Next(context.Background(), "j", at(0)); !ok || st.Step != 1 {
		t.Fatalf("Next(after 0) once ended = %+v %v, want the last step", st, ok)
	}
	if st, ok := b.Next(context.Background(), "j", Cursor{}); !ok || st.Step != 1 {
		t.Fatalf("Next(zero cursor) once ended = %+v %v, want the last step", st, ok)
	}
	if _, ok := b.Next(context.Background(), "j", at(1)); ok {
		t.Fatal("Next past the last step of an ended run says more will come")
	}
	if st, ok := get(b, "j"); !ok || st.Step != 1 {
		t.Fatalf("Get once ended = %+v %v, want the last step while it lingers", st, ok)
	}
	end() // twice: a no-op
	time.Sleep(200 * time.Millisecond)
	if _, ok := get(b, "j"); ok {
		t.Fatal("an ended stage stayed on the board past its linger")
	}
}

func TestBoardNextHonoursContext(t *testing.T) {
	b := NewBoard()
	report, end := b.Start("j", "denoise", 3)
	defer end()
	report(2, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	cur, _ := get(b, "j")
	st, ok := b.Next(ctx, "j", Cursor{Run: cur.Run, Step: 2})
	if !ok || st.Step != 2 {
		t.Fatalf("Next at the deadline = %+v %v, want step 2 still running", st, ok)
	}
}

func TestBoardRestartReplacesAttempt(t *testing.T) {
	b := NewBoard()
	report1, end1 := b.Start("j", "denoise", 10)
	report1(7, 10)
	r1, _ := get(b, "j")
	report2, end2 := b.Start("j", "denoise", 10) // attempt 2 on the same node
	report1(8, 10)                               // the old attempt's late step: ignored
	if st, _ := get(b, "j"); st.Step != 0 {
		t.Fatalf("after a restart the step is %d, want 0", st.Step)
	}
	end1() // the old attempt's end must not remove the new one
	if _, ok := get(b, "j"); !ok || running(b) != 1 {
		t.Fatal("the old attempt's end removed the new attempt")
	}
	old := Cursor{Run: r1.Run, Step: 7}
	if st, _ := get(b, "j"); st.Run <= r1.Run {
		t.Fatalf("the new attempt's run %d does not follow the old one's %d", st.Run, r1.Run)
	}
	report2(1, 10)
	st, ok := b.Next(context.Background(), "j", old)
	if !ok || st.Step != 1 {
		t.Fatalf("step %+v, want the new attempt's 1 even to a cursor at step 7 of the old run", st)
	}
	end2()
	if running(b) != 0 {
		t.Fatal("an ended stage still counts as running")
	}
}

func peerOf(h host.Host) Peer {
	return Peer{ID: h.ID(), Addrs: p2ptest.Addrs(h)}
}

func TestAskLongPollsTheWorker(t *testing.T) {
	worker, asker := p2ptest.NewHost(t), p2ptest.NewHost(t)
	b := NewBoard()
	srv := Serve(worker, b, func(peer.ID) bool { return true }, zap.NewNop())
	defer srv.Close()
	ctx := context.Background()
	if _, ok, err := Ask(ctx, asker, peerOf(worker), "j", Cursor{}, 0); err != nil || ok {
		t.Fatalf("Ask before the stage = %v %v, want not running", ok, err)
	}
	report, end := b.Start("j", "denoise", 50)
	defer end()
	report(3, 50)
	st, ok, err := Ask(ctx, asker, peerOf(worker), "j", Cursor{}, 0)
	if err != nil || !ok || st.Step != 3 || st.Total != 50 || st.Stage != "denoise" {
		t.Fatalf("Ask = %+v %v %v, want step 3 of 50", st, ok, err)
	}
	// A long poll is answered by the next step, not by its wait running out.
	go func() {
		time.Sleep(50 * time.Millisecond)
		report(4, 50)
	}()
	start := time.Now()
	st, ok, err = Ask(ctx, asker, peerOf(worker), "j", Cursor{Run: st.Run, Step: 3}, MaxWait)
	if err != nil || !ok || st.Step != 4 {
		t.Fatalf("long poll = %+v %v %v, want step 4", st, ok, err)
	}
	if waited := time.Since(start); waited >= MaxWait {
		t.Fatalf("the long poll waited out its %v (%v) instead of answering the step", MaxWait, waited)
	}
	if got := st.At; got.IsZero() || time.Since(got) > time.Minute {
		t.Fatalf("step time %v", got)
	}
}

func TestAskRefusedToNonMember(t *testing.T) {
	worker, asker := p2ptest.NewHost(t), p2ptest.NewHost(t)
	b := NewBoard()
	_, end := b.Start("j", "denoise", 5)
	defer end()
	srv := Serve(worker, b, func(p peer.ID) bool { return p != asker.ID() }, zap.NewNop())
	defer srv.Close()
	if _, _, err := Ask(context.Background(), asker, peerOf(worker), "j", Cursor{}, 0); !errors.Is(err, ErrDenied) {
		t.Fatalf("Ask from a non-member = %v, want ErrDenied", err)
	}
}

func TestRequestBounds(t *testing.T) {
	for _, r := range []request{
		{V: 2, Job: "j"},
		{V: wireVersion},
		{V: wireVersion, Job: string(make([]byte, maxJobLen+1))},
		{V: wireVersion, Job: "j", After: -2},
		{V: wireVersion, Job: "j", WaitMs: int(MaxWait/time.Millisecond) + 1},
		{V: wireVersion, Job: "j", WaitMs: -1},
	} {
		if err := r.Validate(); err == nil {
			t.Errorf("request %+v passed Validate", r)
		}
	}
	// A frame over maxFrame is refused before its body is read.
	var buf bytes.Buffer
	if err := transfer.WriteFrame(&buf, &request{V: wireVersion, Job: string(bytes.Repeat([]byte("x"), maxFrame))}); err != nil {
		t.Fatal(err)
	}
	var r request
	if err := transfer.ReadFrame(&buf, maxFrame, &r); !errors.Is(err, transfer.ErrFrameTooLarge) {
		t.Fatalf("oversized frame: %v", err)
	}
}

func seed(f *testing.F) {
	f.Add(p2ptest.Frame(f, &request{V: wireVersion, Job: "job-1", After: 3, WaitMs: 1000}))
	f.Add(p2ptest.Frame(f, &response{V: wireVersion, Running: true, Stage: "denoise", Step: 4, Total: 50, AtNanos: 1}))
	raw, _ := msgpack.Marshal(map[string]any{"v": 1, "job": "x", "after": -5})
	f.Add(append([]byte{0, 0, 0, byte(len(raw))}, raw...))
	f.Add([]byte{0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff}) // a huge array header
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})                   // a huge length
}

// FuzzRequestFrame checks that no frame panics the request decoder, that
// whatever decodes is within the bounds, and that it survives a round trip.
func FuzzRequestFrame(f *testing.F) {
	seed(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m request
		if err := transfer.ReadFrame(bytes.NewReader(b), maxFrame, &m); err != nil {
			return
		}
		if len(m.Job) > maxJobLen || m.WaitMs > int(MaxWait/time.Millisecond) || m.After < -1 || m.V != wireVersion {
			t.Fatalf("accepted an out-of-bounds request %+v", m)
		}
		var again request
		if err := transfer.ReadFrame(bytes.NewReader(p2ptest.Frame(t, &m)), maxFrame, &again); err != nil || again != m {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, again, err)
		}
	})
}

// FuzzResponseFrame is FuzzRequestFrame for answers.
func FuzzResponseFrame(f *testing.F) {
	seed(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m response
		if err := transfer.ReadFrame(bytes.NewReader(b), maxFrame, &m); err != nil {
			return
		}
		if len(m.Stage) > maxStageLen || m.Step < 0 || m.Total < 0 || m.V != wireVersion {
			t.Fatalf("accepted an out-of-bounds response %+v", m)
		}
		var again response
		if err := transfer.ReadFrame(bytes.NewReader(p2ptest.Frame(t, &m)), maxFrame, &again); err != nil || again != m {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, again, err)
		}
	})
}
