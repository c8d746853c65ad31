package extengine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"net"
	"path/filepath"
	"slices"
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

	// v2 negotiates protocol v2 with checkpoints and the tensor cache;
	// the switches below break one v2 behaviour each.
	v2 bool
	// ckLate checkpoints one step after the steps asked for.
	ckLate bool
	// ckHalf writes half of a checkpoint's latent.
	ckHalf bool
	// resumeFromNoise ignores a resume's latent (the state alone).
	resumeFromNoise bool
	// ignoreStop runs on through a stop; stopNoCheckpoint ends stopped
	// without checkpointing.
	ignoreStop, stopNoCheckpoint bool
	// noPut never puts a tensor; cacheSkew uses a cached tensor off by a
	// little from the one it computes.
	noPut, cacheSkew bool
	// refuseResume fails every resume with bad_checkpoint.
	refuseResume bool

	// shapes also registers fakeShapes (checkshapes_test.go), with its
	// faults.
	shapes bool
	shapeFaults

	// lifecycleFaults.lifecycle negotiates decode_state, chunk_ready and
	// adapters for model fake (checklifecycle_test.go), with its faults.
	lifecycleFaults

	// batch > 1 has model fake batch its denoise and decode that many
	// tasks a call (each member still run as alone); batchSwap writes each
	// member the output of the next one's task, batchCancelAll stops
	// every member of a batch at a cancel of one.
	batch                     int32
	batchSwap, batchCancelAll bool
}

// fakeSampler names the fake's checkpoints.
const fakeSampler = "fake-sampler/1"

// fakeSession is one connection of a fakeEngine.
type fakeSession struct {
	f       fakeEngine
	c       *net.UnixConn
	mem     []byte
	version uint8
	wmu     sync.Mutex
	busy    atomic.Int32
	stop    chan struct{} // closed when the session ends

	mu sync.Mutex
	// mu guards the fields below.
	cancelled   map[uint64]bool
	stopped     map[uint64]bool
	acks        map[uint64]chan int32  // checkpointed answers, by task
	answers     map[uint64]chan *Msg   // tensor answers, by task
	streams     map[uint64][]byte      // a decode stream's state, by stream id
	lacks       []*Msg                 // the agent's acks of lifecycle frames
	adapterSent bool                   // adapter_loaded went (lifecycleFaults.adapterOnTask)
	forming     map[uint64][]*fakeTask // a batch's members come so far, by batch id
	batchOf     map[uint64][]*fakeTask // a batched task's batch, by task
}

// fakeTask is one task of a fakeSession: its frame and the channels its
// agent's answers arrive on (buffered: the reader loop never blocks).
type fakeTask struct {
	m       *Msg
	acks    chan int32
	answers chan *Msg
}

func (s *fakeSession) send(m *Msg) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	m.V = s.version
	return WriteMsg(s.c, m)
}

func (s *fakeSession) flag(set map[uint64]bool, id uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return set[id]
}

// serve dials path (retrying until the check listens), registers and
// serves tasks until the check closes the connection.
func (f fakeEngine) serve(ctx context.Context, path string) (err error) {
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
	model := Model{
		Name: "fake", Stages: []string{StageDenoise, StageDecode}, MaxSteps: f.maxSteps,
		Cond:   Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8},
	}
	reg := &Msg{T: TypeRegister, Engine: "fake/1", Models: []Model{model}}
	if f.v2 {
		reg.Models[0].Checkpoint = &CheckpointSpec{Sampler: fakeSampler, DType: "float32", Channels: 4}
		reg.Models[0].TensorCache = true
		reg.Versions, reg.Features = []int32{Version1, Version2}, []string{FeatureCheckpoint, FeatureTensorCache, "not_a_feature"}
	}
	if f.shapes {
		reg.Models = append(reg.Models, fakeShapes(f.shapeFaults))
		reg.Versions, reg.Features = []int32{Version1, Version2}, append(reg.Features, shapeFeatures...)
	}
	if f.lifecycle {
		reg.Versions, reg.Features = []int32{Version1, Version2}, append(reg.Features, FeatureDecodeState, FeatureChunkReady, FeatureAdapters)
	}
	if f.batch > 1 {
		reg.Models[0].Batch = map[string]int32{StageDenoise: f.batch, StageDecode: f.batch}
		reg.Versions, reg.Features = []int32{Version1, Version2}, append(reg.Features, FeatureBatch)
	}
	if err := WriteMsg(c, reg); err != nil {
		return err
	}
	if f.badSchema { // refused: the check reports why
		m, err := ReadMsg(c)
		if err != nil || m.T != TypeRefused {
			return fmt.Errorf("a malformed schema got %+v, %v; want refused", m, err)
		}
		return nil
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
	if want := []string{FeatureCheckpoint, FeatureTensorCache}; f.v2 && (w.Version != Version2 || !slices.Equal(w.Features[:min(2, len(w.Features))], want)) {
		unix.Close(fds[0])
		return fmt.Errorf("welcome chose version %d, features %v; want 2 and checkpoint, tensor_cache", w.Version, w.Features)
	}
	mem, err := unix.Mmap(fds[0], 0, int(w.ArenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	unix.Close(fds[0])
	if err != nil {
		return err
	}
	defer unix.Munmap(mem)
	s := &fakeSession{f: f, c: c, mem: mem, version: max(w.Version, Version1), stop: make(chan struct{}),
		cancelled: map[uint64]bool{}, stopped: map[uint64]bool{}, acks: map[uint64]chan int32{}, answers: map[uint64]chan *Msg{},
		streams: map[uint64][]byte{}, forming: map[uint64][]*fakeTask{}, batchOf: map[uint64][]*fakeTask{}}
	if f.lifecycle {
		if err := s.welcomed(w); err != nil {
			return err
		}
		defer func() {
			if err == nil {
				err = s.adapterTaken()
			}
		}()
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(time.Duration(w.HeartbeatMS) * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
			// Under the write lock, so an "idle" beat is written before
			// any frame of a task that starts after it looked.
			s.wmu.Lock()
			if f.beats == "always" || (f.beats == "idle" && s.busy.Load() == 0) {
				WriteMsg(s.c, &Msg{V: s.version, T: TypeHeartbeat})
			}
			s.wmu.Unlock()
		}
	})
	defer func() { close(s.stop); wg.Wait() }()
	for {
		m, err := ReadMsg(c)
		if err != nil {
			return nil // the check closed the connection
		}
		s.mu.Lock()
		switch m.T {
		case TypeTask:
			if f.lifecycle && f.adapterOnTask && !s.adapterSent {
				s.adapterSent = true
				s.loadAdapter()
			}
			s.busy.Add(1)
			t := &fakeTask{m: m, acks: make(chan int32, 1), answers: make(chan *Msg, 1)}
			s.acks[m.Task], s.answers[m.Task] = t.acks, t.answers
			if m.Batch == 0 {
				wg.Go(func() { s.run(t) })
				break
			}
			members := append(s.forming[m.Batch], t)
			s.forming[m.Batch] = members
			if len(members) < int(m.BatchSize) {
				break
			}
			delete(s.forming, m.Batch)
			for i, mt := range members {
				s.batchOf[mt.m.Task] = members
				if f.batchSwap { // the next member's task, into this one's output
					other := *members[(i+1)%len(members)].m
					other.Task, other.Output = mt.m.Task, mt.m.Output
					mt.m = &other
				}
				wg.Go(func() { s.run(mt) })
			}
		case TypeCancel:
			s.cancelled[m.Task] = true
			if f.batchCancelAll {
				for _, mt := range s.batchOf[m.Task] {
					s.cancelled[mt.m.Task] = true
				}
			}
		case TypeStop:
			s.stopped[m.Task] = true
		case TypeCheckpointed:
			s.acks[m.Task] <- m.Step
		case TypeTensor:
			s.answers[m.Task] <- m
		case TypeStreamEnd:
			if !f.keepAfterEnd {
				delete(s.streams, m.Stream)
			}
		case TypeAck:
			s.lacks = append(s.lacks, m)
		}
		s.mu.Unlock()
	}
}

func (s *fakeSession) run(t *fakeTask) {
	defer s.busy.Add(-1)
	m := t.m
	if m.Model == fakeShapesName {
		s.send(s.runShapes(m))
		return
	}
	out := s.mem[m.Output.Off : m.Output.Off+m.Output.Len]
	switch m.Stage {
	case StageDenoise:
		if end := s.denoise(t, out); end != nil {
			s.send(end)
			return
		}
	case StageDecode:
		in := m.Inputs[0]
		if math.IsNaN(float64(math.Float32frombits(binary.LittleEndian.Uint32(s.mem[in.Off:])))) {
			s.send(&Msg{T: TypeFailed, Task: m.Task, Code: CodeBadInput, Reason: "latent holds NaN"})
			return
		}
		if s.f.lifecycle {
			s.send(s.decodeCausal(m, s.mem[in.Off:in.Off+in.Len], out))
			return
		}
		if s.f.halfDecode {
			out = out[:len(out)/2]
		}
		for i := range out {
			out[i] = 0xff // all white: a legitimate image
		}
	}
	s.send(&Msg{T: TypeDone, Task: m.Task})
}

// denoise runs the fake sampler: x starts from the seed and each step k
// mixes in k and the "negative branch" nb, a function of the
// conditioning's second row (cached when the session has a tensor cache).
// It returns the frame that ends the task, or nil when the output is
// written.
func (s *fakeSession) denoise(t *fakeTask, out []byte) *Msg {
	f, m := s.f, t.m
	steps := int32(m.Spec.Steps)
	x := make([]float32, len(out)/4)
	for i := range x {
		x[i] = float32(m.Spec.Seed%97)*0.01 + float32(i)*0.001
	}
	start := int32(0)
	if r := m.Resume; r != nil {
		if f.refuseResume {
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeBadCheckpoint, Reason: "this engine resumes nothing"}
		}
		if r.Sampler != fakeSampler || len(r.State) != 4 || int32(binary.LittleEndian.Uint32(r.State)) != r.Step {
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeBadCheckpoint, Reason: "not this sampler's checkpoint"}
		}
		start = r.Step
		if !f.resumeFromNoise {
			lat := s.mem[r.Latent.Off : r.Latent.Off+r.Latent.Len]
			for i := range x {
				x[i] = math.Float32frombits(binary.LittleEndian.Uint32(lat[4*i:]))
			}
		}
	}
	nb := s.negativeBranch(t)
	final := 0 // x[:final] is written and reported ready (chunk_ready)
	lastCk, acked := start, true
	checkpoint := func(step int32) {
		if !acked {
			<-t.acks // the buffer is ours again once the agent copied the last one
		}
		buf := s.mem[m.CheckpointBuf.Off : m.CheckpointBuf.Off+m.CheckpointBuf.Len]
		if f.ckHalf {
			buf = buf[:len(buf)/2]
		}
		for i := 0; i+4 <= len(buf); i += 4 {
			binary.LittleEndian.PutUint32(buf[i:], math.Float32bits(x[i/4]))
		}
		s.send(&Msg{T: TypeCheckpoint, Task: m.Task, Step: step, Total: steps, State: binary.LittleEndian.AppendUint32(nil, uint32(step))})
		lastCk, acked = step, false
	}
	for i := start + 1; i <= steps; i++ {
		if s.flag(s.cancelled, m.Task) && !f.ignoreCancel {
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeCancelled, Reason: "cancelled"}
		}
		if s.flag(s.stopped, m.Task) && !f.ignoreStop {
			if lastCk != i-1 && !f.stopNoCheckpoint {
				checkpoint(i - 1)
			}
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeStopped, Reason: "stopped"}
		}
		if f.step > 0 {
			select {
			case <-s.stop:
				return &Msg{T: TypeFailed, Task: m.Task, Code: CodeCancelled, Reason: "closing"}
			case <-time.After(f.step):
			}
		}
		for j := range x {
			x[j] = x[j]*0.75 + 0.01*float32(i) + nb[j%len(nb)]
		}
		if s.send(&Msg{T: TypeProgress, Task: m.Task, Step: i, Total: steps}) != nil {
			return &Msg{T: TypeFailed, Task: m.Task, Code: CodeInternal, Reason: "connection"}
		}
		final = s.readyChunks(m, i, x, out, final)
		at := i
		if f.ckLate {
			at--
		}
		if e := m.CheckpointEvery; e > 0 && at > 0 && at%e == 0 && i < steps {
			checkpoint(i)
		}
	}
	for i := final; i < len(x); i++ {
		binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(x[i]))
	}
	return nil
}

// negativeBranch is the fake's tensor computed from conditioning alone:
// from the cache when the task may use it, else computed (and put).
func (s *fakeSession) negativeBranch(t *fakeTask) []float32 {
	m := t.m
	cond := m.Inputs[0]
	half := s.mem[cond.Off+cond.Len/2 : cond.Off+cond.Len]
	nb := make([]float32, 16)
	for j := range nb {
		nb[j] = math.Float32frombits(binary.LittleEndian.Uint32(half[4*j:]))*0.5 + 0.001*float32(j)
	}
	if !s.f.v2 { // no tensor cache asked for
		return nb
	}
	sum := crc32.Checksum(half, castagnoli)
	key := fmt.Sprintf("neg/%08x", sum)
	if s.send(&Msg{T: TypeTensorGet, Task: m.Task, Key: key, Len: 4 * int64(len(nb))}) != nil {
		return nb
	}
	var a *Msg
	select {
	case a = <-t.answers:
	case <-s.stop:
		return nb
	}
	if a.Found {
		v := s.mem[a.Region.Off : a.Region.Off+a.Region.Len]
		for j := range nb {
			nb[j] = math.Float32frombits(binary.LittleEndian.Uint32(v[4*j:]))
			if s.f.cacheSkew {
				nb[j] += 0.001
			}
		}
		return nb
	}
	if s.f.noPut {
		return nb
	}
	put := &Msg{T: TypeTensorPut, Task: m.Task, Key: key}
	var v []byte
	if a.Region != nil {
		v = s.mem[a.Region.Off : a.Region.Off+a.Region.Len]
	} else {
		v = make([]byte, 4*len(nb))
		put.Data = v
	}
	for j, f := range nb {
		binary.LittleEndian.PutUint32(v[4*j:], math.Float32bits(f))
	}
	s.send(put)
	return nb
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

// A correct engine passes every check, of protocol v1 and of v2; its
// decoder writes an all-white image, which the old "not every byte left
// 0xff" heuristic failed.
func TestCheckPassesCorrectEngine(t *testing.T) {
	for _, v2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("v2=%v", v2), func(t *testing.T) {
			res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 20 * time.Millisecond, v2: v2})
			if !ok {
				t.Fatalf("a correct engine fails the check:\n%s", out)
			}
			names := map[string]bool{}
			for _, r := range res {
				names[r.Name] = true
				switch {
				case r.Name == "crash restart" || (r.Name == "protocol v2" && !v2):
					if !r.Skip {
						t.Errorf("want a skip: %s", r)
					}
				case !r.Pass:
					t.Errorf("a correct engine: %s", r)
				}
			}
			for _, n := range []string{"checkpoint", "resume", "stop", "tensor cache"} {
				if names[n] != v2 {
					t.Errorf("check %q ran: %v, want %v", n, names[n], v2)
				}
			}
			if want := "protocol v2 [checkpoint tensor_cache]"; v2 && !strings.Contains(result(t, res, "register").Detail, want) {
				t.Errorf("register line %q does not say %q", result(t, res, "register"), want)
			}
		})
	}
}

// Each broken v2 behaviour fails its check with a line saying what is
// wrong, and the others still pass.
func TestCheckFailsBrokenV2(t *testing.T) {
	for _, tc := range []struct {
		name  string
		f     fakeEngine
		check string
		want  string
		// alsoFails are the checks the same fault fails too (a stop's
		// checkpoint is resumed, so a bad resume fails both).
		alsoFails []string
	}{
		{"checkpoints a step late", fakeEngine{ckLate: true}, "checkpoint", "asked for a checkpoint every 3 steps of 8, got checkpoints after steps [4 7], want [3 6]", nil},
		{"half a checkpoint latent", fakeEngine{ckHalf: true}, "checkpoint", "the checkpoint after step 3 left 512 of its latent's 1024 bytes unwritten (first at byte 512)", []string{"stop"}},
		{"resume ignores the latent", fakeEngine{resumeFromNoise: true}, "resume", "resumed from the checkpoint after step 3 of 8, the output differs from an uninterrupted run's", []string{"stop"}},
		{"refuses its own checkpoints", fakeEngine{refuseResume: true}, "resume", "a resume from the checkpoint after step 3 of 8 failed: engine failed the task (bad_checkpoint): this engine resumes nothing", []string{"stop"}},
		{"ignores a stop", fakeEngine{ignoreStop: true}, "stop", "stopped after step 10 of 50, but the engine went on to step 50 (it must stop within one step)", nil},
		{"stops without a checkpoint", fakeEngine{stopNoCheckpoint: true}, "stop", "but sent no checkpoint: a stop must checkpoint the last step done", nil},
		{"puts nothing", fakeEngine{noPut: true}, "tensor cache", "model fake declares tensor_cache, but a denoise with an empty cache put no tensor (it asked for [neg/", nil},
		{"a cached tensor changes the output", fakeEngine{cacheSkew: true}, "tensor cache", "with the tensors the first run put the output differs from a run without a cache", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.f
			f.beats, f.step, f.v2 = "always", 10*time.Millisecond, true
			res, ok, out := runCheck(t, f)
			r := result(t, res, tc.check)
			if ok || !r.Failed() {
				t.Fatalf("an engine that %s passes:\n%s", tc.name, out)
			}
			if !strings.Contains(r.Detail, tc.want) {
				t.Errorf("%s line %q, want it to contain %q", tc.check, r, tc.want)
			}
			for _, other := range res {
				if other.Name != tc.check && other.Failed() && !slices.Contains(tc.alsoFails, other.Name) {
					t.Errorf("an engine that only %s fails another check too: %s", tc.name, other)
				}
			}
		})
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

// Batching: an engine that runs each member of a batch as alone passes;
// one that mixes members' results up, or stops a whole batch at a cancel
// of one member, fails with a line saying so.
func TestCheckBatch(t *testing.T) {
	for _, tc := range []struct {
		name  string
		f     fakeEngine
		check string
		want  string
	}{
		{"correct", fakeEngine{}, "", ""},
		{"swaps members' outputs", fakeEngine{batchSwap: true}, "batch denoise fake", "member 0 of a batch of 4 wrote an output that is not its own"},
		{"cancels the whole batch", fakeEngine{batchCancelAll: true}, "batch denoise fake", "failed when member 1 was cancelled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.f
			f.beats, f.step, f.batch = "always", 10*time.Millisecond, 4
			res, ok, out := runCheck(t, f)
			for _, n := range []string{"batch denoise fake", "batch decode fake"} {
				r := result(t, res, n)
				switch {
				case n == tc.check && (ok || !r.Failed() || !strings.Contains(r.Detail, tc.want)):
					t.Errorf("an engine that %s: %s, want a failure saying %q", tc.name, r, tc.want)
				case n != tc.check && !r.Pass:
					t.Errorf("an engine that %s: %s", tc.name, r)
				}
			}
			if tc.check == "" && !ok {
				t.Errorf("a correct batching engine fails the check:\n%s", out)
			}
		})
	}
}
