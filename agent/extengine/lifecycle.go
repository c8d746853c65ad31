package extengine

// This file holds protocol v2's lifecycle features (issue 20), four more
// features an engine asks for and the agent grants like the shapes (they
// lend no memory, so to any v2 engine asking):
//
//   - decode_state: a decode task carries its place in a stream (the
//     chunks of one decode stage, sent in order, one at a time), so a
//     causal 3D VAE keeps its cache across a job's chunks. The engine keeps
//     a stream's state from chunk 0 until it answers the chunk marked last,
//     fails or is cancelled in one of its chunks, gets stream_end, loses the
//     connection, or StreamIdle passes with no chunk of it.
//   - chunk_ready: a denoise says a latent chunk is final before the task
//     ends, so the agent hands the chunk to the decode stage early.
//   - model_lifecycle: models registered and unregistered after the
//     registration (add_model, remove_model).
//   - adapters: LoRA-like weight deltas of a model's denoiser, loaded and
//     unloaded at run time (adapter_loaded, adapter_unloaded); a denoise
//     task names the one it runs with.
//
// Every lifecycle frame is answered by an ack, whose reason says why the
// agent did not take it (nothing changed then); the agent re-advertises
// what the engine serves (Changed) after each change it takes.

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// Features of the lifecycle (Version2).
const (
	FeatureDecodeState    = "decode_state"    // task stream, job, chunk, last; stream_end; failed lost_state
	FeatureChunkReady     = "chunk_ready"     // chunk_ready
	FeatureModelLifecycle = "model_lifecycle" // add_model, remove_model; ack
	FeatureAdapters       = "adapters"        // adapter_loaded, adapter_unloaded; ack; task adapter; failed no_adapter
)

// lifecycleFeatures need no memory lent by the Server.
var lifecycleFeatures = []string{FeatureDecodeState, FeatureChunkReady, FeatureModelLifecycle, FeatureAdapters}

// Message types of the lifecycle (Version2).
const (
	TypeChunkReady      = "chunk_ready"      // engine -> agent: latent Chunk of denoise Task is final
	TypeStreamEnd       = "stream_end"       // agent -> engine: drop Stream's state (abandoned before its last chunk)
	TypeAddModel        = "add_model"        // engine -> agent: Models[0] is served from now on
	TypeRemoveModel     = "remove_model"     // engine -> agent: Model is no longer served
	TypeAdapterLoaded   = "adapter_loaded"   // engine -> agent: Adapter of Model is loaded
	TypeAdapterUnloaded = "adapter_unloaded" // engine -> agent: Adapter of Model is unloaded
	TypeAck             = "ack"              // agent -> engine: a lifecycle frame taken (no Reason) or refused (Reason)
)

// Failure codes of the lifecycle.
const (
	// CodeLostState: a decode chunk of a stream whose state the engine no
	// longer holds (it never saw chunk 0, or dropped it after StreamIdle);
	// the agent runs the decode stage again from chunk 0.
	CodeLostState = "lost_state"
	// CodeNoAdapter: a denoise named an adapter the engine has not loaded
	// (unloaded while the task was on its way); the task runs elsewhere.
	CodeNoAdapter = "no_adapter"
)

// Bounds of the lifecycle.
const (
	// MaxJobID bounds a decode task's job id (the agent's are 16 hex digits).
	MaxJobID = 64
	// MaxAdapters bounds the adapters of one model an engine has loaded at
	// once: the agent advertises each in its node record.
	MaxAdapters = 16
	// StreamIdle is how long an engine keeps a decode stream's state with
	// no chunk of it: past it the engine may drop the state and answer the
	// next chunk lost_state.
	StreamIdle = 10 * time.Minute
)

// Errors of the lifecycle.
var (
	// ErrLostState: the engine no longer holds the decode stream's state
	// (its connection ended, or it answered lost_state): the decode stage
	// must start again from its first chunk.
	ErrLostState = errors.New("extengine: the engine lost the decode stream's state")
	// ErrNoAdapter: the engine has not loaded the adapter a task names.
	ErrNoAdapter = errors.New("extengine: the engine has not loaded the adapter")
)

// validateLifecycleFields checks m's lifecycle fields: only in a version 2
// frame of a type that carries them, and bounded.
func (m *Msg) validateLifecycleFields() error {
	if m.Stream == 0 && m.Job == "" && m.Chunk == 0 && !m.Last && m.Adapter == "" {
		return nil
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	if m.V < Version2 {
		return bad("version %d fields in a version %d frame", Version2, m.V)
	}
	switch {
	case (m.Job != "" || m.Last) && m.T != TypeTask,
		m.Stream != 0 && m.T != TypeTask && m.T != TypeStreamEnd,
		m.Chunk != 0 && m.T != TypeTask && m.T != TypeChunkReady,
		m.Adapter != "" && m.T != TypeTask && m.T != TypeAdapterLoaded && m.T != TypeAdapterUnloaded && m.T != TypeAck:
		return bad("fields of another frame type")
	}
	if len(m.Job) > MaxJobID {
		return bad("job id of %d bytes, at most %d", len(m.Job), MaxJobID)
	}
	for _, c := range []byte(m.Job) {
		if c < 0x21 || c > 0x7e {
			return bad("job id %q: want printable ASCII", m.Job)
		}
	}
	if m.Chunk < 0 || m.Chunk >= MaxLimitFrames {
		return bad("chunk %d, want 0-%d", m.Chunk, MaxLimitFrames-1)
	}
	if m.Adapter != "" {
		if err := engine.ValidAdapter(m.Adapter); err != nil {
			return bad("adapter: %v", err)
		}
	}
	if m.T == TypeTask {
		if m.Stream == 0 && (m.Job != "" || m.Chunk != 0 || m.Last) {
			return bad("a decode chunk without a stream")
		}
		if m.Stream != 0 && m.Stage != StageDecode || m.Adapter != "" && m.Stage != StageDenoise {
			return bad("stream fields in a %s task, or an adapter in a task that is not a denoise", m.Stage)
		}
	}
	return nil
}

// validateLifecycle checks a lifecycle frame's own fields.
func (m *Msg) validateLifecycle() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadFrame, m.T, fmt.Sprintf(format, a...))
	}
	switch m.T {
	case TypeChunkReady:
		if m.Task == 0 {
			return bad("no task id")
		}
	case TypeStreamEnd:
		if m.Stream == 0 {
			return bad("no stream id")
		}
	case TypeAddModel:
		if len(m.Models) != 1 {
			return bad("%d models, want 1", len(m.Models))
		}
		if err := m.Models[0].validate(); err != nil {
			return bad("model: %v", err)
		}
	case TypeRemoveModel, TypeAck:
		if err := engine.ValidModel(m.Model); err != nil {
			return bad("model: %v", err)
		}
	case TypeAdapterLoaded, TypeAdapterUnloaded:
		if err := engine.ValidModel(m.Model); err != nil {
			return bad("model: %v", err)
		}
		if m.Adapter == "" {
			return bad("no adapter")
		}
	}
	return nil
}

// grant is mo as the session serves it: what it declares of a feature
// not granted dropped.
func grant(mo Model, reg *Registration) Model {
	if !reg.Supports(FeatureCheckpoint) {
		mo.Checkpoint = nil
	}
	if !reg.Supports(FeatureTensorCache) {
		mo.TensorCache = false
	}
	dropUngranted(&mo, reg)
	return mo
}

// clone copies r for a change (Registrations handed out are never changed).
func (r *Registration) clone() *Registration {
	n := *r
	n.Models = slices.Clone(r.Models)
	n.Adapters = make(map[string][]string, len(r.Adapters))
	for m, as := range r.Adapters {
		n.Adapters[m] = slices.Clone(as)
	}
	return &n
}

// HasAdapter reports whether the engine has adapter of model loaded.
func (r *Registration) HasAdapter(model, adapter string) bool {
	return r != nil && slices.Contains(r.Adapters[model], adapter)
}

// lifecycle applies a lifecycle frame to the connection's registration
// and answers it: an ack, with the reason when the agent does not take it
// (a feature not granted is a protocol error and ends the connection).
func (c *conn) lifecycle(m *Msg) error {
	feature := FeatureModelLifecycle
	if m.T == TypeAdapterLoaded || m.T == TypeAdapterUnloaded {
		feature = FeatureAdapters
	}
	if !c.reg.Supports(feature) {
		return fmt.Errorf("%w: %s, but the session has no %s feature", ErrBadFrame, m.T, feature)
	}
	name := m.Model
	if m.T == TypeAddModel {
		name = m.Models[0].Name
	}
	c.lmu.Lock()
	defer c.lmu.Unlock() // one change at a time: each reads the last one's registration
	cur := c.live.Load()
	next, why := cur.clone(), ""
	i := slices.IndexFunc(next.Models, func(mo Model) bool { return mo.Name == name })
	switch m.T {
	case TypeAddModel:
		switch {
		case i >= 0:
			why = fmt.Sprintf("model %q is already registered", name)
		case len(next.Models) >= MaxModels:
			why = fmt.Sprintf("%d models registered, at most %d", len(next.Models), MaxModels)
		default:
			next.Models = append(next.Models, grant(m.Models[0], next))
		}
	case TypeRemoveModel:
		if i < 0 {
			why = fmt.Sprintf("model %q is not registered", name)
		} else {
			next.Models = slices.Delete(next.Models, i, i+1)
			delete(next.Adapters, name)
		}
	case TypeAdapterLoaded:
		as := next.Adapters[name]
		switch {
		case i < 0 || !slices.Contains(next.Models[i].Stages, StageDenoise):
			why = fmt.Sprintf("model %q is not registered with a denoise: an adapter changes the denoiser", name)
		case slices.Contains(as, m.Adapter):
			// Already loaded: taken, nothing changes.
		case len(as) >= MaxAdapters:
			why = fmt.Sprintf("%d adapters of model %q loaded, at most %d", len(as), name, MaxAdapters)
		default:
			as = append(as, m.Adapter)
			slices.Sort(as)
			next.Adapters[name] = as
		}
	case TypeAdapterUnloaded:
		as := next.Adapters[name]
		j := slices.Index(as, m.Adapter)
		if j < 0 {
			why = fmt.Sprintf("adapter %q of model %q is not loaded", m.Adapter, name)
		} else if as = slices.Delete(as, j, j+1); len(as) == 0 {
			delete(next.Adapters, name)
		} else {
			next.Adapters[name] = as
		}
	}
	if why == "" {
		c.live.Store(next)
		s := c.s
		s.mu.Lock()
		if s.cur == c {
			s.notifyLocked() // the agent re-advertises what it serves
		}
		s.mu.Unlock()
		c.log.Info("engine lifecycle", zap.String("frame", m.T), zap.String("model", name), zap.String("adapter", m.Adapter))
	} else {
		c.log.Warn("engine lifecycle frame refused", zap.String("frame", m.T), zap.String("model", name), zap.String("adapter", m.Adapter), zap.String("reason", why))
	}
	if err := c.write(&Msg{T: TypeAck, Model: name, Adapter: m.Adapter, Reason: why}); err != nil {
		return fmt.Errorf("send ack: %w", err)
	}
	return nil
}

// chunkReady hands on a denoise's chunk_ready: latent chunk m.Chunk of the
// task's output is final. A chunk out of the latent's range, reported
// twice, or of a task that is not a denoise ends the connection: a
// consumer may already be reading what was reported.
func (c *conn) chunkReady(m *Msg) error {
	if !c.reg.Supports(FeatureChunkReady) {
		return fmt.Errorf("%w: chunk_ready, but the session has no %s feature", ErrBadFrame, FeatureChunkReady)
	}
	p := c.task(m.Task)
	switch k := int(m.Chunk); {
	case p == nil:
		c.log.Debug("chunk_ready of unknown task", zap.Uint64("task", m.Task))
		return nil
	case p.lc.chunks == nil:
		return fmt.Errorf("%w: chunk_ready of task %d, which is not a denoise", ErrBadFrame, m.Task)
	case k >= len(p.lc.chunks):
		return fmt.Errorf("%w: chunk_ready of chunk %d of task %d, whose latent has %d chunks", ErrBadFrame, k, m.Task, len(p.lc.chunks))
	case p.lc.chunks[k]:
		return fmt.Errorf("%w: chunk_ready of chunk %d of task %d twice", ErrBadFrame, k, m.Task)
	default:
		p.lc.chunks[k] = true
		if p.lc.onChunk != nil {
			p.lc.onChunk(k)
		}
	}
	return nil
}

// lifecycleTask is what a task's pending entry keeps of the lifecycle.
type lifecycleTask struct {
	// chunks are a denoise's latent chunks, true once reported ready: set
	// when the request wants them (Request.ChunkReady), and written by the
	// reader goroutine until the task's answer.
	chunks  []bool
	onChunk func(k int)
	stream  *Stream
	last    bool
}

// lifecycleTask adds task m's lifecycle fields: the adapter of a denoise
// (which the engine must have loaded), the chunks a denoise reports, and a
// decode's place in its stream (opened on this connection by its chunk 0).
func (s *Server) lifecycleTask(c *conn, reg *Registration, m *Msg, p *pending, r Request) error {
	if a := r.Spec.Adapter; a != "" && r.Stage == StageDenoise {
		if !reg.Supports(FeatureAdapters) || !reg.HasAdapter(r.Model, a) {
			return fmt.Errorf("%w: adapter %q of model %q", ErrNoAdapter, a, r.Model)
		}
		m.Adapter = a
	}
	if r.Stage == StageDenoise && len(r.Output.Shape) > 0 {
		// Tracked whether or not the caller wants them: a chunk_ready is
		// checked against the latent's chunks either way.
		n := r.Output.Shape[0]
		if n < 1 || n > MaxLimitFrames {
			return fmt.Errorf("%w: a latent of %d chunks", ErrBadFrame, n)
		}
		p.lc.chunks, p.lc.onChunk = make([]bool, n), r.ChunkReady
	}
	if st := r.Stream; st != nil && r.Stage == StageDecode && reg.Supports(FeatureDecodeState) {
		if err := st.begin(c, m, r.LastChunk); err != nil {
			return err
		}
		p.lc.stream, p.lc.last = st, r.LastChunk
	}
	return nil
}

// answered completes a task's lifecycle once the engine answered (ok: done).
func (p *pending) answered(ok bool) {
	if st := p.lc.stream; st != nil {
		st.answered(ok, p.lc.last)
	}
}

// reportChunks reports the chunks of a finished denoise the engine did not
// report ready itself: at done, the whole latent is final.
func (p *pending) reportChunks() {
	if p.lc.onChunk == nil {
		return
	}
	for k, ready := range p.lc.chunks {
		if !ready {
			p.lc.onChunk(k)
		}
	}
}

// Stream is one decode stage's chunks on the engine (FeatureDecodeState):
// Run a Request with it for each chunk, in order, then Close it. Chunk 0
// opens it on the connection it goes to; a later chunk must go to the
// same connection, or fails with ErrLostState (the state died with the
// engine's connection), as does any chunk after one that failed: the
// decode stage then starts again. Without the feature a Stream is ignored.
type Stream struct {
	job string

	mu sync.Mutex
	// mu guards the fields below.
	c      *conn  // the connection chunk 0 went to (nil: none sent)
	id     uint64 // the stream's id on c
	next   int    // the next chunk's index
	ended  bool   // the engine dropped the state: after the last chunk, or a failed one
	broken bool   // a chunk failed: the state is lost
}

// NewStream starts a decode stream for job (its id, told to the engine).
func NewStream(job string) *Stream {
	if len(job) > MaxJobID {
		job = job[:MaxJobID]
	}
	return &Stream{job: job}
}

func (st *Stream) begin(c *conn, m *Msg, last bool) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	switch {
	case st.broken || st.c != nil && st.c != c:
		st.broken = true
		return fmt.Errorf("%w: chunk %d of the decode of job %s", ErrLostState, st.next, st.job)
	case st.ended:
		return fmt.Errorf("extengine: chunk %d of the decode of job %s after its last", st.next, st.job)
	case st.c == nil:
		st.c, st.id = c, c.streams.Add(1)
	}
	m.Stream, m.Job, m.Chunk, m.Last = st.id, st.job, int32(st.next), last
	return nil
}

func (st *Stream) answered(ok, last bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	switch {
	case !ok:
		st.broken = true // the engine drops the state of a failed or cancelled chunk
	case last:
		st.ended = true
	default:
		st.next++
	}
}

// Close ends the stream: if the engine may still hold its state (chunk 0
// went, the last did not come back done), it is told to drop it.
func (st *Stream) Close() {
	st.mu.Lock()
	c, id, open := st.c, st.id, st.c != nil && !st.ended
	st.ended = true
	st.mu.Unlock()
	if !open {
		return
	}
	select {
	case <-c.dead:
		return // the state went with the connection
	default:
	}
	if err := c.write(&Msg{T: TypeStreamEnd, Stream: id}); err != nil {
		c.fail(fmt.Errorf("send stream_end: %w", err))
	}
}
