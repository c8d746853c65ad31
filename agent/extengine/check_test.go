package extengine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
)

// fakeEngine is an engine written in Go against the wire codec, with
// switches for the faults `engine check` must catch.
type fakeEngine struct {
	// beats: "always", "idle" (none while a task runs) or "never".
	beats string
	// step is the time a denoise step takes.
	step time.Duration
	// ignoreCancel runs every step whatever the agent says.
	ignoreCancel bool
	// halfDecode writes the first half of a decode's pixels only.
	halfDecode bool
	maxSteps   int32
}

// serve dials path (retrying until the check listens), registers and
// serves tasks until the check closes the connection.
func (f fakeEngine) serve(ctx context.Context, path string) error {
	var c *net.UnixConn
	for {
		var err error
		if c, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"}); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	defer c.Close()
	stopDial := context.AfterFunc(ctx, func() { c.Close() })
	defer stopDial()
	reg := &Msg{T: TypeRegister, Engine: "fake/1", Models: []Model{{
		Name: "fake", Stages: []string{StageDenoise, StageDecode}, MaxSteps: f.maxSteps,
		Cond:   Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8},
	}}}
	if err := WriteMsg(c, reg); err != nil {
		return err
	}
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return err
	}
	scms, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(scms) != 1 {
		return errors.New("welcome carried no fd")
	}
	fds, err := unix.ParseUnixRights(&scms[0])
	if err != nil || len(fds) != 1 {
		return errors.New("welcome carried no fd")
	}
	w, err := DecodeMsg(buf[4:n])
	if err != nil {
		unix.Close(fds[0])
		return err
	}
	mem, err := unix.Mmap(fds[0], 0, int(w.ArenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(fds[0])
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)

	var (
		wmu       sync.Mutex
		busy      atomic.Int32
		wg        sync.WaitGroup
		mu        sync.Mutex
		cancelled = map[uint64]bool{} // guarded by mu
	)
	stop := make(chan struct{})
	send := func(m *Msg) error {
		wmu.Lock()
		defer wmu.Unlock()
		return WriteMsg(c, m)
	}
	wg.Go(func() {
		t := time.NewTicker(time.Duration(w.HeartbeatMS) * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			if f.beats == "always" || (f.beats == "idle" && busy.Load() == 0) {
				send(&Msg{T: TypeHeartbeat})
			}
		}
	})
	run := func(m *Msg) {
		defer busy.Add(-1)
		out := mem[m.Output.Off : m.Output.Off+m.Output.Len]
		switch m.Stage {
		case StageDenoise:
			steps := int32(m.Spec.Steps)
			for i := int32(1); i <= steps; i++ {
				mu.Lock()
				stopped := cancelled[m.Task] && !f.ignoreCancel
				mu.Unlock()
				if stopped {
					send(&Msg{T: TypeFailed, Task: m.Task, Code: CodeCancelled, Reason: "cancelled"})
					return
				}
				if f.step > 0 {
					select {
					case <-stop:
						return
					case <-time.After(f.step):
					}
				}
				if send(&Msg{T: TypeProgress, Task: m.Task, Step: i, Total: steps}) != nil {
					return
				}
			}
			for i := 0; i+4 <= len(out); i += 4 {
				binary.LittleEndian.PutUint32(out[i:], math.Float32bits(0.25))
			}
		case StageDecode:
			in := m.Inputs[0]
			if math.IsNaN(float64(math.Float32frombits(binary.LittleEndian.Uint32(mem[in.Off:])))) {
				send(&Msg{T: TypeFailed, Task: m.Task, Code: CodeBadInput, Reason: "latent holds NaN"})
				return
			}
			if f.halfDecode {
				out = out[:len(out)/2]
			}
			for i := range out {
				out[i] = 0xff // all white: a legitimate image
			}
		}
		send(&Msg{T: TypeDone, Task: m.Task})
	}
	defer func() { close(stop); wg.Wait() }()
	for {
		m, err := ReadMsg(c)
		if err != nil {
			return nil // the check closed the connection
		}
		switch m.T {
		case TypeTask:
			busy.Add(1)
			wg.Go(func() { run(m) })
		case TypeCancel:
			mu.Lock()
			cancelled[m.Task] = true
			mu.Unlock()
		}
	}
}

// runCheck runs `engine check` against f, at a tenth of an agent's
// heartbeat timing (100 ms beats, dropped after 600 ms of silence).
func runCheck(t *testing.T, f fakeEngine) ([]CheckResult, bool, string) {
	t.Helper()
	cfg := DefaultCheckConfig(filepath.Join(t.TempDir(), "check.sock"))
	cfg.Server.HeartbeatEvery, cfg.Server.HeartbeatTimeout, cfg.Server.CancelGrace = 100*time.Millisecond, 600*time.Millisecond, 2*time.Second
	cfg.RegisterTimeout, cfg.TaskTimeout = 5*time.Second, 10*time.Second
	cfg.Logger = zaptest.NewLogger(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- f.serve(ctx, cfg.Socket) }()
	var out bytes.Buffer
	res, ok, err := Check(ctx, cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Errorf("fake engine: %v", err)
	}
	t.Logf("engine check:\n%s", out.String())
	return res, ok, out.String()
}

func result(t *testing.T, res []CheckResult, name string) CheckResult {
	t.Helper()
	for _, r := range res {
		if r.Name == name {
			return r
		}
	}
	t.Fatalf("no %q check in %v", name, res)
	return CheckResult{}
}

// A correct engine passes every check; its decoder writes an all-white
// image, which the old "not every byte left 0xff" heuristic failed.
func TestCheckPassesCorrectEngine(t *testing.T) {
	res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 20 * time.Millisecond})
	if !ok {
		t.Fatalf("a correct engine fails the check:\n%s", out)
	}
	for _, r := range res {
		if r.Name == "crash restart" {
			if !r.Skip {
				t.Errorf("crash restart without a command: %s", r)
			}
			continue
		}
		if !r.Pass {
			t.Errorf("a correct engine: %s", r)
		}
	}
}

// Heartbeats: an engine that sends none fails while idle, and one that
// stops while a task runs fails for that, each line saying what an agent
// would do.
func TestCheckFailsMissingHeartbeats(t *testing.T) {
	for _, tc := range []struct {
		name, beats string
		maxSteps    int32
		want        string
	}{
		{"none", "never", 0, "FAIL  heartbeats: no heartbeat in 500ms while idle: the agent drops an engine silent for 600ms"},
		{"none while busy", "idle", 0, "while tasks ran (1 "},
		// max_steps caps each task at 160 ms: the check runs several back
		// to back, and beats between them do not count.
		{"none while busy, short tasks", "idle", 8, "while tasks ran ("},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, ok, out := runCheck(t, fakeEngine{beats: tc.beats, step: 20 * time.Millisecond, maxSteps: tc.maxSteps})
			hb := result(t, res, "heartbeats")
			if ok || !hb.Failed() {
				t.Fatalf("an engine sending heartbeats %q passes:\n%s", tc.beats, out)
			}
			if !strings.Contains(hb.String(), tc.want) || !strings.Contains(hb.String(), "the agent drops an engine silent for 600ms") {
				t.Errorf("heartbeat failure line %q, want it to contain %q", hb, tc.want)
			}
		})
	}
}

// A decoder that writes half the image fails, however it fills that half.
func TestCheckFailsHalfWrittenOutput(t *testing.T) {
	res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 20 * time.Millisecond, halfDecode: true})
	d := result(t, res, "task decode fake")
	if ok || !d.Failed() {
		t.Fatalf("a decoder writing half the image passes:\n%s", out)
	}
	if want := "done, but 8192 of the output's 16384 bytes were never written (first at byte 8192, 50% into the image)"; !strings.Contains(d.Detail, want) {
		t.Errorf("half-write failure %q, want it to contain %q", d.Detail, want)
	}
	if !result(t, res, "task denoise fake").Pass {
		t.Error("the denoise of the half-writing engine (whole output) failed")
	}
}

// Cancellation: an engine that ignores the cancel with steps slow enough
// for it to land fails; one so fast it finishes before any cancel could
// reach it is reported inconclusive, with its step time and what to do,
// never passed.
func TestCheckCancelConclusiveOrSaysNot(t *testing.T) {
	res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 10 * time.Millisecond, ignoreCancel: true})
	c := result(t, res, "cancel mid-denoise")
	if ok || !c.Failed() {
		t.Fatalf("an engine ignoring cancellation passes:\n%s", out)
	}
	if want := "cancelled after step 10 of 50, but the engine went on to step 50 (it must stop within one step)"; !strings.Contains(c.Detail, want) {
		t.Errorf("cancel failure %q, want it to contain %q", c.Detail, want)
	}

	res, ok, out = runCheck(t, fakeEngine{beats: "always", ignoreCancel: true, maxSteps: 20})
	c = result(t, res, "cancel mid-denoise")
	if !ok {
		t.Errorf("inconclusive is not a failure, yet the check failed:\n%s", out)
	}
	if c.Pass || !c.Inconclusive {
		t.Fatalf("an engine finishing 20 steps before the cancel lands: %s, want inconclusive\n%s", c, out)
	}
	for _, want := range []string{"inconclusive  cancel mid-denoise: cancelled after step 10 of 20, but the engine ran on to step 20", "a step)", "the check cannot tell whether it stops", "give it steps of 33ms or more"} {
		if !strings.Contains(c.String(), want) {
			t.Errorf("inconclusive cancel line %q, want it to contain %q", c, want)
		}
	}
}
