package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// stubEngine registers models on an agent's engine socket as engine
// "stub/1", heartbeats, and fails every task it is sent: enough for a test
// of what happens at submission.
func stubEngine(t *testing.T, ctx context.Context, socket string, models []extengine.Model) {
	t.Helper()
	stubEngineAs(t, ctx, socket, "stub/1", false, models)
}

// stubEngineAs is stubEngine registering as engine name; with encode, it
// answers encode tasks done, their output left as the arena held it. It
// returns a function that disconnects the engine.
func stubEngineAs(t *testing.T, ctx context.Context, socket, name string, encode bool, models []extengine.Model) (disconnect func()) {
	t.Helper()
	conn, err := (&net.Dialer{}).DialContext(ctx, "unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithCancel(ctx)
	if err := extengine.WriteMsg(conn, &extengine.Msg{T: extengine.TypeRegister, Engine: name, Models: models}); err != nil {
		t.Fatal(err)
	}
	// The welcome's arena fd is dropped by a plain read: this engine
	// writes no tensor.
	if m, err := extengine.ReadMsg(conn); err != nil || m.T != extengine.TypeWelcome {
		t.Fatalf("registration: %+v, %v", m, err)
	}
	frames := make(chan *extengine.Msg, 16) // one writer: the goroutine below
	go func() {
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case m := <-frames:
				extengine.WriteMsg(conn, m)
			case <-tick.C:
				extengine.WriteMsg(conn, &extengine.Msg{T: extengine.TypeHeartbeat})
			}
		}
	}()
	go func() {
		for {
			m, err := extengine.ReadMsg(conn)
			if err != nil {
				return
			}
			switch {
			case m.T == extengine.TypeTask && encode && m.Stage == extengine.StageEncode:
				frames <- &extengine.Msg{T: extengine.TypeDone, Task: m.Task}
			case m.T == extengine.TypeTask:
				frames <- &extengine.Msg{T: extengine.TypeFailed, Task: m.Task, Code: extengine.CodeInternal, Reason: "stub engine runs nothing"}
			}
		}
	}()
	return func() { cancel(); conn.Close() }
}

// Issue 20, done-when 1: a model registered with limits 1280x720 x 81
// frames (sides in multiples of 16, frames 4k+1) accepts an 832x480x81
// request at an agent that does not run it (the limits travel in the
// engine agent's node record) and refuses larger ones at submission with
// its own limit in the message; the built-in engine's limits are unchanged.
func TestModelLimitsFromRegistration(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := startCluster(t, "", nil)
	all := []jobs.Stage{jobs.Encode, jobs.Denoise, jobs.Decode}
	front, err := c.AddAgent(ctx, "front", all...)
	if err != nil {
		t.Fatal(err)
	}
	gpu := addEngineAgent(t, ctx, c, "wan-gpu", t.TempDir(), all...)
	stubEngine(t, ctx, gpu.EngineSocket(), []extengine.Model{{
		Name: "wan-stub", Stages: []string{"encode", "denoise", "decode"}, DefaultSteps: 50,
		MaxSide: 1280, MaxFramePixels: 1280 * 720, MaxFrames: 81, SideMultiple: 16, FrameStep: 4, FrameOffset: 1,
		Cond:   extengine.Layout{DType: "float32", Shape: []int64{512, 64}},
		Latent: extengine.LatentLayout{DType: "float32", Channels: 16, Scale: 8},
	}})
	for {
		l, ok := front.ModelLimits("wan-stub")
		if ok && front.ModelServed("wan-stub") {
			if l.MaxFrames != 81 || l.MaxPixels != 1280*720*81 || l.FrameStep != 4 {
				t.Fatalf("limits as the front agent reads them: %+v", l)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the front agent never saw the model's limits")
		}
		time.Sleep(20 * time.Millisecond)
	}

	submit := func(body string) (int, string) {
		t.Helper()
		code, b := post(t, "http://"+front.HTTPAddr()+"/v1/jobs", body)
		return code, string(b)
	}
	code, body := submit(`{"model":"wan-stub","prompt":"a red fox","width":832,"height":480,"frames":81}`)
	if code != http.StatusAccepted && code != http.StatusCreated {
		t.Fatalf("832x480x81 for wan-stub: %d %s, want it accepted", code, body)
	}
	var job struct {
		ID   string      `json:"id"`
		Spec engine.Spec `json:"spec"`
	}
	if err := json.NewDecoder(bytes.NewReader([]byte(body))).Decode(&job); err != nil || job.ID == "" {
		t.Fatalf("answer %s: %v", body, err)
	}
	if job.Spec.Steps != 50 {
		t.Errorf("steps %d, want the model's registered default 50", job.Spec.Steps)
	}
	for _, tc := range []struct{ body, want string }{
		{`{"model":"wan-stub","prompt":"x","width":1280,"height":1024,"frames":81}`, "more than 921600"},
		{`{"model":"wan-stub","prompt":"x","width":832,"height":480,"frames":121}`, "[1,81]"},
		{`{"model":"wan-stub","prompt":"x","width":832,"height":480,"frames":80}`, "4k+1"},
		{`{"model":"wan-stub","prompt":"x","width":840,"height":480,"frames":81}`, "multiple of 16"},
		{`{"model":"wan-stub","prompt":"x","width":1296,"height":480,"frames":81}`, "[64,1280]"},
		// The built-in model keeps its own limits.
		{`{"prompt":"x","width":832,"height":480,"frames":81}`, "[1,64]"},
	} {
		if code, body := submit(tc.body); code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want 400 naming %q", tc.body, code, body, tc.want)
		}
	}
}
