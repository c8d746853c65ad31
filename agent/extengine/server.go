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
	"github.com/latentmesh/latentmesh/transfer"
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

// Unwrap makes a resume the engine refused (CodeBadCheckpoint) an
// ErrBadCheckpoint, as the Server's own refusals are.
func (e *TaskError) Unwrap() error {
	switch e.Code {
	case CodeBadCheckpoint:
		return ErrBadCheckpoint
	case CodeLostState:
		return ErrLostState
	case CodeNoAdapter:
		return ErrNoAdapter
	}
	return nil
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
	// OnRefused, if set, is called (it must not block) with the reason of
	// every registration refused: `engine check` reports it.
	OnRefused func(reason string)
	// OnGone, if set, is called (it must not block) with the reason a
	// registered engine's connection ended, before Changed says it is
	// gone and before its tasks fail: `engine check` reports a frame the
	// agent refused.
	OnGone func(err error)
	// BatchWindow bounds how long a task of a batching model waits for
	// more of its kind before its batch goes (batch.go); a full batch goes
	// at once.
	BatchWindow time.Duration
	Logger      *zap.Logger
}

// DefaultConfig suits a real engine: a denoise step of a large model may
// take seconds, so a cancelled task gets 30 s to reach a step boundary.
func DefaultConfig(socket string) Config {
	return Config{
		Socket:           socket,
		HeartbeatEvery:   time.Second,           // cheap; one small frame each way
		HeartbeatTimeout: 5 * time.Second,       // five missed beats: hung, not busy
		CancelGrace:      30 * time.Second,      // a step of a large video model
		RegisterTimeout:  10 * time.Second,      // an engine connects once it has loaded
		BatchWindow:      20 * time.Millisecond, // a small image's stage; under load batches fill while the engine works
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

// ArenaAllocator is an Arena that lends the Server memory of its own:
// checkpoint buffers, a resume's latent, cached tensors. The Server grants
// FeatureCheckpoint and FeatureTensorCache only with an allocator: an
// Arena implementing this, or transfer.Service (its Alloc).
type ArenaAllocator interface {
	AllocArena(n int64) (p []byte, release func(), err error)
}

// bufferAllocator is transfer.Service's allocation.
type bufferAllocator interface {
	Alloc(n int64) (*transfer.Buffer, error)
}

// allocatorOf is a's allocation, or nil.
func allocatorOf(a Arena) func(int64) ([]byte, func(), error) {
	switch al := a.(type) {
	case ArenaAllocator:
		return al.AllocArena
	case bufferAllocator:
		return func(n int64) ([]byte, func(), error) {
			b, err := al.Alloc(n)
			if err != nil {
				return nil, nil, err
			}
			return b.Bytes(), b.Release, nil
		}
	}
	return nil
}

// features are the features this agent grants: the shape features to any
// v2 engine, the others given an allocator (needsAlloc).
var features = slices.Concat([]string{FeatureCheckpoint, FeatureTensorCache}, shapeFeatures, lifecycleFeatures, []string{FeatureBatch})

// Registration is what the connected engine declared, and what its
// welcome granted.
type Registration struct {
	Engine string
	PID    int32
	// Models as declared, less what the session does not grant: a model's
	// Checkpoint and TensorCache are kept only with their feature.
	Models []Model
	Slots  map[string]int32
	// Adapters are the adapters of each model the engine has loaded
	// (FeatureAdapters), sorted. A Registration is never changed once
	// handed out: a lifecycle frame makes a new one (lifecycle.go).
	Adapters map[string][]string
	// Version is the protocol version the welcome chose; Features the
	// features it granted (none below Version2).
	Version  int
	Features []string
}

// Supports reports whether the session granted feature.
func (r *Registration) Supports(feature string) bool {
	return r != nil && slices.Contains(r.Features, feature)
}

// Checkpoints returns the checkpoint spec of model's denoise, if it
// checkpoints in this session.
func (r *Registration) Checkpoints(model string) (CheckpointSpec, bool) {
	m, ok := r.Model(StageDenoise, model)
	if !ok || m.Checkpoint == nil || !r.Supports(FeatureCheckpoint) {
		return CheckpointSpec{}, false
	}
	return *m.Checkpoint, true
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

// SlotsFor is how many tasks of stage the engine runs at once: its calls
// at once (slots, 1 unless it said otherwise) times the largest batch of
// a model serving stage (batch.go); 0 when it serves no model of stage.
func (r *Registration) SlotsFor(stage string) int {
	if r == nil {
		return 0
	}
	for _, m := range r.Models {
		if slices.Contains(m.Stages, stage) {
			n, ok := r.Slots[stage]
			if !ok {
				n = 1
			}
			return int(n) * r.StageBatch(stage)
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
	alloc func(int64) ([]byte, func(), error) // nil: no v2 features
	log   *zap.Logger
	ln    *net.UnixListener
	// fillCheckpoint, if set, fills each checkpoint buffer before its task
	// is sent: `engine check` fills canaries, to see a latent written whole.
	fillCheckpoint func([]byte)
	batch          batcher // batch.go

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
	s := &Server{cfg: cfg, arena: a, alloc: allocatorOf(a), log: cfg.Logger.Named("engine"), ln: ln, changed: make(chan struct{})}
	s.batch = newBatcher(s)
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
	return s.cur.live.Load()
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
	c := &conn{s: s, uc: uc, pid: cred.Pid, pidfd: -1, version: Version1, tasks: map[uint64]*pending{}, calls: map[string]chan struct{}{}, dead: make(chan struct{})}
	if fd, err := unix.PidfdOpen(int(cred.Pid), 0); err == nil {
		c.pidfd = fd
	}
	reg, err := c.register()
	if err != nil {
		log.Warn("engine registration failed", zap.Error(err))
		if s.cfg.OnRefused != nil {
			s.cfg.OnRefused(err.Error())
		}
		c.closeFd()
		uc.Close()
		return
	}
	c.reg = reg
	c.live.Store(reg)
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
	c.log.Info("engine registered", zap.Strings("models", names), zap.Any("slots", reg.Slots),
		zap.Int("protocol", reg.Version), zap.Strings("features", reg.Features))

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
//
// A denoise of a model that checkpoints in this session (Registration.
// Checkpoints) gets a checkpoint buffer when it may checkpoint (r's
// CheckpointEvery or Stop is set), and r's Resume, CheckpointEvery,
// OnCheckpoint and Stop apply; otherwise they are ignored, but for a
// Resume, which fails with ErrBadCheckpoint. A resume the engine refuses
// (CodeBadCheckpoint) is a TaskError that is also an ErrBadCheckpoint.
func (s *Server) Run(ctx context.Context, r Request) error {
	s.mu.Lock()
	c := s.cur
	s.mu.Unlock()
	if c == nil {
		return ErrNoEngine
	}
	live := c.live.Load() // models and adapters as lifecycle frames left them
	mo, ok := live.Model(r.Stage, r.Model)
	if !ok {
		return ErrNoEngine
	}
	m := &Msg{T: TypeTask, Stage: r.Stage, Model: r.Model, Spec: &r.Spec, FirstFrame: int32(r.FirstFrame), Frames: int32(r.Frames)}
	p := &pending{progress: r.Progress, preview: r.Preview, result: make(chan error, 1), total: r.Spec.Steps}
	ok = false
	defer func() {
		if !ok {
			p.release() // never sent: the engine never saw these regions
		}
	}()
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
			return err
		}
		m.Inputs = append(m.Inputs, reg)
	}
	out, err := region(r.Output)
	if err != nil {
		return err
	}
	m.Output = &out
	check := append(slices.Clone(m.Inputs), out)
	ck, checkpoints := live.Checkpoints(r.Model)
	checkpoints = checkpoints && r.Stage == StageDenoise
	if r.Resume != nil && !checkpoints {
		return fmt.Errorf("%w: the engine's %s of model %q does not resume checkpoints", ErrBadCheckpoint, r.Stage, r.Model)
	}
	if checkpoints {
		if err := s.checkpointing(m, p, mo, ck, r); err != nil {
			return err
		}
		if m.CheckpointBuf != nil {
			check = append(check, *m.CheckpointBuf)
		}
		if m.Resume != nil {
			check = append(check, m.Resume.Latent)
		}
	}
	p.tensors, p.tensorCache = r.Tensors, r.Stage == StageDenoise && mo.TensorCache && c.reg.Supports(FeatureTensorCache)
	if err := s.shapeTask(m, p, mo, r, region); err != nil {
		return err
	}
	if m.RefImage != nil {
		check = append(check, *m.RefImage)
	}
	for _, nr := range m.Conds {
		check = append(check, nr.Region())
	}
	p.model = r.Model
	if err := s.lifecycleTask(c, live, m, p, r); err != nil {
		return err
	}
	for _, reg := range check {
		if err := reg.validate(); err != nil {
			return fmt.Errorf("%w: %v", ErrBadFrame, err)
		}
	}
	sent, err := s.send(ctx, c, live, r, m, p)
	defer sent()
	if err != nil {
		ok = m.Task != 0 // added to the connection: its failure releases the regions
		return err
	}
	ok = true // the engine may see the regions from here on: the answer releases them
	id := m.Task
	stop, stopped := r.Stop, false
	if !checkpoints {
		stop = nil // nothing to stop at: the caller cancels instead
	}
wait:
	for {
		select {
		case err := <-p.result:
			var te *TaskError
			if stopped && errors.As(err, &te) && te.Code == CodeStopped {
				return ErrStopped
			}
			if err == nil {
				err = p.finishShapes()
			}
			p.answered(err == nil)
			if err == nil {
				p.reportChunks()
			}
			return err
		case <-stop:
			stop, stopped = nil, true
			if err := c.write(&Msg{T: TypeStop, Task: id}); err != nil {
				c.fail(fmt.Errorf("send stop: %w", err))
				return fmt.Errorf("%w: %v", ErrEngineLost, err)
			}
		case <-ctx.Done():
			break wait
		}
	}
	p.answered(false) // a cancelled chunk's stream state is dropped, however the engine answers
	if err := c.write(&Msg{T: TypeCancel, Task: id}); err != nil {
		c.fail(fmt.Errorf("send cancel: %w", err))
		return ctx.Err()
	}
	t := time.NewTimer(s.cfg.CancelGrace)
	defer t.Stop()
	select {
	case err := <-p.result:
		var te *TaskError
		if err == nil || (errors.As(err, &te) && (te.Code == CodeCancelled || te.Code == CodeStopped)) {
			return ctx.Err()
		}
		return err
	case <-t.C:
		c.fail(fmt.Errorf("task %d still running %v after its cancel", id, s.cfg.CancelGrace))
		return ctx.Err()
	}
}

// send hands task m (its pending p) to the engine on c: alone, or in a
// batch of its kind when its model batches its stage (batch.go). Once m
// was added to c, m.Task is set, whatever the error.
// Call done once the task is answered (it frees a batch's call slot).
func (s *Server) send(ctx context.Context, c *conn, live *Registration, r Request, m *Msg, p *pending) (done func(), err error) {
	if n := live.MaxBatch(r.Stage, r.Model); n > 1 && batchable(r) {
		return s.batch.join(ctx, c, r, n, m, p)
	}
	done = func() {}
	id, added := c.add(p)
	if !added {
		return done, ErrEngineLost
	}
	m.Task = id
	s.batch.made[r.Stage].Add(1)
	if err := c.write(m); err != nil {
		c.fail(fmt.Errorf("send task: %w", err))
		return done, fmt.Errorf("%w: %v", ErrEngineLost, err)
	}
	return done, nil
}

// checkpointing adds a checkpointing denoise's fields to task m: the
// checkpoint buffer the engine writes each checkpoint's latent into (lent
// only when the task may checkpoint: periodically, or at a stop), the
// period, and the checkpoint to resume from, its latent copied into the
// arena unless it lies there already.
func (s *Server) checkpointing(m *Msg, p *pending, mo Model, ck CheckpointSpec, r Request) error {
	lay, n := mo.CheckpointLatent(r.Spec)
	if n < 1 || n > MaxCheckpointLatent {
		return fmt.Errorf("%w: a checkpoint latent of %d bytes, want 1-%d", ErrBadCheckpoint, n, MaxCheckpointLatent)
	}
	lend := func(b []byte) (Region, []byte, error) {
		if b == nil {
			buf, rel, err := s.alloc(n)
			if err != nil {
				return Region{}, nil, fmt.Errorf("%w: checkpoint buffer: %v", ErrNotInArena, err)
			}
			p.retained = append(p.retained, rel)
			b = buf
		} else if rel, ok := s.arena.Retain(b); ok {
			p.retained = append(p.retained, rel)
		} else {
			return Region{}, nil, ErrNotInArena
		}
		off, ok := s.arena.ArenaOffset(b)
		if !ok || int64(len(b)) != n {
			return Region{}, nil, ErrNotInArena
		}
		return Region{Off: off, Len: n, DType: lay.DType, Shape: lay.Shape}, b, nil
	}
	if r.CheckpointEvery > 0 && r.CheckpointEvery < r.Spec.Steps {
		m.CheckpointEvery = int32(min(r.CheckpointEvery, MaxLimitSteps))
	}
	if m.CheckpointEvery > 0 || r.Stop != nil {
		buf, ckb, err := lend(nil)
		if err != nil {
			return err
		}
		if s.fillCheckpoint != nil {
			s.fillCheckpoint(ckb)
		}
		m.CheckpointBuf, p.ck, p.sampler, p.onCheckpoint = &buf, ckb, ck.Sampler, r.OnCheckpoint
	}
	res := r.Resume
	if res == nil {
		return nil
	}
	switch {
	case res.Sampler != ck.Sampler:
		return fmt.Errorf("%w: sampler %q, the engine's model %q has %q", ErrBadCheckpoint, res.Sampler, mo.Name, ck.Sampler)
	case int64(len(res.Latent)) != n:
		return fmt.Errorf("%w: latent of %d bytes, the model's checkpoint latent for this spec is %d", ErrBadCheckpoint, len(res.Latent), n)
	case res.Step < 1 || res.Step >= res.Total || res.Total > MaxLimitSteps || res.Step >= r.Spec.Steps || len(res.State) > MaxState:
		return fmt.Errorf("%w: step %d of %d (state of %d bytes) for a %d-step denoise", ErrBadCheckpoint, res.Step, res.Total, len(res.State), r.Spec.Steps)
	}
	var (
		lat Region
		err error
	)
	if _, in := s.arena.ArenaOffset(res.Latent); in {
		lat, _, err = lend(res.Latent)
	} else {
		var b []byte
		if lat, b, err = lend(nil); err == nil {
			copy(b, res.Latent)
		}
	}
	if err != nil {
		return err
	}
	m.Resume = &Resume{Sampler: res.Sampler, Step: int32(res.Step), Total: int32(res.Total), State: res.State, Latent: lat}
	p.ckFloor = res.Step
	return nil
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
	// Image is the request's reference image, uint8 [height, width, 4],
	// for a model that takes one at Stage (v2, FeatureImage).
	Image *Tensor

	// Resume, if not nil, continues a denoise from a checkpoint taken by
	// an engine of the same model (the same CheckpointSpec.Sampler).
	Resume *Checkpoint
	// CheckpointEvery > 0 asks a checkpointing engine for a checkpoint
	// after every N-th step but the last.
	CheckpointEvery int
	// OnCheckpoint receives each checkpoint. It runs on the connection's
	// reader goroutine and must not block; State and Latent are valid
	// during the call only (Latent is the task's checkpoint buffer, which
	// the engine reuses once the call returns): copy what is kept, as
	// MarshalBinary does.
	OnCheckpoint func(Checkpoint)
	// Stop, when closed, asks the engine to finish its current step,
	// checkpoint it and end the task; Run then returns ErrStopped (after
	// OnCheckpoint was called) — or the normal result if the engine
	// finished first.
	Stop <-chan struct{}
	// ChunkReady, if set, is called with each latent chunk (frame) of a
	// denoise's output once it is final: as the engine reports it
	// (chunk_ready, on the connection's reader goroutine: it must not
	// block), and, at done, every chunk it did not report (on Run's).
	ChunkReady func(k int)
	// Stream places a decode in its decode stream (lifecycle.go), and
	// LastChunk says it is the stream's last chunk: the engine keeps the
	// stream's state from its first chunk to its last.
	Stream    *Stream
	LastChunk bool
	// Tensors, if not nil, answers the engine's tensor_get and stores its
	// tensor_put, under keys the Server prefixes with "extengine/", the
	// engine's name and the model's (cacheKey), so that no engine reads
	// another's values or the agent's own.
	Tensors TensorCache
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
	model    string
	total    int // the spec's steps

	// A checkpointing denoise's, set before the task is sent and then
	// used by the reader goroutine only.
	ck           []byte // the checkpoint buffer; nil: the task does not checkpoint
	sampler      string
	onCheckpoint func(Checkpoint)
	ckFloor      int // a checkpoint must come after this step: the resume's, then the last one's

	// The tensor cache's: tensorCache says the task may use it; lent
	// counts regions lent, reserved holds those lent for a tensor_put.
	tensors     TensorCache
	tensorCache bool
	lent        int
	reserved    map[string][]byte

	// A named encode's (shapes.go): its output's layout and bytes, and
	// the lengths its done reported.
	cond    *CondLayout
	condOut []byte
	lens    map[string]int32

	lc lifecycleTask // lifecycle.go
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
	pidfd int           // -1 if pidfd_open failed: retained regions then leak at a crash
	reg   *Registration // as registered: its engine, version and features never change
	// live is the registration as lifecycle frames changed its models
	// and adapters (lifecycle.go), which lmu serialises; streams numbers
	// decode streams.
	live    atomic.Pointer[Registration]
	lmu     sync.Mutex
	streams atomic.Uint64
	// version is the session's protocol version, stamped on every frame
	// after the welcome and required of every frame the engine sends.
	version uint8

	wmu sync.Mutex // serialises frames written

	next atomic.Uint64
	mu   sync.Mutex
	// mu guards the fields below.
	tasks   map[uint64]*pending
	dead    chan struct{}
	deadErr error
	held    []*pending               // unanswered at the failure: retained until the process exits
	calls   map[string]chan struct{} // each stage's call slots (batch.go)
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

// write sends ms, in one write: a batch's tasks reach the engine back to
// back.
func (c *conn) write(ms ...*Msg) error {
	var b []byte
	for _, m := range ms {
		m.V = c.version
		f, err := EncodeMsg(m)
		if err != nil {
			return err
		}
		b = append(b, f...)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	// An engine that stops reading must not block a task forever.
	c.uc.SetWriteDeadline(time.Now().Add(c.s.cfg.HeartbeatTimeout))
	_, err := c.uc.Write(b)
	return err
}

// register reads the engine's register frame and negotiates the session:
// the highest version both speak, and (from Version2) the features asked
// for that this agent grants. What a model declares of a feature not
// granted is dropped, so the Registration says only what the session does.
func (c *conn) register() (*Registration, error) {
	c.uc.SetReadDeadline(time.Now().Add(c.s.cfg.RegisterTimeout))
	m, err := ReadMsg(c.uc)
	if err != nil {
		c.refuse(err.Error())
		return nil, err
	}
	if m.T != TypeRegister || m.V != Version1 {
		err := fmt.Errorf("%w: first frame is %q of version %d, want %q of version %d", ErrBadFrame, m.T, m.V, TypeRegister, Version1)
		c.refuse(err.Error())
		return nil, err
	}
	offered := m.Versions
	if len(offered) == 0 {
		offered = []int32{Version1}
	}
	var version uint8
	for _, v := range offered {
		if v >= Version1 && v <= ProtocolVersion {
			version = max(version, uint8(v))
		}
	}
	if version == 0 {
		err := fmt.Errorf("%w: the engine speaks protocol versions %v, this agent %d-%d", ErrBadFrame, offered, Version1, ProtocolVersion)
		c.refuse(err.Error())
		return nil, err
	}
	reg := &Registration{Engine: m.Engine, PID: c.pid, Slots: m.Slots, Version: int(version)}
	if version >= Version2 {
		for _, f := range features {
			if slices.Contains(m.Features, f) && (c.s.alloc != nil || !needsAlloc(f)) {
				reg.Features = append(reg.Features, f)
			}
		}
	}
	for _, mo := range m.Models {
		reg.Models = append(reg.Models, grant(mo, reg))
	}
	return reg, nil
}

func (c *conn) refuse(reason string) {
	if len(reason) > MaxText {
		reason = reason[:MaxText]
	}
	c.write(&Msg{T: TypeRefused, Reason: reason})
}

// welcome answers the registration with the arena's memfd attached, the
// version chosen and the features granted. It is a Version1 frame, so
// that an engine of any version reads it; the session's frames follow.
func (c *conn) welcome() error {
	fd, size, _ := c.s.arena.ArenaFd()
	m := &Msg{V: Version1, T: TypeWelcome, ArenaSize: size, HeartbeatMS: c.s.cfg.HeartbeatEvery.Milliseconds(), Node: c.s.cfg.Node}
	if c.reg.Version > Version1 {
		m.Version, m.Features = uint8(c.reg.Version), c.reg.Features
	}
	b, err := EncodeMsg(m)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.uc.SetWriteDeadline(time.Now().Add(c.s.cfg.RegisterTimeout))
	_, _, err = c.uc.WriteMsgUnix(b, unix.UnixRights(fd), nil)
	if err == nil {
		c.version = uint8(c.reg.Version)
	}
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
		if m.V != c.version {
			return fmt.Errorf("%w: a version %d %s in a version %d session", ErrBadFrame, m.V, m.T, c.version)
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
				p.lens = m.Lens
				p.result <- nil
			} else {
				p.result <- &TaskError{Code: m.Code, Reason: m.Reason}
			}
		case TypeCheckpoint:
			if err := c.checkpoint(m); err != nil {
				return err
			}
		case TypeTensorGet:
			if err := c.tensorGet(m); err != nil {
				return err
			}
		case TypeTensorPut:
			if err := c.tensorPut(m); err != nil {
				return err
			}
		case TypeChunkReady:
			if err := c.chunkReady(m); err != nil {
				return err
			}
		case TypeAddModel, TypeRemoveModel, TypeAdapterLoaded, TypeAdapterUnloaded:
			if err := c.lifecycle(m); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%w: an engine may not send %q", ErrBadFrame, m.T)
		}
	}
}

// task is the unanswered task id, or nil.
func (c *conn) task(id uint64) *pending {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tasks[id]
}

// checkpoint takes a checkpoint of a running task: its latent is copied
// out of the task's checkpoint buffer and handed on with the state, then
// the engine is told the buffer is its own again (checkpointed). A
// checkpoint out of order, of a task that does not checkpoint or of
// another step count ends the connection: the engine's checkpoints could
// not be trusted.
func (c *conn) checkpoint(m *Msg) error {
	if !c.reg.Supports(FeatureCheckpoint) {
		return fmt.Errorf("%w: checkpoint, but the session has no %s feature", ErrBadFrame, FeatureCheckpoint)
	}
	p := c.task(m.Task)
	if p == nil {
		c.log.Debug("checkpoint of unknown task", zap.Uint64("task", m.Task))
		return nil
	}
	switch step, total := int(m.Step), int(m.Total); {
	case p.ck == nil:
		return fmt.Errorf("%w: checkpoint of task %d, which has no checkpoint buffer", ErrBadFrame, m.Task)
	case total != p.total:
		return fmt.Errorf("%w: checkpoint of task %d after step %d of %d; the task has %d steps", ErrBadFrame, m.Task, step, total, p.total)
	case step <= p.ckFloor:
		return fmt.Errorf("%w: checkpoint of task %d after step %d, not after step %d (its last checkpoint or resume)", ErrBadFrame, m.Task, step, p.ckFloor)
	}
	p.ckFloor = int(m.Step)
	if p.onCheckpoint != nil {
		// Views: the callee copies what it keeps before checkpointed
		// hands the buffer back.
		p.onCheckpoint(Checkpoint{Sampler: p.sampler, Step: int(m.Step), Total: int(m.Total), State: m.State, Latent: p.ck})
	}
	if err := c.write(&Msg{T: TypeCheckpointed, Task: m.Task, Step: m.Step}); err != nil {
		return fmt.Errorf("send checkpointed: %w", err)
	}
	return nil
}

// cacheKey is the TensorCache key of an engine's key for model: prefixed
// with the engine's registered name (name and version, by convention) and
// the model's, so an engine's keys never meet another engine's, another
// version's or the agent's own.
func cacheKey(engine, model, key string) string {
	return "extengine/" + engine + "/" + model + "/" + key
}

// tensorGet answers a tensor_get: the cached value copied into an arena
// region lent to the task (until it ends), or, on a miss, a region of the
// asked length to write the value into for a tensor_put; or neither, when
// the task has no cache, has been lent MaxTaskTensors regions, or the
// arena is full. An engine computes what it does not get.
func (c *conn) tensorGet(m *Msg) error {
	if !c.reg.Supports(FeatureTensorCache) {
		return fmt.Errorf("%w: tensor_get, but the session has no %s feature", ErrBadFrame, FeatureTensorCache)
	}
	ans := &Msg{T: TypeTensor, Task: m.Task, Key: m.Key}
	p := c.task(m.Task)
	switch {
	case p == nil:
		c.log.Debug("tensor_get of unknown task", zap.Uint64("task", m.Task))
	case !p.tensorCache:
		return fmt.Errorf("%w: tensor_get in task %d, whose model does not declare tensor_cache", ErrBadFrame, m.Task)
	case p.tensors == nil || p.lent >= MaxTaskTensors:
	default:
		v, found := p.tensors.Get(cacheKey(c.reg.Engine, p.model, m.Key))
		n := m.Len
		if found {
			n = int64(len(v))
		}
		if n < 1 || n > MaxTensor {
			break
		}
		b, rel, err := c.s.alloc(n)
		if err != nil {
			c.log.Debug("no arena room for a cached tensor", zap.Int64("bytes", n), zap.Error(err))
			break
		}
		off, ok := c.s.arena.ArenaOffset(b)
		if !ok {
			rel()
			break
		}
		p.retained = append(p.retained, rel)
		p.lent++
		ans.Region = &Region{Off: off, Len: n, DType: "uint8", Shape: []int64{n}}
		if found {
			copy(b, v)
			ans.Found = true
		} else {
			if p.reserved == nil {
				p.reserved = map[string][]byte{}
			}
			p.reserved[m.Key] = b
		}
	}
	if err := c.write(ans); err != nil {
		return fmt.Errorf("send tensor: %w", err)
	}
	return nil
}

// tensorPut stores a tensor_put's value: inline, or the region lent for
// its key by the tensor_get that missed.
func (c *conn) tensorPut(m *Msg) error {
	if !c.reg.Supports(FeatureTensorCache) {
		return fmt.Errorf("%w: tensor_put, but the session has no %s feature", ErrBadFrame, FeatureTensorCache)
	}
	p := c.task(m.Task)
	switch {
	case p == nil:
		c.log.Debug("tensor_put of unknown task", zap.Uint64("task", m.Task))
		return nil
	case !p.tensorCache:
		return fmt.Errorf("%w: tensor_put in task %d, whose model does not declare tensor_cache", ErrBadFrame, m.Task)
	}
	v := m.Data
	if len(v) == 0 {
		b, ok := p.reserved[m.Key]
		if !ok {
			return fmt.Errorf("%w: tensor_put of %q in task %d with no data and no region lent for it", ErrBadFrame, m.Key, m.Task)
		}
		delete(p.reserved, m.Key)
		v = b
	}
	if p.tensors != nil {
		p.tensors.Put(cacheKey(c.reg.Engine, p.model, m.Key), append([]byte(nil), v...))
	}
	return nil
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
	if s.cfg.OnGone != nil {
		s.cfg.OnGone(err) // before Changed fires: a watcher of it finds the reason
	}
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
