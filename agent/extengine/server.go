package extengine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// Errors of the engine connection.
var (
	// ErrNoEngine: no engine serving the stage and model is registered.
	ErrNoEngine = errors.New("extengine: no engine serves this stage and model")
	// ErrEngineLost: the engine's connection ended (closed, hung, or broke
	// the protocol) before it answered the task.
	ErrEngineLost = errors.New("extengine: engine lost")
	// ErrNotInArena: a tensor of a request is not in the agent's arena, so
	// the engine cannot see it.
	ErrNotInArena = errors.New("extengine: tensor not in the arena")
)

// TaskError is a task the engine failed, with its code and reason.
type TaskError struct {
	Code   string
	Reason string
}

func (e *TaskError) Error() string {
	return fmt.Sprintf("engine failed the task (%s): %s", e.Code, e.Reason)
}

// Config configures the engine socket.
type Config struct {
	// Socket is the Unix socket path the agent listens on.
	Socket string
	// HeartbeatEvery is how often each side sends a heartbeat.
	HeartbeatEvery time.Duration
	// HeartbeatTimeout is how long the engine may stay silent (no frame of
	// any kind) before it counts as hung and its connection is closed.
	HeartbeatTimeout time.Duration
	// CancelGrace bounds how long a cancelled task may take to stop: past
	// it the engine ignores cancellation and its connection is closed.
	CancelGrace time.Duration
	// RegisterTimeout bounds the wait for the register frame.
	RegisterTimeout time.Duration
	// Node is the agent's node id, told to the engine for its logs.
	Node string
	// Check vets the connecting process's credentials; nil accepts
	// processes of this process's uid (as the shm transport does).
	Check func(unix.Ucred) error
	// OnFrame, if set, is called on the connection's reader goroutine (it
	// must not block) with the type of every frame the registered engine
	// sends: `engine check` times the engine's heartbeats with it.
	OnFrame func(t string)
	Logger  *zap.Logger
}

// DefaultConfig suits a real engine: a denoise step of a large model may
// take seconds, so a cancelled task gets 30 s to reach a step boundary.
func DefaultConfig(socket string) Config {
	return Config{
		Socket:           socket,
		HeartbeatEvery:   time.Second,      // cheap; one small frame each way
		HeartbeatTimeout: 5 * time.Second,  // five missed beats: hung, not busy
		CancelGrace:      30 * time.Second, // a step of a large video model
		RegisterTimeout:  10 * time.Second, // an engine connects once it has loaded
		Logger:           zap.NewNop(),
	}
}

// Arena is the agent's registered memory as this package needs it
// (transfer.Service implements it).
type Arena interface {
	ArenaFd() (fd int, size int64, ok bool)
	ArenaOffset(p []byte) (int64, bool)
	Retain(p []byte) (release func(), ok bool)
}

// Registration is what the connected engine declared.
type Registration struct {
	Engine string
	PID    int32
	Models []Model
	Slots  map[string]int32
}

// Serves reports whether the engine serves stage of model.
func (r *Registration) Serves(stage, model string) bool {
	_, ok := r.Model(stage, model)
	return ok
}

// Model returns the declared model serving stage.
func (r *Registration) Model(stage, model string) (Model, bool) {
	if r == nil {
		return Model{}, false
	}
	for _, m := range r.Models {
		if m.Name == model && slices.Contains(m.Stages, stage) {
			return m, true
		}
	}
	return Model{}, false
}

// SlotsFor is how many tasks of stage the engine runs at once (1 unless
// it said otherwise); 0 when it serves no model of stage.
func (r *Registration) SlotsFor(stage string) int {
	if r == nil {
		return 0
	}
	for _, m := range r.Models {
		if slices.Contains(m.Stages, stage) {
			if n, ok := r.Slots[stage]; ok {
				return int(n)
			}
			return 1
		}
	}
	return 0
}

// Server listens on the engine socket and holds at most one engine
// connection at a time: an engine is one process serving this agent's
// accelerator; a second one is refused while the first lives.
type Server struct {
	cfg   Config
	arena Arena
	log   *zap.Logger
	ln    *net.UnixListener

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once

	mu sync.Mutex
	// mu guards the fields below.
	cur     *conn
	changed chan struct{} // closed and replaced when an engine comes or goes
}

// Listen opens the socket (replacing a stale file) and accepts engines
// until Close.
func Listen(cfg Config, a Arena) (*Server, error) {
	if cfg.Socket == "" {
		return nil, errors.New("extengine: no socket path")
	}
	if cfg.HeartbeatEvery <= 0 || cfg.HeartbeatTimeout <= cfg.HeartbeatEvery || cfg.CancelGrace <= 0 || cfg.RegisterTimeout <= 0 {
		return nil, errors.New("extengine: HeartbeatTimeout must exceed HeartbeatEvery, and every timeout be positive")
	}
	if _, _, ok := a.ArenaFd(); !ok {
		return nil, errors.New("extengine: an external engine needs the agent's arena (transfer.Config.Arena.Size > 0)")
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Check == nil {
		uid := uint32(os.Getuid())
		cfg.Check = func(c unix.Ucred) error {
			if c.Uid != uid {
				return fmt.Errorf("uid %d (pid %d), want %d", c.Uid, c.Pid, uid)
			}
			return nil
		}
	}
	if fi, err := os.Lstat(cfg.Socket); err == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(cfg.Socket) // a previous agent's; nothing listens on it
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: cfg.Socket, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("extengine: listen: %w", err)
	}
	if err := os.Chmod(cfg.Socket, 0o600); err != nil { // the arena is behind it
		ln.Close()
		return nil, fmt.Errorf("extengine: %w", err)
	}
	s := &Server{cfg: cfg, arena: a, log: cfg.Logger.Named("engine"), ln: ln, changed: make(chan struct{})}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Go(s.accept)
	return s, nil
}

// Close stops accepting, drops the engine and waits for every goroutine.
// Idempotent.
func (s *Server) Close() error {
	s.once.Do(func() {
		s.cancel()
		s.ln.Close()
		s.mu.Lock()
		c := s.cur
		s.mu.Unlock()
		if c != nil {
			c.fail(errors.New("agent closing"))
		}
		s.wg.Wait()
	})
	return nil
}

// Addr is the socket path.
func (s *Server) Addr() string { return s.cfg.Socket }

// Engine is the connected engine's registration, or nil.
func (s *Server) Engine() *Registration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return nil
	}
	return s.cur.reg
}

// Changed returns a channel closed the next time an engine registers or
// goes away.
func (s *Server) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Server) accept() {
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.ctx.Err() == nil {
				s.log.Error("engine socket accept", zap.Error(err))
			}
			return
		}
		s.wg.Go(func() { s.serve(c) })
	}
}

// serve runs one engine connection: registration, then the reader loop
// until the connection ends.
func (s *Server) serve(uc *net.UnixConn) {
	stop := context.AfterFunc(s.ctx, func() { uc.Close() })
	defer stop()
	cred, err := peerCred(uc)
	if err == nil {
		err = s.cfg.Check(cred)
	}
	if err != nil {
		s.log.Warn("engine refused", zap.Error(err))
		uc.Close()
		return
	}
	log := s.log.With(zap.Int32("pid", cred.Pid))
	c := &conn{s: s, uc: uc, pid: cred.Pid, pidfd: -1, tasks: map[uint64]*pending{}, dead: make(chan struct{})}
	if fd, err := unix.PidfdOpen(int(cred.Pid), 0); err == nil {
		c.pidfd = fd
	}
	reg, err := c.register()
	if err != nil {
		log.Warn("engine registration failed", zap.Error(err))
		c.closeFd()
		uc.Close()
		return
	}
	c.reg = reg
	c.log = log.With(zap.String("engine", reg.Engine))
	s.mu.Lock()
	if s.cur != nil {
		other := s.cur.pid
		s.mu.Unlock()
		c.refuse(fmt.Sprintf("an engine (pid %d) is already registered with this agent", other))
		c.log.Warn("second engine refused", zap.Int32("registered", other))
		c.closeFd()
		uc.Close()
		return
	}
	if err := c.welcome(); err != nil {
		s.mu.Unlock()
		c.log.Warn("engine welcome failed", zap.Error(err))
		c.closeFd()
		uc.Close()
		return
	}
	s.cur = c
	s.notifyLocked()
	s.mu.Unlock()
	names := make([]string, len(reg.Models))
	for i, m := range reg.Models {
		names[i] = m.Name
	}
	c.log.Info("engine registered", zap.Strings("models", names), zap.Any("slots", reg.Slots))

	var wg sync.WaitGroup
	wg.Go(c.heartbeats)
	err = c.read()
	c.fail(err)
	wg.Wait()
	// Whoever failed the connection (this reader, a heartbeat, a Run), the
	// reader goroutine is the one that waits for the process: it is
	// counted in s.wg, so Close waits for it too.
	c.releaseAtExit()
}

// Run runs one task on the engine and waits for its answer. Tensors must
// lie in the arena (ErrNotInArena otherwise): they are retained until the
// engine answers, or until its process has exited if it never does, so
// memory an engine may still write is never handed to anyone else. When ctx
// ends, the task is cancelled and Run waits up to CancelGrace for the
// engine to stop; an engine that does not is disconnected.
func (s *Server) Run(ctx context.Context, r Request) error {
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if c == nil || !c.reg.Serves(r.Stage, r.Model) {
		return ErrNoEngine
	}
	m := &Msg{V: ProtocolVersion, T: TypeTask, Stage: r.Stage, Model: r.Model, Spec: &r.Spec, FirstFrame: int32(r.FirstFrame), Frames: int32(r.Frames)}
	p := &pending{progress: r.Progress, preview: r.Preview, result: make(chan error, 1)}
	region := func(t Tensor) (Region, error) {
		off, ok := s.arena.ArenaOffset(t.Data)
		if !ok {
			return Region{}, ErrNotInArena
		}
		rel, ok := s.arena.Retain(t.Data)
		if !ok {
			return Region{}, ErrNotInArena
		}
		p.retained = append(p.retained, rel)
		return Region{Off: off, Len: int64(len(t.Data)), DType: t.DType, Shape: t.Shape}, nil
	}
	for _, in := range r.Inputs {
		reg, err := region(in)
		if err != nil {
			p.release()
			return err
		}
		m.Inputs = append(m.Inputs, reg)
	}
	out, err := region(r.Output)
	if err != nil {
		p.release()
		return err
	}
	m.Output = &out
	for _, reg := range append(m.Inputs, out) {
		if err := reg.validate(); err != nil {
			p.release()
			return fmt.Errorf("%w: %v", ErrBadFrame, err)
		}
	}
	id, ok := c.add(p)
	if !ok {
		p.release() // never sent: the engine never saw these regions
		return ErrEngineLost
	}
	m.Task = id
	if err := c.write(m); err != nil {
		c.fail(fmt.Errorf("send task: %w", err))
		return fmt.Errorf("%w: %v", ErrEngineLost, err)
	}
	select {
	case err := <-p.result:
		return err
	case <-ctx.Done():
	}
	if err := c.write(&Msg{T: TypeCancel, Task: id}); err != nil {
		c.fail(fmt.Errorf("send cancel: %w", err))
		return ctx.Err()
	}
	t := time.NewTimer(s.cfg.CancelGrace)
	defer t.Stop()
	select {
	case err := <-p.result:
		var te *TaskError
		if err == nil || (errors.As(err, &te) && te.Code == CodeCancelled) {
			return ctx.Err()
		}
		return err
	case <-t.C:
		c.fail(fmt.Errorf("task %d still running %v after its cancel", id, s.cfg.CancelGrace))
		return ctx.Err()
	}
}

// Request is one stage call.
type Request struct {
	Stage, Model string
	Spec         engine.Spec
	Inputs       []Tensor
	Output       Tensor
	// FirstFrame and Frames place a decode's input among the latent's frames.
	FirstFrame, Frames int
	// Progress, if set, is called (on the connection's reader goroutine:
	// it must not block) with each step the engine reports.
	Progress func(step, total int)
	// Preview, if set, is called the same way with each preview image.
	Preview func(step int, png []byte)
}

// Tensor is a tensor in the arena.
type Tensor struct {
	DType string
	Shape []int64
	Data  []byte
}

type pending struct {
	progress func(step, total int)
	preview  func(step int, png []byte)
	result   chan error // buffered: the answer, sent once
	retained []func()
}

func (p *pending) release() {
	for _, r := range p.retained {
		r()
	}
	p.retained = nil
}

// conn is one registered engine.
type conn struct {
	s     *Server
	uc    *net.UnixConn
	log   *zap.Logger
	pid   int32
	pidfd int // -1 if pidfd_open failed: retained regions then leak at a crash
	reg   *Registration

	wmu sync.Mutex // serialises frames written

	next atomic.Uint64
	mu   sync.Mutex
	// mu guards the fields below.
	tasks   map[uint64]*pending
	dead    chan struct{}
	deadErr error
	held    []*pending // unanswered at the failure: retained until the process exits
}

func (c *conn) add(p *pending) (uint64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.deadErr != nil {
		return 0, false
	}
	id := c.next.Add(1)
	c.tasks[id] = p
	return id, true
}

func (c *conn) write(m *Msg) error {
	b, err := EncodeMsg(m)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	// An engine that stops reading must not block a task forever.
	c.uc.SetWriteDeadline(time.Now().Add(c.s.cfg.HeartbeatTimeout))
	_, err = c.uc.Write(b)
	return err
}

func (c *conn) register() (*Registration, error) {
	c.uc.SetReadDeadline(time.Now().Add(c.s.cfg.RegisterTimeout))
	m, err := ReadMsg(c.uc)
	if err != nil {
		c.refuse(err.Error())
		return nil, err
	}
	if m.T != TypeRegister {
		err := fmt.Errorf("%w: first frame is %q, want %q", ErrBadFrame, m.T, TypeRegister)
		c.refuse(err.Error())
		return nil, err
	}
	return &Registration{Engine: m.Engine, PID: c.pid, Models: m.Models, Slots: m.Slots}, nil
}

func (c *conn) refuse(reason string) {
	if len(reason) > MaxText {
		reason = reason[:MaxText]
	}
	c.write(&Msg{T: TypeRefused, Reason: reason})
}

// welcome answers the registration with the arena's memfd attached.
func (c *conn) welcome() error {
	fd, size, _ := c.s.arena.ArenaFd()
	b, err := EncodeMsg(&Msg{T: TypeWelcome, ArenaSize: size, HeartbeatMS: c.s.cfg.HeartbeatEvery.Milliseconds(), Node: c.s.cfg.Node})
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.uc.SetWriteDeadline(time.Now().Add(c.s.cfg.RegisterTimeout))
	_, _, err = c.uc.WriteMsgUnix(b, unix.UnixRights(fd), nil)
	return err
}

func (c *conn) heartbeats() {
	t := time.NewTicker(c.s.cfg.HeartbeatEvery)
	defer t.Stop()
	for {
		select {
		case <-c.dead:
			return
		case <-t.C:
		}
		if err := c.write(&Msg{T: TypeHeartbeat}); err != nil {
			c.fail(fmt.Errorf("send heartbeat: %w", err))
			return
		}
	}
}

// read handles the engine's frames until the connection fails; any
// malformed frame ends it.
func (c *conn) read() error {
	for {
		c.uc.SetReadDeadline(time.Now().Add(c.s.cfg.HeartbeatTimeout))
		m, err := ReadMsg(c.uc)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return fmt.Errorf("no heartbeat for %v: engine hung", c.s.cfg.HeartbeatTimeout)
			}
			return err
		}
		if c.s.cfg.OnFrame != nil {
			c.s.cfg.OnFrame(m.T)
		}
		switch m.T {
		case TypeHeartbeat:
		case TypeProgress, TypePreview:
			c.mu.Lock()
			p := c.tasks[m.Task]
			c.mu.Unlock()
			switch {
			case p == nil:
				c.log.Debug("report for unknown task", zap.Uint64("task", m.Task))
			case m.T == TypeProgress && p.progress != nil:
				p.progress(int(m.Step), int(m.Total))
			case m.T == TypePreview && p.preview != nil:
				p.preview(int(m.Step), m.Image)
			}
		case TypeDone, TypeFailed:
			c.mu.Lock()
			p := c.tasks[m.Task]
			delete(c.tasks, m.Task)
			c.mu.Unlock()
			if p == nil {
				return fmt.Errorf("%w: %s for unknown task %d", ErrBadFrame, m.T, m.Task)
			}
			p.release() // the engine is done with the regions
			if m.T == TypeDone {
				p.result <- nil
			} else {
				p.result <- &TaskError{Code: m.Code, Reason: m.Reason}
			}
		default:
			return fmt.Errorf("%w: an engine may not send %q", ErrBadFrame, m.T)
		}
	}
}

// fail ends the connection once: every unanswered task fails with
// ErrEngineLost, the agent stops routing to the engine, and the regions
// those tasks named stay retained until the engine process has exited.
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.deadErr != nil {
		c.mu.Unlock()
		return
	}
	if err == nil {
		err = errors.New("connection ended")
	}
	c.deadErr = err
	tasks := c.tasks
	c.tasks = map[uint64]*pending{}
	close(c.dead)
	c.mu.Unlock()

	c.uc.Close()
	s := c.s
	s.mu.Lock()
	if s.cur == c {
		s.cur = nil
		s.notifyLocked()
	}
	s.mu.Unlock()
	c.log.Warn("engine gone; its tasks are abandoned and this agent claims no work for it until an engine registers",
		zap.Int("tasks", len(tasks)), zap.Error(err))
	var held []*pending
	for _, p := range tasks {
		p.result <- fmt.Errorf("%w: %v", ErrEngineLost, err)
		held = append(held, p)
	}
	c.mu.Lock()
	c.held = held // serve releases them once the process is gone
	c.mu.Unlock()
}

// releaseAtExit frees the regions of tasks the engine never answered once
// its process has exited (its pidfd turns readable), so a process that is
// still running (hung) cannot write into memory given to another payload.
// Without a pidfd they stay retained: a leak, logged, rather than a risk.
func (c *conn) releaseAtExit() {
	defer c.closeFd()
	c.mu.Lock()
	held := c.held
	c.held = nil
	c.mu.Unlock()
	if len(held) == 0 {
		return
	}
	if c.pidfd < 0 {
		c.log.Warn("engine process cannot be watched; its task buffers stay allocated", zap.Int("tasks", len(held)))
		return
	}
	for c.s.ctx.Err() == nil {
		fds := []unix.PollFd{{Fd: int32(c.pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 250)
		if err != nil && !errors.Is(err, unix.EINTR) {
			c.log.Warn("watch engine process", zap.Error(err))
			return
		}
		if n > 0 {
			break
		}
	}
	for _, p := range held {
		p.release()
	}
	c.log.Debug("engine process exited; its task buffers are free", zap.Int("tasks", len(held)))
}

func (c *conn) closeFd() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pidfd >= 0 {
		unix.Close(c.pidfd)
		c.pidfd = -1
	}
}

// peerCred reads SO_PEERCRED of a connected Unix socket.
func peerCred(c *net.UnixConn) (unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return unix.Ucred{}, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return unix.Ucred{}, err
	}
	if serr != nil {
		return unix.Ucred{}, serr
	}
	return *cred, nil
}
