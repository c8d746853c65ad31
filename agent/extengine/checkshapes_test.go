package extengine

import (
	"encoding/binary"
	"hash/crc32"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// fakeShapesName is the fake engine's second model, using every shape.
const fakeShapesName = "fake-shapes"

// shapeFaults break one shape behaviour each.
type shapeFaults struct {
	// halfNamed writes half of the pooled named tensor.
	halfNamed bool
	// badSchema declares a parameter whose range is upside down.
	badSchema bool
	// cutDecode decodes a latent frame by its place in the task rather
	// than in the video: chunks decode differently from the whole.
	cutDecode bool
	// ignoreImage never reads the reference image.
	ignoreImage bool
}

// fakeShapes: tokens [16, 8] float32 of variable length and a pooled [4]
// float16 vector, a 4x temporal latent, an image at denoise, a rescale.
func fakeShapes(f shapeFaults) Model {
	conds := []CondTensor{{Name: "tokens", DType: "float32", Shape: []int64{16, 8}, VarLen: true}, {Name: "pooled", DType: "float16", Shape: []int64{4}}}
	l, _ := condLayout(conds)
	p := engine.ParamSpec{Name: "rescale", Type: engine.ParamTypeNumber, Min: 0, Max: 1, Default: engine.NumberParam(0)}
	if f.badSchema {
		p.Min, p.Max = 5, 1
	}
	return Model{Name: fakeShapesName, Stages: []string{StageEncode, StageDenoise, StageDecode}, FrameStep: 4, FrameOffset: 1,
		Cond: Layout{DType: "uint8", Shape: []int64{l.Total}}, Conds: conds,
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8, Temporal: 4},
		Image:  &ImageDecl{Stages: []string{StageDenoise}}, Params: []engine.ParamSpec{p}}
}

// runShapes serves a task of fakeShapes and returns its answer.
func (s *fakeSession) runShapes(m *Msg) *Msg {
	f := s.f.shapeFaults
	mem := func(r Region) []byte { return s.mem[r.Off : r.Off+r.Len] }
	named := map[string]Region{}
	for _, c := range m.Conds {
		named[c.Name] = c.Region()
	}
	switch m.Stage {
	case StageEncode:
		n := min(max(len(m.Spec.Prompt), 1), 16)
		tok := mem(named["tokens"])
		for i := 0; i < n*8; i++ {
			binary.LittleEndian.PutUint32(tok[4*i:], math.Float32bits(float32(m.Spec.Prompt[i/8%len(m.Spec.Prompt)])/256))
		}
		pooled := mem(named["pooled"])
		if f.halfNamed {
			pooled = pooled[:len(pooled)/2]
		}
		for i := range pooled {
			pooled[i] = byte(0x30 + n) // a finite float16 either way
		}
		return &Msg{T: TypeDone, Task: m.Task, Lens: map[string]int32{"tokens": int32(n)}}
	case StageDenoise:
		sum := 0
		for _, b := range mem(named["tokens"]) {
			sum += int(b)
		}
		if m.RefImage != nil && !f.ignoreImage {
			sum += int(crc32.ChecksumIEEE(mem(*m.RefImage)) % 1000)
		}
		rescale := m.Params["rescale"].Num
		out := mem(*m.Output)
		for i := 0; i+4 <= len(out); i += 4 {
			binary.LittleEndian.PutUint32(out[i:], math.Float32bits(float32(sum%1009)/1009+float32(rescale)+float32(i)*1e-5))
		}
		for step := int32(1); step <= int32(m.Spec.Steps); step++ {
			s.send(&Msg{T: TypeProgress, Task: m.Task, Step: step, Total: int32(m.Spec.Steps)})
		}
	case StageDecode:
		in, out := mem(m.Inputs[0]), mem(*m.Output)
		fb := len(in) / int(m.Frames)
		pix := len(out) / int(m.VideoFrames)
		for j := range int(m.VideoFrames) {
			v := int(m.VideoFirst) + j
			if f.cutDecode {
				v = j
			}
			lf := 0
			if int(m.VideoFirst)+j > 0 {
				lf = (int(m.VideoFirst)+j-1)/4 + 1
			}
			src := in[(lf-int(m.FirstFrame))*fb:][:fb]
			for p := range pix {
				out[j*pix+p] = src[p%fb] + byte(7*v)
			}
		}
	}
	return &Msg{T: TypeDone, Task: m.Task}
}

// An engine using every shape passes every shape check, and the line of
// each says what it saw.
func TestCheckPassesShapes(t *testing.T) {
	res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 10 * time.Millisecond, v2: true, shapes: true})
	if !ok {
		t.Fatalf("a correct engine with shapes fails the check:\n%s", out)
	}
	for name, want := range map[string]string{
		"named conditioning": "[tokens pooled]: a 1-byte prompt: lengths [1]; a 1120-byte prompt: lengths [16]; denoise at the shortest and longest lengths",
		"temporal latent":    "temporal 4: 2 latent frames decode to 5 video frames",
		"image input":        "denoise: two different images, two different outputs",
		"params":             "changed the output [rescale]",
	} {
		if r := result(t, res, name); !r.Pass || !strings.Contains(r.Detail, want) {
			t.Errorf("%s: %s, want a pass saying %q", name, r, want)
		}
	}
	if r := result(t, res, "register"); !strings.Contains(r.Detail, "[checkpoint tensor_cache named_cond temporal_latent image_input model_params]") {
		t.Errorf("register line %q does not name the shape features", r)
	}
}

// Each broken shape fails with a line saying what is wrong.
func TestCheckFailsBrokenShapes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		f     shapeFaults
		check string
		want  string
	}{
		{"half a named tensor", shapeFaults{halfNamed: true}, "task encode fake-shapes", `4 of the output's 580 bytes were never written (first at byte 516, byte 4 of named tensor "pooled")`},
		{"a malformed schema", shapeFaults{badSchema: true}, "register", `the registration was refused: extengine: bad frame: register: model 1: params: parameter "rescale": range [5,1]: want finite bounds`},
		{"a decode that depends on the chunking", shapeFaults{cutDecode: true}, "temporal latent", "latent frames [0,2) decoded whole and decoded one at a time differ"},
		{"an image ignored", shapeFaults{ignoreImage: true}, "image input", "denoise wrote the same output for two different reference images"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, ok, out := runCheck(t, fakeEngine{beats: "always", step: 10 * time.Millisecond, v2: true, shapes: true, shapeFaults: tc.f})
			r := result(t, res, tc.check)
			if ok || !r.Failed() || !strings.Contains(r.Detail, tc.want) {
				t.Fatalf("%s: %s, want a failure saying %q\n%s", tc.name, r, tc.want, out)
			}
		})
	}
}
