package extengine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// CheckConfig configures a conformance run (`latentmesh engine check`).
type CheckConfig struct {
	// Socket is where the check listens, as an agent would.
	Socket string
	// Command, if set, starts the engine (with LATENTMESH_ENGINE_SOCKET
	// set to Socket) and enables the crash-restart check; without it the
	// check waits for an engine to connect.
	Command []string
	// Steps is the denoise step count of the cancellation check, and
	// CancelAt the step after which it cancels: the engine must stop
	// within one step.
	Steps, CancelAt int
	// RegisterTimeout bounds the wait for the engine to register (model
	// loading included); TaskTimeout bounds each task.
	RegisterTimeout, TaskTimeout time.Duration
	// Server configures the socket side (heartbeats, cancel grace).
	Server Config
	Logger *zap.Logger
}

// DefaultCheckConfig checks the engine listening... on socket.
func DefaultCheckConfig(socket string) CheckConfig {
	sc := DefaultConfig(socket)
	sc.CancelGrace = 10 * time.Second
	return CheckConfig{Socket: socket, Steps: 50, CancelAt: 10, RegisterTimeout: time.Minute, TaskTimeout: time.Minute, Server: sc, Logger: zap.NewNop()}
}

// CheckResult is one check's outcome.
type CheckResult struct {
	Name   string
	Pass   bool
	Skip   bool
	Detail string
	// LastStep and CancelStep are filled by the cancellation check.
	LastStep, CancelStep int
}

func (r CheckResult) String() string {
	switch {
	case r.Skip:
		return fmt.Sprintf("skip  %s: %s", r.Name, r.Detail)
	case r.Pass:
		return fmt.Sprintf("pass  %s: %s", r.Name, r.Detail)
	}
	return fmt.Sprintf("FAIL  %s: %s", r.Name, r.Detail)
}

// Check drives an engine through the protocol, the way an agent does:
// registration, one task per stage it serves, cancellation mid-denoise, a
// malformed input, and (with a Command) a crash and restart. It writes
// one line per check to out and returns the results; ok is false if any
// check failed.
func Check(ctx context.Context, cfg CheckConfig, out io.Writer) (results []CheckResult, ok bool, err error) {
	ar, err := arena.New(arena.Config{Name: "latentmesh-engine-check", Size: 64 << 20, Align: 4096})
	if err != nil {
		return nil, false, err
	}
	defer ar.Close()
	sc := cfg.Server
	sc.Socket, sc.Logger = cfg.Socket, cfg.Logger
	srv, err := Listen(sc, checkArena{ar})
	if err != nil {
		return nil, false, err
	}
	defer srv.Close()
	ch := &checker{cfg: cfg, srv: srv, ar: ar, out: out}
	if len(cfg.Command) > 0 {
		if err := ch.start(); err != nil {
			return nil, false, err
		}
		defer ch.stop()
	}
	ch.run(ctx)
	ok = true
	for _, r := range ch.results {
		ok = ok && (r.Pass || r.Skip)
	}
	return ch.results, ok, nil
}

type checker struct {
	cfg     CheckConfig
	srv     *Server
	ar      *arena.Arena
	out     io.Writer
	cmd     *exec.Cmd
	exited  chan struct{}
	results []CheckResult
}

func (c *checker) report(r CheckResult) {
	c.results = append(c.results, r)
	fmt.Fprintln(c.out, r)
}

func (c *checker) start() error {
	cmd := exec.Command(c.cfg.Command[0], c.cfg.Command[1:]...)
	cmd.Env = append(os.Environ(), "LATENTMESH_ENGINE_SOCKET="+c.cfg.Socket)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("extengine: start engine: %w", err)
	}
	c.cmd, c.exited = cmd, make(chan struct{})
	exited := c.exited
	go func() { cmd.Wait(); close(exited) }()
	return nil
}

func (c *checker) stop() {
	if c.cmd != nil {
		c.cmd.Process.Kill()
		<-c.exited
	}
}

// waitEngine waits for a registration (present true) or its absence.
func (c *checker) waitEngine(ctx context.Context, present bool, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		ch := c.srv.Changed()
		if (c.srv.Engine() != nil) == present {
			return true
		}
		select {
		case <-ch:
		case <-t.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

func (c *checker) run(ctx context.Context) {
	start := time.Now()
	if !c.waitEngine(ctx, true, c.cfg.RegisterTimeout) {
		c.report(CheckResult{Name: "register", Detail: fmt.Sprintf("no engine registered within %v", c.cfg.RegisterTimeout)})
		return
	}
	reg := c.srv.Engine()
	var names []string
	for _, m := range reg.Models {
		names = append(names, fmt.Sprintf("%s%v", m.Name, m.Stages))
	}
	c.report(CheckResult{Name: "register", Pass: true, Detail: fmt.Sprintf("%s (pid %d) serves %v after %v", reg.Engine, reg.PID, names, time.Since(start).Round(time.Millisecond))})
	for _, m := range reg.Models {
		for _, st := range []string{StageEncode, StageDenoise, StageDecode} {
			if slices.Contains(m.Stages, st) {
				c.report(c.task(ctx, m, st))
			}
		}
	}
	c.report(c.cancel(ctx, reg))
	c.report(c.malformed(ctx, reg))
	c.report(c.crash(ctx, reg))
}

func (c *checker) spec(m Model, steps int) engine.Spec {
	side := max(64, 8*int(m.Latent.Scale))
	return engine.Spec{Model: m.Name, Prompt: "a conformance check", Seed: 7, Width: side, Height: side, Frames: 1, Steps: steps, GuidanceScale: 5}
}

// alloc returns n bytes of the arena filled with fill.
func (c *checker) alloc(n int64, fill byte) ([]byte, error) {
	b, err := c.ar.Alloc(n)
	if err != nil {
		return nil, err
	}
	s := c.ar.Slice(b)
	for i := range s {
		s[i] = fill
	}
	return s, nil
}

// request builds a task of stage st of m with well-formed inputs (zeros),
// an output filled with 0xff (NaN for floats), and steps denoise steps.
func (c *checker) request(m Model, st string, steps int, inFill byte) (Request, error) {
	s := c.spec(m, steps)
	lat := []int64{1, int64(m.Latent.Channels), int64(s.Height / int(m.Latent.Scale)), int64(s.Width / int(m.Latent.Scale))}
	condN := DTypeSize(m.Cond.DType)
	for _, d := range m.Cond.Shape {
		condN *= d
	}
	latN := DTypeSize(m.Latent.DType) * lat[0] * lat[1] * lat[2] * lat[3]
	r := Request{Stage: st, Model: m.Name, Spec: s}
	var outT Tensor
	switch st {
	case StageEncode:
		outT = Tensor{DType: m.Cond.DType, Shape: m.Cond.Shape}
		outT.Data = make([]byte, condN)
	case StageDenoise:
		in, err := c.alloc(condN, inFill)
		if err != nil {
			return r, err
		}
		r.Inputs = []Tensor{{DType: m.Cond.DType, Shape: m.Cond.Shape, Data: in}}
		outT = Tensor{DType: m.Latent.DType, Shape: lat, Data: make([]byte, latN)}
	case StageDecode:
		in, err := c.alloc(latN, inFill)
		if err != nil {
			return r, err
		}
		r.Inputs = []Tensor{{DType: m.Latent.DType, Shape: lat, Data: in}}
		r.Frames = 1
		n := int64(4 * s.Width * s.Height)
		outT = Tensor{DType: "uint8", Shape: []int64{1, int64(s.Height), int64(s.Width), 4}, Data: make([]byte, n)}
	}
	o, err := c.alloc(int64(len(outT.Data)), 0xff)
	if err != nil {
		return r, err
	}
	outT.Data = o
	r.Output = outT
	return r, nil
}

// written reports whether the engine wrote out: no float left NaN (the
// fill), or, for pixels, not every byte left 0xff.
func written(t Tensor) bool {
	if t.DType == "float32" {
		v := unsafe.Slice((*float32)(unsafe.Pointer(&t.Data[0])), len(t.Data)/4)
		for _, f := range v {
			if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
				return false
			}
		}
		return true
	}
	for _, b := range t.Data {
		if b != 0xff {
			return true
		}
	}
	return false
}

func (c *checker) task(ctx context.Context, m Model, st string) CheckResult {
	name := fmt.Sprintf("task %s %s", st, m.Name)
	r, err := c.request(m, st, 4, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	last, total := 0, 0
	r.Progress = func(step, t int) { last, total = step, t }
	tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
	defer cancel()
	start := time.Now()
	if err := c.srv.Run(tctx, r); err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("failed: %v", err)}
	}
	took := time.Since(start).Round(time.Millisecond)
	switch {
	case !written(r.Output):
		return CheckResult{Name: name, Detail: "done, but the output region was not (fully) written: NaN, infinities or untouched bytes remain"}
	case st == StageDenoise && (last != r.Spec.Steps || total != r.Spec.Steps):
		return CheckResult{Name: name, Detail: fmt.Sprintf("done, but progress reached step %d of %d, want %d of %d", last, total, r.Spec.Steps, r.Spec.Steps)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("done in %v", took)}
}

// cancel runs a long denoise and cancels it after CancelAt steps: the
// engine must stop at the next step boundary, so at most one more step.
func (c *checker) cancel(ctx context.Context, reg *Registration) CheckResult {
	const name = "cancel mid-denoise"
	var m Model
	found := false
	for _, mo := range reg.Models {
		if slices.Contains(mo.Stages, StageDenoise) {
			m, found = mo, true
			break
		}
	}
	if !found {
		return CheckResult{Name: name, Skip: true, Detail: "the engine serves no denoise stage"}
	}
	steps := c.cfg.Steps
	if m.MaxSteps > 0 {
		steps = min(steps, int(m.MaxSteps))
	}
	r, err := c.request(m, StageDenoise, steps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	last := make(chan int, steps+1) // every step reported, in order (the reader goroutine)
	cancelAt := -1
	r.Progress = func(step, total int) {
		last <- step
		if step >= c.cfg.CancelAt && cancelAt < 0 {
			cancelAt = step
			cancel()
		}
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- c.srv.Run(tctx, r) }()
	var runErr error
	select {
	case runErr = <-done:
	case <-time.After(c.cfg.TaskTimeout):
		cancel()
		runErr = <-done
	}
	close(last)
	maxStep := 0
	for s := range last {
		maxStep = max(maxStep, s)
	}
	res := CheckResult{Name: name, LastStep: maxStep, CancelStep: cancelAt}
	switch {
	case cancelAt < 0:
		res.Detail = fmt.Sprintf("the engine reported no step %d of %d (last %d; %v)", c.cfg.CancelAt, steps, maxStep, runErr)
	case errors.Is(runErr, ErrEngineLost):
		res.Detail = fmt.Sprintf("the engine did not answer the cancel: %v", runErr)
	case maxStep > cancelAt+1:
		res.Detail = fmt.Sprintf("cancelled after step %d of %d, but the engine went on to step %d (it must stop within one step)", cancelAt, steps, maxStep)
	default:
		res.Pass = true
		res.Detail = fmt.Sprintf("cancelled after step %d of %d; stopped at step %d, within one step (%v)", cancelAt, steps, maxStep, time.Since(start).Round(time.Millisecond))
	}
	return res
}

// malformed sends a task whose input is all NaN: the engine must fail it
// with a reason and keep serving (a next task succeeds).
func (c *checker) malformed(ctx context.Context, reg *Registration) CheckResult {
	const name = "malformed input"
	var m Model
	st := ""
	for _, mo := range reg.Models {
		for _, s := range []string{StageDecode, StageDenoise} {
			if st == "" && slices.Contains(mo.Stages, s) {
				m, st = mo, s
			}
		}
	}
	if st == "" {
		return CheckResult{Name: name, Skip: true, Detail: "the engine serves no stage with inputs"}
	}
	r, err := c.request(m, st, 2, 0xff) // NaN everywhere
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
	defer cancel()
	err = c.srv.Run(tctx, r)
	var te *TaskError
	switch {
	case err == nil:
		return CheckResult{Name: name, Detail: fmt.Sprintf("%s of an all-NaN input succeeded; it must fail with %q", st, CodeBadInput)}
	case !errors.As(err, &te):
		return CheckResult{Name: name, Detail: fmt.Sprintf("%s of an all-NaN input: %v (the engine must fail the task, not the connection)", st, err)}
	}
	after, err := c.request(m, st, 2, 0)
	if err == nil {
		err = c.srv.Run(tctx, after)
	}
	if err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("failed as it should (%s), but the next task failed: %v", te.Code, err)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("failed with %s: %q; the next task succeeded", te.Code, te.Reason)}
}

// crash kills the engine (SIGKILL) and starts it again: the agent side
// must see it go and the new process must register and serve.
func (c *checker) crash(ctx context.Context, reg *Registration) CheckResult {
	const name = "crash restart"
	if c.cmd == nil {
		return CheckResult{Name: name, Skip: true, Detail: "no engine command given, so the check cannot restart it"}
	}
	c.cmd.Process.Kill()
	<-c.exited
	if !c.waitEngine(ctx, false, 2*c.cfg.Server.HeartbeatTimeout) {
		return CheckResult{Name: name, Detail: "the killed engine still counts as registered"}
	}
	if err := c.start(); err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	start := time.Now()
	if !c.waitEngine(ctx, true, c.cfg.RegisterTimeout) {
		return CheckResult{Name: name, Detail: "the restarted engine did not register"}
	}
	m := reg.Models[0]
	st := m.Stages[0]
	res := c.task(ctx, m, st)
	if !res.Pass {
		return CheckResult{Name: name, Detail: "restarted, but " + res.Detail}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("killed, registered again after %v, served a %s task", time.Since(start).Round(time.Millisecond), st)}
}

// checkArena serves the check's own arena to the Server: the check frees
// nothing until it ends, so Retain has nothing to hold.
type checkArena struct{ a *arena.Arena }

func (c checkArena) ArenaFd() (int, int64, bool) { return c.a.Fd(), c.a.Size(), true }
func (c checkArena) ArenaOffset(p []byte) (int64, bool) {
	mem := c.a.Bytes()
	if len(p) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
	if at < base || at-base+uintptr(len(p)) > uintptr(len(mem)) {
		return 0, false
	}
	return int64(at - base), true
}
func (c checkArena) Retain([]byte) (func(), bool) { return func() {}, true }
