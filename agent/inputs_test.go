package agent

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// i2vModel is a Wan-like image-to-video model: a 4x temporal latent
// (frames 4k+1, up to 81), a required reference image at encode, and a
// shift parameter.
func i2vModel() extengine.Model {
	return extengine.Model{
		Name: "i2v", Stages: []string{extengine.StageEncode, extengine.StageDenoise, extengine.StageDecode},
		MaxSide: 256, MaxFrames: 81, FrameStep: 4, FrameOffset: 1,
		Cond:   extengine.Layout{DType: "float32", Shape: []int64{2, 8}},
		Latent: extengine.LatentLayout{DType: "float32", Channels: 4, Scale: 8, Temporal: 4},
		Image:  &extengine.ImageDecl{Stages: []string{extengine.StageEncode}, Required: true},
		Params: []engine.ParamSpec{{Name: "shift", Type: engine.ParamTypeNumber, Min: 1, Max: 10, Default: engine.NumberParam(5)}},
	}
}

// refusingEngine registers m on the agent's engine socket and fails every
// task with bad_input, handing each task frame and the ref_image bytes it
// saw to tasks.
type refusingEngine struct {
	tasks chan *extengine.Msg
	image chan []byte
}

func startRefusingEngine(t *testing.T, socket string, m extengine.Model) *refusingEngine {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: socket, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	reg := &extengine.Msg{T: extengine.TypeRegister, Engine: "refusing/1", Versions: []int32{extengine.Version1, extengine.Version2},
		Features: []string{extengine.FeatureTemporal, extengine.FeatureImage, extengine.FeatureParams}, Models: []extengine.Model{m}}
	if err := extengine.WriteMsg(c, reg); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	scms, _ := unix.ParseSocketControlMessage(oob[:oobn])
	if len(scms) != 1 {
		t.Fatal("welcome carried no fd")
	}
	fds, _ := unix.ParseUnixRights(&scms[0])
	w, err := extengine.DecodeMsg(buf[4:n])
	if err != nil || len(fds) != 1 {
		t.Fatalf("welcome %+v, %v", w, err)
	}
	mem, err := unix.Mmap(fds[0], 0, int(w.ArenaSize), unix.PROT_READ, unix.MAP_SHARED)
	unix.Close(fds[0])
	if err != nil {
		t.Fatal(err)
	}
	e := &refusingEngine{tasks: make(chan *extengine.Msg, 8), image: make(chan []byte, 8)}
	var wmu sync.Mutex
	send := func(m *extengine.Msg) {
		wmu.Lock()
		defer wmu.Unlock()
		m.V = w.Version
		extengine.WriteMsg(c, m)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // heartbeats: the agent drops a silent engine
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
				send(&extengine.Msg{T: extengine.TypeHeartbeat})
			}
		}
	})
	wg.Go(func() {
		for {
			m, err := extengine.ReadMsg(c)
			if err != nil {
				return
			}
			switch m.T {
			case extengine.TypeTask:
				var img []byte
				if r := m.RefImage; r != nil {
					img = bytes.Clone(mem[r.Off : r.Off+r.Len])
				}
				e.tasks <- m
				e.image <- img
				send(&extengine.Msg{T: extengine.TypeFailed, Task: m.Task, Code: extengine.CodeBadInput, Reason: "refusing engine"})
			case extengine.TypeCancel:
				send(&extengine.Msg{T: extengine.TypeFailed, Task: m.Task, Code: extengine.CodeCancelled})
			}
		}
	})
	t.Cleanup(func() { close(stop); c.Close(); wg.Wait(); unix.Munmap(mem) })
	return e
}

// Issue 20, at submission: a request for a model with a parameter schema,
// a temporal latent and a reference image is checked against what the
// engine registered (in the node record), by the agent taking it; its
// parameters are completed with their defaults, 81 frames map to 21 latent
// frames, and the image becomes a Store object of the job that the encode
// task gets in the arena and that is released when the job ends.
func TestSubmitInputs(t *testing.T) {
	a, _, _ := startAgentWith(t, "inputs-1", func(c *Config) {
		c.External.Socket = filepath.Join(t.TempDir(), "engine.sock")
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e := startRefusingEngine(t, a.EngineSocket(), i2vModel())
	for !a.ModelServed("i2v") {
		if ctx.Err() != nil {
			t.Fatal("the engine's model was never served")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for {
		if rec, ok := a.modelRecordFor("i2v"); ok && rec.Temporal == 4 {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("the model's record never said temporal 4")
		}
		time.Sleep(20 * time.Millisecond)
	}
	pix := bytes.Repeat([]byte{1, 2, 3, 255}, 16*8)
	upload := &jobs.ImageUpload{Width: 16, Height: 8, Pix: pix}
	spec := engine.Spec{Model: "i2v", Prompt: "a fox", Seed: 1, Width: 64, Height: 64, Frames: 81, Steps: 2, GuidanceScale: 5}

	big := &jobs.ImageUpload{Width: 4097, Height: 1, Pix: make([]byte, 4*4097)}
	for _, tc := range []struct {
		name   string
		img    *jobs.ImageUpload
		params engine.Params
		field  string
		want   string
	}{
		{"no image", nil, nil, "image", "the model needs a reference image"},
		{"an unknown parameter", upload, engine.Params{"shfit": engine.NumberParam(2)}, "params", `"shfit": unknown; the model takes shift`},
		{"a parameter out of range", upload, engine.Params{"shift": engine.NumberParam(0)}, "params", `"shift": 0: must be in [1,10]`},
		{"an image too large", big, nil, "image", "4097x1"},
	} {
		s := spec
		s.Params = tc.params
		_, err := a.Submit(ctx, s, jobs.Options{Image: tc.img})
		var fe *engine.FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field || !strings.Contains(fe.Msg, tc.want) {
			t.Errorf("%s: %v, want a %s error saying %q", tc.name, err, tc.field, tc.want)
		}
	}
	// The built-in model takes neither.
	if _, err := a.Submit(ctx, engine.Spec{Prompt: "x", Width: 64, Height: 64, Frames: 1, Steps: 1, Params: engine.Params{"shift": engine.NumberParam(2)}}, jobs.Options{}); err == nil || !strings.Contains(err.Error(), "takes no parameters") {
		t.Errorf("params for the built-in model: %v", err)
	}

	j, err := a.Submit(ctx, spec, jobs.Options{Image: upload})
	if err != nil {
		t.Fatal(err)
	}
	if j.LatentFrames != 21 || j.Spec.Params["shift"] != engine.NumberParam(5) || j.Spec.Image == nil || j.Spec.Image.Object != jobs.ImageID(j.ID) {
		t.Fatalf("job: latent frames %d, params %v, image %+v; want 21, shift 5, the job's image object", j.LatentFrames, j.Spec.Params, j.Spec.Image)
	}
	if _, err := a.cstore.Lookup(ctx, j.Spec.Image.Object); err != nil {
		t.Fatalf("the image object: %v", err)
	}
	var task *extengine.Msg
	select {
	case task = <-e.tasks:
	case <-ctx.Done():
		t.Fatal("no task reached the engine")
	}
	got := <-e.image
	if task.Stage != extengine.StageEncode || !bytes.Equal(got, pix) || task.Params["shift"] != engine.NumberParam(5) {
		t.Errorf("encode task %s: image of %d bytes (equal to the upload: %v), params %v", task.Stage, len(got), bytes.Equal(got, pix), task.Params)
	}
	// A fork copies the spec, image reference and all: refused, the image
	// being its job's.
	if _, err := a.Submit(ctx, j.Spec, jobs.Options{}); err == nil || !strings.Contains(err.Error(), "cannot be forked") {
		t.Errorf("a spec referring to another job's image: %v, want refused", err)
	}
	done, err := a.Wait(ctx, j.ID)
	if err != nil || done.State != jobs.Failed {
		t.Fatalf("job after the engine refused it: %s, %v", done.State, err)
	}
	if _, err := a.cstore.Lookup(ctx, j.Spec.Image.Object); !errors.Is(err, cache.ErrNotFound) {
		t.Errorf("the image object after the job failed: %v, want it released", err)
	}
}
