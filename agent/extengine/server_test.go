package extengine

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

func testServer(t *testing.T) (*Server, *arena.Arena) {
	t.Helper()
	return testServerOn(t, func(ar *arena.Arena) Arena { return checkArena{ar} })
}

// testServerOn is testServer with the Server's view of the arena made by
// wrap (one without an allocator grants no v2 feature).
func testServerOn(t *testing.T, wrap func(*arena.Arena) Arena) (*Server, *arena.Arena) {
	t.Helper()
	return testServerWith(t, wrap, func(*Config) {})
}

// testServerWith is testServerOn with the config changed by tweak.
func testServerWith(t *testing.T, wrap func(*arena.Arena) Arena, tweak func(*Config)) (*Server, *arena.Arena) {
	t.Helper()
	ar, err := arena.New(arena.Config{Name: "extengine-test", Size: 4 << 20, Align: 4096})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ar.Close() })
	cfg := DefaultConfig(filepath.Join(t.TempDir(), "engine.sock"))
	cfg.HeartbeatEvery, cfg.HeartbeatTimeout, cfg.CancelGrace = 50*time.Millisecond, 300*time.Millisecond, time.Second
	cfg.Logger = zaptest.NewLogger(t)
	tweak(&cfg)
	s, err := Listen(cfg, wrap(ar))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, ar
}

// goEngine is a minimal engine written against the wire format, standing
// in for the Python SDK on the other end of the socket.
type goEngine struct {
	c       *net.UnixConn
	mem     []byte // the agent's arena, mapped from the fd it passed
	welcome *Msg
}

func dialEngine(t *testing.T, s *Server) *goEngine {
	t.Helper()
	return dialEngineWith(t, s, validRegister())
}

// dialEngineWith connects and registers with reg.
func dialEngineWith(t *testing.T, s *Server, reg *Msg) *goEngine {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.Addr(), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := WriteMsg(c, reg); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	scms, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(scms) != 1 {
		t.Fatalf("welcome carried no fd: %v", err)
	}
	fds, err := unix.ParseUnixRights(&scms[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("welcome fds: %v %v", fds, err)
	}
	defer unix.Close(fds[0])
	m, err := DecodeMsg(buf[4:n])
	if err != nil || m.T != TypeWelcome {
		t.Fatalf("welcome: %+v %v", m, err)
	}
	mem, err := unix.Mmap(fds[0], 0, int(m.ArenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return &goEngine{c: c, mem: mem, welcome: m}
}

// send writes m stamped with the session's version.
func (e *goEngine) send(t *testing.T, m *Msg) {
	t.Helper()
	m.V = max(e.welcome.Version, Version1)
	if err := WriteMsg(e.c, m); err != nil {
		t.Fatal(err)
	}
}

// next reads frames until one that is not a heartbeat.
func (e *goEngine) next(t *testing.T) *Msg {
	t.Helper()
	for {
		m, err := ReadMsg(e.c)
		if err != nil {
			t.Fatal(err)
		}
		if m.T != TypeHeartbeat {
			return m
		}
	}
}

func decodeRequest(t *testing.T, ar *arena.Arena) Request {
	t.Helper()
	in, err := ar.Alloc(4 * 4 * 8 * 8)
	if err != nil {
		t.Fatal(err)
	}
	out, err := ar.Alloc(64 * 64 * 4)
	if err != nil {
		t.Fatal(err)
	}
	return Request{Stage: StageDecode, Model: "m", Spec: engine.Spec{Model: "m", Prompt: "p", Width: 64, Height: 64, Frames: 1, Steps: 1},
		Inputs: []Tensor{{DType: "float32", Shape: []int64{1, 4, 8, 8}, Data: ar.Slice(in)}},
		Output: Tensor{DType: "uint8", Shape: []int64{1, 64, 64, 4}, Data: ar.Slice(out)}, Frames: 1}
}

// A task's output is written by the engine through its own mapping of the
// arena and read by the agent in place: no bytes cross the socket.
func TestTaskWritesArenaInPlace(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngine(t, s)
	req := decodeRequest(t, ar)
	done := make(chan error, 1)
	go func() { done <- s.Run(context.Background(), req) }()
	m := e.next(t)
	if m.T != TypeTask || m.Output == nil || m.Output.Len != int64(len(req.Output.Data)) {
		t.Fatalf("task frame %+v", m)
	}
	for i := range m.Output.Len {
		e.mem[m.Output.Off+i] = byte(i)
	}
	WriteMsg(e.c, &Msg{T: TypeDone, Task: m.Task})
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for i, b := range req.Output.Data {
		if b != byte(i) {
			t.Fatalf("output byte %d is %d, want %d: the engine's write did not land in the arena", i, b, byte(i))
		}
	}
}

// An engine that stops sending heartbeats is dropped within the timeout;
// its running task fails with ErrEngineLost (the agent then abandons it).
func TestSilentEngineIsDropped(t *testing.T) {
	s, ar := testServer(t)
	e := dialEngine(t, s)
	if s.Engine() == nil {
		t.Fatal("engine not registered after welcome")
	}
	go func() {
		for { // read (so our writes never block) but never answer
			if _, err := ReadMsg(e.c); err != nil {
				return
			}
		}
	}()
	start := time.Now()
	err := s.Run(context.Background(), decodeRequest(t, ar))
	if !errors.Is(err, ErrEngineLost) {
		t.Fatalf("Run on a silent engine: %v, want ErrEngineLost", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("silent engine dropped after %v, want about the 300ms heartbeat timeout", took)
	}
	if s.Engine() != nil {
		t.Error("the silent engine still counts as registered")
	}
}

// Hostile or malformed frames close the connection; the server stays up
// and a well-behaved engine registers afterwards.
func TestHostileFramesCloseConnection(t *testing.T) {
	s, _ := testServer(t)
	frames := map[string][]byte{
		"length over MaxFrame": {0x7f, 0xff, 0xff, 0xff},
		"garbage":              {0, 0, 0, 3, 0xc1, 0xc1, 0xc1},
		"array of 2^32-1":      {0, 0, 0, 8, 0x81, 0xa1, 't', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"heartbeat first":      mustEncode(t, &Msg{T: TypeHeartbeat}),
	}
	for name, f := range frames {
		c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: s.Addr(), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		c.Write(f)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, err := ReadMsg(c) // a refusal, then EOF
		if err == nil && m.T != TypeRefused {
			t.Errorf("%s: answered %q, want a refusal", name, m.T)
		}
		if err == nil {
			_, err = ReadMsg(c)
		}
		if err == nil || errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
			t.Errorf("%s: connection not closed (%v)", name, err)
		}
		c.Close()
	}
	e := dialEngine(t, s)
	if s.Engine() == nil || e == nil {
		t.Fatal("a good engine could not register after hostile ones")
	}
	// After registration, a frame an engine may not send ends the connection.
	WriteMsg(e.c, &Msg{T: TypeWelcome, ArenaSize: 1, HeartbeatMS: 1})
	timeout := time.After(5 * time.Second)
	for ch := s.Changed(); s.Engine() != nil; ch = s.Changed() {
		select {
		case <-ch:
		case <-timeout:
			t.Fatal("an engine that sent a welcome frame is still registered")
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func mustEncode(t *testing.T, m *Msg) []byte {
	b, err := EncodeMsg(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
