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
	"sync"
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
	// Steps is the least denoise step count of the cancellation check, and
	// CancelAt the step after which it cancels: the engine must stop
	// within one step. With fast steps the check runs more (up to the
	// model's max_steps), so that a correct engine is still running when
	// the cancel reaches it.
	Steps, CancelAt int
	// CancelLands is how long a cancel may take to reach a correct engine
	// (the socket and the engine's reader thread). Steps reported later
	// than that after the cancel was sent count against the engine; an
	// engine that ran past the cancel only sooner than that was too fast
	// to tell, and the check says so (inconclusive) rather than pass it.
	CancelLands time.Duration
	// RegisterTimeout bounds the wait for the engine to register (model
	// loading included); TaskTimeout bounds each task.
	RegisterTimeout, TaskTimeout time.Duration
	// Server configures the socket side as an agent's: HeartbeatEvery is
	// the heartbeat_ms told to the engine and HeartbeatTimeout the silence
	// after which an agent drops it. The heartbeat check allows a gap of
	// HeartbeatTimeout less one HeartbeatEvery (a beat of margin).
	Server Config
	Logger *zap.Logger
}

// DefaultCheckConfig checks the engine listening... on socket, with an
// agent's own heartbeat period and timeout.
func DefaultCheckConfig(socket string) CheckConfig {
	sc := DefaultConfig(socket)
	sc.CancelGrace = 10 * time.Second
	return CheckConfig{
		Socket:          socket,
		Steps:           50,
		CancelAt:        10,
		CancelLands:     100 * time.Millisecond, // a Python reader thread under a busy GIL, with room to spare
		RegisterTimeout: time.Minute,
		TaskTimeout:     time.Minute,
		Server:          sc,
		Logger:          zap.NewNop(),
	}
}

// CheckResult is one check's outcome: Pass, Skip (not applicable) or
// Inconclusive (the engine was too fast, or too limited, for the check to
// tell); none of them is a failure.
type CheckResult struct {
	Name         string
	Pass         bool
	Skip         bool
	Inconclusive bool
	Detail       string
	// LastStep and CancelStep are filled by the cancellation check.
	LastStep, CancelStep int
}

// Failed reports whether the check found the engine at fault.
func (r CheckResult) Failed() bool { return !r.Pass && !r.Skip && !r.Inconclusive }

func (r CheckResult) String() string {
	switch {
	case r.Skip:
		return fmt.Sprintf("skip  %s: %s", r.Name, r.Detail)
	case r.Inconclusive:
		return fmt.Sprintf("inconclusive  %s: %s", r.Name, r.Detail)
	case r.Pass:
		return fmt.Sprintf("pass  %s: %s", r.Name, r.Detail)
	}
	return fmt.Sprintf("FAIL  %s: %s", r.Name, r.Detail)
}

const (
	// taskSteps is the denoise step count of a stage task check.
	taskSteps = 4
	// maxCheckSteps bounds the steps the check asks of a model without a
	// max_steps of its own.
	maxCheckSteps = 1000
	// maxBeats bounds the heartbeat times kept (a hostile engine may flood).
	maxBeats = 4096
	// maxBusyTasks bounds the denoise tasks the busy heartbeat check runs
	// back to back when max_steps caps each one short.
	maxBusyTasks = 20
)

// Check drives an engine through the protocol, the way an agent does:
// registration, each stage it serves twice (the whole output written,
// deterministically), heartbeats while idle and while a task runs,
// cancellation mid-denoise, a malformed input, protocol v2's checkpoints,
// resumes, stop and tensor cache when the engine negotiated them
// (checkv2.go), and (with a Command) a crash and restart, resuming the
// killed process's checkpoint. It writes one line per check to out and
// returns the results; ok is false if any check failed.
func Check(ctx context.Context, cfg CheckConfig, out io.Writer) (results []CheckResult, ok bool, err error) {
	ar, err := arena.New(arena.Config{Name: "latentmesh-engine-check", Size: 64 << 20, Align: 4096})
	if err != nil {
		return nil, false, err
	}
	defer ar.Close()
	ch := &checker{cfg: cfg, ar: ar, out: out, beats: newBeats(), stepTime: map[string]time.Duration{}, refused: make(chan string, 1)}
	sc := cfg.Server
	sc.Socket, sc.Logger, sc.OnFrame = cfg.Socket, cfg.Logger, ch.beats.frame
	sc.OnRefused = func(why string) {
		select {
		case ch.refused <- why:
		default:
		}
	}
	sc.OnGone = ch.onGone
	srv, err := Listen(sc, checkArena{ar})
	if err != nil {
		return nil, false, err
	}
	defer srv.Close()
	srv.fillCheckpoint = func(b []byte) { canary(b, ch.flip) }
	ch.srv = srv
	if len(cfg.Command) > 0 {
		if err := ch.start(); err != nil {
			return nil, false, err
		}
		defer ch.stop()
	}
	ch.run(ctx)
	ok = true
	for _, r := range ch.results {
		ok = ok && !r.Failed()
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
	beats   *beats
	results []CheckResult
	// stepTime is each model's denoise step time, measured by its task
	// check (the run loop's goroutine only).
	stepTime map[string]time.Duration
	// flip picks the canary that fills the checkpoint buffers of the next
	// tasks (the run loop's goroutine only, as is Run's use of it).
	flip bool
	// saved is a checkpoint of the checkpoint check, resumed by the crash
	// check on the restarted process; savedReq builds its task and
	// savedWant is the uninterrupted run's output.
	saved     *Checkpoint
	savedReq  func() (Request, error)
	savedWant []byte
	// refused receives the reason of a refused registration (buffered,
	// the first kept); refusedWhy is the one waitEngine took.
	refused    chan string
	refusedWhy string
	// gone is why the engine's last connection ended (checklifecycle.go).
	goneMu sync.Mutex
	gone   error
}

// beats records when the engine's heartbeats arrive (Server.OnFrame, on
// the connection's reader goroutine).
type beats struct {
	arrived chan struct{} // buffered: a beat came since the last receive
	mu      sync.Mutex
	// mu guards the field below.
	at []time.Time
}

func newBeats() *beats { return &beats{arrived: make(chan struct{}, 1)} }

func (b *beats) frame(t string) {
	if t != TypeHeartbeat {
		return
	}
	b.mu.Lock()
	if len(b.at) >= maxBeats {
		b.at = append(b.at[:0], b.at[len(b.at)/2:]...)
	}
	b.at = append(b.at, time.Now())
	b.mu.Unlock()
	select {
	case b.arrived <- struct{}{}:
	default:
	}
}

// between returns the beats that arrived in [from, to].
func (b *beats) between(from, to time.Time) []time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	var in []time.Time
	for _, t := range b.at {
		if !t.Before(from) && !t.After(to) {
			in = append(in, t)
		}
	}
	return in
}

// firstAfter waits up to d for a beat arriving after from.
func (b *beats) firstAfter(ctx context.Context, from time.Time, d time.Duration) (time.Time, bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		if in := b.between(from, time.Now()); len(in) > 0 {
			return in[0], true
		}
		select {
		case <-b.arrived:
		case <-t.C:
			return time.Time{}, false
		case <-ctx.Done():
			return time.Time{}, false
		}
	}
}

// busySilence is the longest stretch of busy time (the windows, joined
// end to start) without a beat inside a window: a beat between two tasks
// does not count, so an engine that beats only when idle cannot pass by
// running several short tasks.
func busySilence(windows [][2]time.Time, beats func(from, to time.Time) []time.Time) (longest time.Duration, n int) {
	var run time.Duration
	for _, w := range windows {
		prev := w[0]
		for _, t := range beats(w[0], w[1]) {
			longest = max(longest, run+t.Sub(prev))
			run, prev = 0, t
			n++
		}
		run += w[1].Sub(prev)
		longest = max(longest, run)
	}
	return longest, n
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
// With orRefusedFrame it also stops (false) once the agent side closed a
// connection for a frame of the engine's (goneWhy): an engine that
// registered and broke the protocol before the check began.
func (c *checker) waitEngine(ctx context.Context, present bool, d time.Duration, orRefusedFrame bool) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		ch := c.srv.Changed()
		if (c.srv.Engine() != nil) == present {
			return true
		}
		if orRefusedFrame && c.goneWhy() != "" {
			return false
		}
		select {
		case <-ch:
		case c.refusedWhy = <-c.refused:
			return false
		case <-t.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

func (c *checker) run(ctx context.Context) {
	start := time.Now()
	up := c.waitEngine(ctx, true, c.cfg.RegisterTimeout, true)
	reg := c.srv.Engine() // nil if the engine went since
	if !up || reg == nil {
		why := fmt.Sprintf("no engine registered within %v", c.cfg.RegisterTimeout)
		switch {
		case c.refusedWhy != "":
			why = "the registration was refused: " + c.refusedWhy
		case c.goneWhy() != "":
			why = "the engine registered, but before the check began " + c.ranOrGone(ErrEngineLost)
		case up:
			why = "the engine registered, but its connection ended before the check began"
		}
		c.report(CheckResult{Name: "register", Detail: why})
		return
	}
	var names []string
	for _, m := range reg.Models {
		names = append(names, fmt.Sprintf("%s%v", m.Name, m.Stages))
	}
	proto := fmt.Sprintf("protocol v%d", reg.Version)
	if len(reg.Features) > 0 {
		proto += fmt.Sprintf(" %v", reg.Features)
	}
	c.report(CheckResult{Name: "register", Pass: true, Detail: fmt.Sprintf("%s (pid %d) serves %v after %v, %s", reg.Engine, reg.PID, names, time.Since(start).Round(time.Millisecond), proto)})
	for _, m := range reg.Models {
		for _, st := range []string{StageEncode, StageDenoise, StageDecode} {
			if slices.Contains(m.Stages, st) {
				c.report(c.task(ctx, m, st))
			}
		}
	}
	c.report(c.heartbeats(ctx, reg))
	c.report(c.cancel(ctx, reg))
	c.report(c.malformed(ctx, reg))
	for _, r := range c.protocolV2(ctx, reg) {
		c.report(r)
	}
	for _, r := range c.shapeChecks(ctx, reg) {
		c.report(r)
	}
	for _, r := range c.lifecycleChecks(ctx, reg) {
		c.report(r)
	}
	for _, r := range c.batchChecks(ctx, reg) {
		c.report(r)
	}
	c.report(c.protocolFrames())
	c.report(c.crash(ctx, reg))
}

// denoiser is the first model the engine denoises.
func denoiser(reg *Registration) (Model, bool) {
	for _, m := range reg.Models {
		if slices.Contains(m.Stages, StageDenoise) {
			return m, true
		}
	}
	return Model{}, false
}

// stepLimit is the most denoise steps the check asks of m.
func stepLimit(m Model) int {
	if m.MaxSteps > 0 {
		return min(int(m.MaxSteps), maxCheckSteps)
	}
	return maxCheckSteps
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
	return r, c.shapeRequest(&r, m, st, 0)
}

// canary fills b with the check's canary pattern, or (flip) its
// complement: every byte differs between the two, so a byte the engine
// never wrote differs between a run over one and a run over the other.
func canary(b []byte, flip bool) {
	for i := range b {
		b[i] = canaryAt(i, flip)
	}
}

func canaryAt(i int, flip bool) byte {
	v := byte(i*167 + 0x3b)
	if flip {
		return ^v
	}
	return v
}

// compareRuns compares the outputs of two runs of one task, the first
// over the canary and the second over its complement: unwritten counts
// bytes that kept the canary in both, differ the other differing bytes;
// first is the offset of the first byte counted.
func compareRuns(a, b []byte) (unwritten, differ, first int) {
	first = -1
	for i := range a {
		if a[i] == b[i] {
			continue
		}
		if first < 0 {
			first = i
		}
		if a[i] == canaryAt(i, false) && b[i] == canaryAt(i, true) {
			unwritten++
		} else {
			differ++
		}
	}
	return unwritten, differ, first
}

// finite reports whether a float32 output holds no NaN or infinity.
func finite(t Tensor) bool {
	if t.DType != "float32" || len(t.Data) < 4 {
		return true
	}
	for _, f := range unsafe.Slice((*float32)(unsafe.Pointer(&t.Data[0])), len(t.Data)/4) {
		if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
			return false
		}
	}
	return true
}

// task runs stage st of m twice, the same task (seed, inputs) over two
// complementary canary fills of its output: the outputs must be equal
// byte for byte. A byte the engine did not write keeps its fill and
// differs, whatever values a legitimate output holds (all white, all
// zero), so no partial write passes. Denoise must report every step; its
// step time is kept for the heartbeat and cancellation checks.
func (c *checker) task(ctx context.Context, m Model, st string) CheckResult {
	name := fmt.Sprintf("task %s %s", st, m.Name)
	var outs [2][]byte
	var took time.Duration
	for run, flip := range []bool{false, true} {
		r, err := c.request(m, st, taskSteps, 0)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		canary(r.Output.Data, flip)
		var at []time.Time
		last, total := 0, 0
		r.Progress = func(step, t int) {
			last, total = step, t
			if len(at) < taskSteps {
				at = append(at, time.Now())
			}
		}
		tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
		start := time.Now()
		err = c.srv.Run(tctx, r)
		cancel()
		if err != nil {
			return CheckResult{Name: name, Detail: c.ranOrGone(err)}
		}
		took = max(took, time.Since(start).Round(time.Millisecond))
		if st == StageDenoise && (last != r.Spec.Steps || total != r.Spec.Steps) {
			return CheckResult{Name: name, Detail: fmt.Sprintf("done, but progress reached step %d of %d, want %d of %d", last, total, r.Spec.Steps, r.Spec.Steps)}
		}
		if st == StageDenoise && len(at) > 1 {
			d := at[len(at)-1].Sub(at[0]) / time.Duration(len(at)-1)
			if run == 0 || d < c.stepTime[m.Name] {
				c.stepTime[m.Name] = max(d, time.Microsecond)
			}
		}
		if !finite(r.Output) {
			return CheckResult{Name: name, Detail: "done, but the output holds NaN or infinities"}
		}
		outs[run] = r.Output.Data
	}
	n := len(outs[0])
	switch unwritten, differ, first := compareRuns(outs[0], outs[1]); {
	case unwritten > 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("done, but %d of the output's %d bytes were never written (first at byte %d%s%s): they kept the check's fill in two runs over different fills; the engine must write its whole output region", unwritten, n, first, where(st, first, n), whereNamed(m, st, first))}
	case differ > 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("done, but two runs of the same task (same seed, spec and inputs) wrote outputs differing in %d of %d bytes (first at byte %d): the engine must be deterministic, so that the check can see it wrote its whole output and a retried task gives the same bytes", differ, n, first)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("done in %v, whole output written, the same bytes in two runs", took)}
}

// where places a byte offset of a decode's output in the image.
func where(st string, off, n int) string {
	if st != StageDecode {
		return ""
	}
	return fmt.Sprintf(", %d%% into the image", 100*off/n)
}

// heartbeats waits, once, for a heartbeat while the engine is idle, then
// runs a denoise long enough to need one and measures the longest silence
// while it runs. Progress frames do not count: a decode reports none, and
// a step may outlast the timeout. The bound is the agent's timeout less
// one heartbeat period.
func (c *checker) heartbeats(ctx context.Context, reg *Registration) CheckResult {
	const name = "heartbeats"
	every, timeout := c.cfg.Server.HeartbeatEvery, c.cfg.Server.HeartbeatTimeout
	bound := timeout - every
	drops := fmt.Sprintf("the agent drops an engine silent for %v", timeout)
	ms := time.Millisecond
	start := time.Now()
	first, ok := c.beats.firstAfter(ctx, start, bound)
	if !ok {
		return CheckResult{Name: name, Detail: fmt.Sprintf("no heartbeat in %v while idle: %s; send one every heartbeat_ms (%d) from a thread of its own", bound, drops, every.Milliseconds())}
	}
	idle := fmt.Sprintf("idle: one %v into the wait", first.Sub(start).Round(ms))
	m, ok := denoiser(reg)
	if !ok {
		return CheckResult{Name: name, Pass: true, Detail: idle + "; not checked while a task runs: the engine serves no denoise, the one task the check can make last long enough"}
	}
	want := timeout // a beat of margin over the bound, so a late last beat still shows
	steps := c.cfg.Steps
	if d := c.stepTime[m.Name]; d > 0 {
		// Half again as many: the step time measured may be longer than
		// this task's steps, and the window opens after the first.
		steps = int(3*want/(2*d)) + 2
	}
	steps = max(1, min(steps, stepLimit(m)))
	// Denoise back to back until the busy time reaches want: one task when
	// max_steps allows, a few when it caps a task shorter.
	var windows [][2]time.Time
	var busyFor time.Duration
	for len(windows) < maxBusyTasks && busyFor < want {
		r, err := c.request(m, StageDenoise, steps, 0)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		// The window runs from the first step's progress to the last,
		// when the engine is surely busy: a beat it sent while the task
		// was on its way, or after its last step while the answer was on
		// its way back, is no beat while busy. Progress and beats are
		// timed on the same reader goroutine, in the order they were
		// sent, so which side of the window a beat falls is certain.
		var mu sync.Mutex
		var s, e time.Time
		r.Progress = func(int, int) {
			mu.Lock()
			defer mu.Unlock()
			e = time.Now()
			if s.IsZero() {
				s = e
			}
		}
		tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
		err = c.srv.Run(tctx, r)
		cancel()
		if err != nil {
			return CheckResult{Name: name, Detail: fmt.Sprintf("%s; a %d-step denoise run to watch heartbeats while busy failed: %v (%s)", idle, steps, err, drops)}
		}
		mu.Lock()
		if s.IsZero() {
			s = time.Now() // no progress: nothing known of when it was busy
			e = s
		}
		mu.Unlock()
		windows = append(windows, [2]time.Time{s, e})
		busyFor += e.Sub(s)
	}
	silent, n := busySilence(windows, c.beats.between)
	ran := fmt.Sprintf("%d %d-step denoise(s), %v busy", len(windows), steps, busyFor.Round(ms))
	switch {
	case silent > bound:
		return CheckResult{Name: name, Detail: fmt.Sprintf("%s; no heartbeat for %v while tasks ran (%s): %s, and progress does not stand in for heartbeats (a decode sends none, a step may outlast it); heartbeat from a thread of its own, also while a task runs", idle, silent.Round(ms), ran, drops)}
	case n == 0:
		return CheckResult{Name: name, Inconclusive: true, Detail: fmt.Sprintf("%s; not checked while a task runs: %s, too short to need a heartbeat (the check allows %v without one) and none came; give the model a larger max_steps or slower steps", idle, ran, bound)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("%s; busy: %d during %s, longest silence %v (the check allows %v; %s)", idle, n, ran, silent.Round(ms), bound, drops)}
}

// cancel runs a long denoise and cancels it after CancelAt steps: the
// engine must stop at the next step boundary, so at most one more step.
// That needs the engine still running when the cancel reaches it: the
// check runs enough steps, at the step time measured by the task check,
// that the steps after the cancel take three times CancelLands. An engine
// that ran past the cancel only within CancelLands of it was too fast to
// judge, and the check says so with what to change.
func (c *checker) cancel(ctx context.Context, reg *Registration) CheckResult {
	const name = "cancel mid-denoise"
	m, found := denoiser(reg)
	if !found {
		return CheckResult{Name: name, Skip: true, Detail: "the engine serves no denoise stage"}
	}
	cancelAt, lands := c.cfg.CancelAt, c.cfg.CancelLands
	// need is the step count whose steps after cancelAt+1 last 3*lands at d a step.
	need := func(d time.Duration) int {
		return cancelAt + 1 + int(math.Ceil(float64(3*lands)/float64(max(d, time.Microsecond))))
	}
	steps := c.cfg.Steps
	if d := c.stepTime[m.Name]; d > 0 {
		steps = max(steps, need(d))
	}
	steps = min(steps, stepLimit(m))
	if steps < cancelAt+2 {
		return CheckResult{Name: name, Inconclusive: true, Detail: fmt.Sprintf("the model allows %d steps, which leaves no step after a cancel at step %d to stop short of; run with a smaller --cancel-at", steps, cancelAt)}
	}
	r, err := c.request(m, StageDenoise, steps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type report struct {
		step int
		at   time.Time
	}
	var (
		mu sync.Mutex
		// mu guards the fields below: Progress runs on the reader
		// goroutine, which may still call it as Run gives up.
		reports    []report
		cancelStep = -1
		sentAt     time.Time
	)
	r.Progress = func(step, total int) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		if len(reports) < 2*maxCheckSteps {
			reports = append(reports, report{step, now})
		}
		if step >= cancelAt && cancelStep < 0 {
			cancelStep, sentAt = step, now
			cancel()
		}
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- c.srv.Run(tctx, r) }()
	var runErr error
	t := time.NewTimer(c.cfg.TaskTimeout)
	select {
	case runErr = <-done:
	case <-t.C:
		cancel()
		runErr = <-done
	}
	t.Stop()
	mu.Lock()
	defer mu.Unlock()
	maxStep, firstStep, firstAt := 0, 0, time.Time{}
	var late *report // the first step past cancelStep+1 reported after the cancel had time to land
	for i, rp := range reports {
		if i == 0 {
			firstStep, firstAt = rp.step, rp.at
		}
		maxStep = max(maxStep, rp.step)
		if cancelStep >= 0 && rp.step > cancelStep+1 && rp.at.Sub(sentAt) > lands && late == nil {
			late = &reports[i]
		}
	}
	res := CheckResult{Name: name, LastStep: maxStep, CancelStep: cancelStep}
	ms := time.Millisecond
	switch {
	case cancelStep < 0:
		res.Detail = fmt.Sprintf("the engine reported no step %d of %d (last %d; %v)", cancelAt, steps, maxStep, runErr)
	case errors.Is(runErr, ErrEngineLost):
		res.Detail = fmt.Sprintf("the engine did not answer the cancel: %v", runErr)
	case maxStep <= cancelStep+1:
		res.Pass = true
		res.Detail = fmt.Sprintf("cancelled after step %d of %d; stopped at step %d, within one step (%v)", cancelStep, steps, maxStep, time.Since(start).Round(ms))
	case late != nil:
		res.Detail = fmt.Sprintf("cancelled after step %d of %d, but the engine went on to step %d (it must stop within one step); step %d came %v after the cancel was sent", cancelStep, steps, maxStep, late.step, late.at.Sub(sentAt).Round(ms))
	default:
		d := time.Duration(0)
		if cancelStep > firstStep {
			d = sentAt.Sub(firstAt) / time.Duration(cancelStep-firstStep)
		}
		res.Inconclusive = true
		slower := (3 * lands / time.Duration(steps-cancelStep-1)).Round(time.Millisecond)
		advice := fmt.Sprintf("run with --steps %d", need(d))
		if n := need(d); n > stepLimit(m) {
			advice = fmt.Sprintf("the check may run at most %d steps of this model (its max_steps, at most %d), so give it steps of %v or more (a test option, as the torch worker's --step-ms)", stepLimit(m), maxCheckSteps, slower)
			if n <= maxCheckSteps {
				advice += fmt.Sprintf(" or a max_steps of %d", n)
			}
		}
		res.Detail = fmt.Sprintf("cancelled after step %d of %d, but the engine ran on to step %d within %v of the cancel (%v a step), sooner than a cancel can be counted on to reach it (%v): the check cannot tell whether it stops; %s", cancelStep, steps, maxStep, reports[len(reports)-1].at.Sub(sentAt).Round(time.Microsecond), d.Round(time.Microsecond), lands, advice)
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
	if !c.waitEngine(ctx, false, 2*c.cfg.Server.HeartbeatTimeout, false) {
		return CheckResult{Name: name, Detail: "the killed engine still counts as registered"}
	}
	if err := c.start(); err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	start := time.Now()
	if !c.waitEngine(ctx, true, c.cfg.RegisterTimeout, false) {
		return CheckResult{Name: name, Detail: "the restarted engine did not register"}
	}
	m := reg.Models[0]
	st := m.Stages[0]
	res := c.task(ctx, m, st)
	if !res.Pass {
		return CheckResult{Name: name, Detail: "restarted, but " + res.Detail}
	}
	resumed := ""
	if c.saved != nil {
		// A checkpoint resumes on any process: the killed one's, here.
		r, err := c.savedReq()
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		if why := c.resumeOnto(ctx, r, *c.saved, c.savedWant); why != "" {
			return CheckResult{Name: name, Detail: "restarted, but " + why + " (the checkpoint came from the killed process)"}
		}
		resumed = fmt.Sprintf(", and resumed the killed process's checkpoint after step %d byte-identically", c.saved.Step)
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("killed, registered again after %v, served one %s task%s", time.Since(start).Round(time.Millisecond), st, resumed)}
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

// AllocArena lends the Server arena memory (checkpoint buffers, cached
// tensors), freed when it releases it.
func (c checkArena) AllocArena(n int64) ([]byte, func(), error) {
	b, err := c.a.Alloc(n)
	if err != nil {
		return nil, nil, err
	}
	var once sync.Once
	return c.a.Slice(b), func() { once.Do(func() { c.a.Free(b) }) }, nil
}
