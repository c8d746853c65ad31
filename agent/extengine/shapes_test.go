package extengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// shapesModel is a FLUX-like video model using every shape feature: a
// token sequence of up to 16 rows (float32) and a pooled vector (float16)
// as named conditioning, a 4x temporal latent (frames 4k+1), a reference
// image for its denoise, and two parameters.
func shapesModel() Model {
	conds := []CondTensor{
		{Name: "tokens", DType: "float32", Shape: []int64{16, 8}, VarLen: true},
		{Name: "pooled", DType: "float16", Shape: []int64{6}},
	}
	l, _ := condLayout(conds)
	return Model{
		Name: "shapes", Stages: []string{StageEncode, StageDenoise, StageDecode}, FrameStep: 4, FrameOffset: 1, MaxFrames: 81,
		Cond:   Layout{DType: "uint8", Shape: []int64{l.Total}},
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8, Temporal: 4},
		Conds:  conds,
		Image:  &ImageDecl{Stages: []string{StageDenoise}, Required: true},
		Params: []engine.ParamSpec{
			{Name: "shift", Type: engine.ParamTypeNumber, Min: 1, Max: 10, Default: engine.NumberParam(3)},
			{Name: "sampler", Type: engine.ParamTypeEnum, Values: []string{"euler", "unipc"}, Default: engine.StringParam("euler")},
		},
	}
}

func shapesRegister() *Msg {
	return &Msg{T: TypeRegister, Engine: "shapes/1", Versions: []int32{Version1, Version2},
		Features: []string{FeatureNamedCond, FeatureTemporal, FeatureImage, FeatureParams}, Models: []Model{shapesModel()}}
}

// shapeFrames are one well-formed frame of every shape field: the round
// trip's cases and the fuzzer's seeds.
func shapeFrames() []*Msg {
	img := Region{Off: 8192, Len: 64 * 64 * 4, DType: "uint8", Shape: []int64{64, 64, 4}}
	return []*Msg{
		shapesRegister(),
		{V: Version2, T: TypeTask, Task: 3, Stage: StageDenoise, Model: "shapes",
			Spec:   &engine.Spec{Model: "shapes", Prompt: "p", Width: 64, Height: 64, Frames: 9, Steps: 4, GuidanceScale: 5},
			Inputs: []Region{{Off: 0, Len: 640, DType: "uint8", Shape: []int64{640}}}, Output: &Region{Off: 4096, Len: 768, DType: "float32", Shape: []int64{3, 4, 4, 4}},
			Conds:    []NamedRegion{{Name: "tokens", Off: 0, Len: 96, DType: "float32", Shape: []int64{3, 8}}, {Name: "pooled", Off: 512, Len: 12, DType: "float16", Shape: []int64{6}}},
			Params:   engine.Params{"shift": engine.NumberParam(5), "sampler": engine.StringParam("unipc"), "steps2": engine.IntegerParam(-3), "flag": engine.BoolParam(true)},
			RefImage: &img},
		{V: Version2, T: TypeTask, Task: 4, Stage: StageDecode, Model: "shapes",
			Spec:   &engine.Spec{Model: "shapes", Prompt: "p", Width: 64, Height: 64, Frames: 9, Steps: 4, GuidanceScale: 5},
			Inputs: []Region{{Off: 0, Len: 256, DType: "float32", Shape: []int64{1, 4, 4, 4}}}, Output: &Region{Off: 4096, Len: 4 * 64 * 64 * 4, DType: "uint8", Shape: []int64{4, 64, 64, 4}},
			FirstFrame: 2, Frames: 1, VideoFirst: 5, VideoFrames: 4},
		{V: Version2, T: TypeDone, Task: 3, Lens: map[string]int32{"tokens": 3}},
	}
}

// The conditioning payload: each named tensor at a multiple of CondAlign,
// then one uint32 length per variable tensor. An encode's payload is
// completed from the lengths it reported: rows past them and the padding
// zeroed, the lengths written; a denoise reads them back.
func TestCondLayout(t *testing.T) {
	l, ok := shapesModel().CondLayout()
	if !ok {
		t.Fatal("no layout")
	}
	// tokens at 0 (512 bytes), pooled at 512 (12 bytes), the length at 576.
	if got := l.regions(1000, nil); got[0].Off != 1000 || got[0].Len != 512 || got[1].Off != 1512 || got[1].Len != 12 || l.Total != 580 {
		t.Fatalf("regions %+v, total %d; want tokens at 0 (512 B), pooled at 512 (12 B), 580 in all", got, l.Total)
	}
	payload := bytes.Repeat([]byte{0xee}, int(l.Total))
	if err := l.finish(payload, map[string]int32{"tokens": 3}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(payload[96:512], make([]byte, 416)) || !bytes.Equal(payload[524:576], make([]byte, 52)) {
		t.Error("the rows past the length or the padding were not zeroed")
	}
	if !bytes.Equal(payload[:96], bytes.Repeat([]byte{0xee}, 96)) || !bytes.Equal(payload[512:524], bytes.Repeat([]byte{0xee}, 12)) {
		t.Error("finish changed what the engine wrote")
	}
	lens, err := l.Lens(payload)
	if err != nil || !slices.Equal(lens, []int64{3}) || binary.LittleEndian.Uint32(payload[576:]) != 3 {
		t.Fatalf("lens %v, %v; want [3]", lens, err)
	}
	if got := l.regions(0, lens); got[0].Len != 96 || !slices.Equal(got[0].Shape, []int64{3, 8}) || got[1].Len != 12 {
		t.Errorf("a denoise's regions %+v: want tokens [3 8]", got)
	}
	if name, at := l.Locate(520); name != "pooled" || at != 8 {
		t.Errorf("byte 520 located in %q at %d, want pooled at 8", name, at)
	}
	for _, tc := range []struct {
		lens map[string]int32
		want string
	}{
		{map[string]int32{"tokens": 17}, `the engine reported length 17 for named tensor "tokens", want 1-16`},
		{map[string]int32{"pooled": 3}, `the engine reported a length for "pooled", which is not a named tensor of variable length`},
		{map[string]int32{"t5": 3}, `a length for "t5"`},
	} {
		if err := l.finish(payload, tc.lens); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("finish with lens %v: %v, want %q", tc.lens, err, tc.want)
		}
	}
	binary.LittleEndian.PutUint32(payload[576:], 0)
	if _, err := l.Lens(payload); !errors.Is(err, engine.ErrBadTensor) {
		t.Errorf("a payload of length 0: %v, want ErrBadTensor", err)
	}
}

// A temporal latent: the first frame alone, then each group of Temporal
// frames one latent frame (81 -> 21), and a decode of latent frames maps to
// the video frames they make, every frame exactly once.
func TestLatentAndVideoFrames(t *testing.T) {
	m := shapesModel()
	for frames, want := range map[int]int{1: 1, 5: 2, 9: 3, 13: 4, 81: 21} {
		if got := m.LatentFrames(frames); got != want {
			t.Errorf("%d frames: %d latent frames, want %d", frames, got, want)
		}
	}
	seen := make([]int, 81)
	for k := range 21 {
		first, n := m.VideoFrames(k, 1)
		for f := first; f < first+n; f++ {
			seen[f]++
		}
	}
	for f, n := range seen {
		if n != 1 {
			t.Fatalf("video frame %d decoded %d times", f, n)
		}
	}
	if first, n := m.VideoFrames(0, 3); first != 0 || n != 9 {
		t.Errorf("latent frames [0,3): video frames %d+%d, want 0+9", first, n)
	}
	if first, n := m.VideoFrames(20, 1); first != 77 || n != 4 {
		t.Errorf("latent frame 20: video frames %d+%d, want 77+4", first, n)
	}
	plain := wanLike()
	if plain.LatentFrames(81) != 81 {
		t.Error("a latent without temporal compression lost frames")
	}
	s := engine.Spec{Width: 64, Height: 64, Frames: 81}
	m.Checkpoint = &CheckpointSpec{Sampler: "s", DType: "float32", Channels: 4}
	if lay, _ := m.CheckpointLatent(s); lay.Shape[0] != 21 {
		t.Errorf("checkpoint latent %v, want 21 frames", lay.Shape)
	}
}

// Malformed shape declarations are refused at registration, each with a
// message naming what is wrong.
func TestModelShapesValidated(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Model)
		want string
	}{
		{"cond not the payload", func(m *Model) { m.Cond = Layout{DType: "float32", Shape: []int64{2, 77}} }, "cond float32 [2 77]: with named tensors it must be uint8 [580]"},
		{"two tensors of a name", func(m *Model) { m.Conds[1].Name = "tokens" }, `named tensor "tokens" declared twice`},
		{"a name in capitals", func(m *Model) { m.Conds[0].Name = "T5" }, `name "T5"`},
		{"too many tensors", func(m *Model) { m.Conds = slices.Repeat(m.Conds[:1], MaxConds+1) }, "9 named conditioning tensors, at most 8"},
		{"a dimension of 0", func(m *Model) { m.Conds[1].Shape = []int64{0} }, "shape [0] out of range"},
		{"temporal without the frame rule", func(m *Model) { m.FrameStep, m.FrameOffset = 0, 0 }, "latent temporal 4 needs frame_step 4 and frame_offset 1"},
		{"temporal out of range", func(m *Model) { m.Latent.Temporal = 17 }, "latent temporal 17, want 0-16"},
		{"image for decode", func(m *Model) { m.Image.Stages = []string{StageDecode} }, "image for stages [decode], want encode and/or denoise"},
		{"a range upside down", func(m *Model) { m.Params[0].Min, m.Params[0].Max = 5, 1 }, `params: parameter "shift": range [5,1]`},
		{"a default out of range", func(m *Model) { m.Params[0].Default = engine.NumberParam(11) }, `params: parameter "shift": default: 11: must be in [1,10]`},
		{"an enum default not a value", func(m *Model) { m.Params[1].Default = engine.StringParam("ddim") }, `parameter "sampler": default: "ddim": want one of euler, unipc`},
		{"an unknown type", func(m *Model) { m.Params[1].Type = "float" }, `parameter "sampler": type "float"`},
		{"a parameter named twice", func(m *Model) { m.Params[1].Name = "shift" }, `parameter "shift" declared twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := shapesRegister()
			tc.edit(&reg.Models[0])
			_, err := DecodeMsg(mustBody(reg))
			if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want a bad frame saying %q", err, tc.want)
			}
		})
	}
	if _, err := DecodeMsg(mustBody(shapesRegister())); err != nil {
		t.Fatalf("the well-formed model: %v", err)
	}
}

// The shape fields are version 2's and belong to one frame type each.
func TestShapeFieldsRefused(t *testing.T) {
	enc := func(m any) []byte { b, _ := msgpack.Marshal(m); return b }
	out := map[string]any{"off": 0, "len": 4, "dtype": "float32", "shape": []int{1}}
	task := func(v int, k string, val any) []byte {
		return enc(map[string]any{"v": v, "t": "task", "task": 1, "stage": "denoise", "spec": map[string]any{}, "output": out, k: val})
	}
	for name, b := range map[string][]byte{
		"params at v1":        task(1, "params", map[string]any{"shift": 2.5}),
		"a nil param":         task(2, "params", map[string]any{"shift": nil}),
		"a param of a map":    task(2, "params", map[string]any{"shift": map[string]any{}}),
		"lens on a task":      task(2, "lens", map[string]any{"tokens": 3}),
		"a length of 0":       enc(map[string]any{"v": 2, "t": "done", "task": 1, "lens": map[string]any{"tokens": 0}}),
		"lens at v1":          enc(map[string]any{"v": 1, "t": "done", "task": 1, "lens": map[string]any{"tokens": 3}}),
		"an image of 3 ch.":   task(2, "ref_image", map[string]any{"off": 0, "len": 12, "dtype": "uint8", "shape": []int{2, 2, 3}}),
		"a named tensor 'A'":  task(2, "conds", []any{map[string]any{"name": "A", "off": 0, "len": 4, "dtype": "float32", "shape": []int{1}}}),
		"video frames on v1":  task(1, "video_frames", 4),
		"negative video from": task(2, "video_first", -1),
	} {
		if _, err := DecodeMsg(b); !errors.Is(err, ErrBadFrame) {
			t.Errorf("%s: got %v, want a bad frame", name, err)
		}
	}
}

// Over a real socket: the agent grants the shape features to a v2 engine
// (without lending memory), sends an encode its named output regions and
// completes the payload from the lengths it reports, sends the denoise
// its named inputs at those lengths, the reference image and the
// complete parameters, and a decode of a temporal latent the video
// frames it makes. A v1 session drops every shape of the model.
func TestShapesOverSocket(t *testing.T) {
	s, ar := testServerOn(t, func(ar *arena.Arena) Arena { return noAllocArena{checkArena{ar}} })
	e := dialEngineWith(t, s, shapesRegister())
	if !slices.Equal(e.welcome.Features, shapeFeatures) {
		t.Fatalf("welcome granted %v, want %v", e.welcome.Features, shapeFeatures)
	}
	mo, _ := s.Engine().Model(StageDenoise, "shapes")
	l, _ := mo.CondLayout()
	alloc := func(n int64) []byte {
		b, err := ar.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		return ar.Slice(b)
	}
	spec := engine.Spec{Model: "shapes", Prompt: "p", Width: 64, Height: 64, Frames: 9, Steps: 2}
	run := func(r Request, answer func(m *Msg) *Msg) (*Msg, error) {
		done := make(chan error, 1)
		go func() { done <- s.Run(t.Context(), r) }()
		m := e.next(t)
		e.send(t, answer(m))
		return m, <-done
	}

	// Encode: named outputs at their maximum; lengths reported.
	payload := alloc(l.Total)
	for i := range payload {
		payload[i] = 0xee
	}
	m, err := run(Request{Stage: StageEncode, Model: "shapes", Spec: spec, Output: Tensor{DType: "uint8", Shape: []int64{l.Total}, Data: payload}},
		func(m *Msg) *Msg { return &Msg{T: TypeDone, Task: m.Task, Lens: map[string]int32{"tokens": 5}} })
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Conds) != 2 || m.Conds[0].Name != "tokens" || !slices.Equal(m.Conds[0].Shape, []int64{16, 8}) || m.Conds[1].Off != m.Output.Off+512 {
		t.Fatalf("encode's named outputs %+v", m.Conds)
	}
	if m.RefImage != nil || m.Params["shift"] != engine.NumberParam(3) || m.Params["sampler"] != engine.StringParam("euler") {
		t.Errorf("encode: image %v (the model takes it at denoise), params %v (want the defaults)", m.RefImage, m.Params)
	}
	if lens, err := l.Lens(payload); err != nil || lens[0] != 5 || payload[5*32] != 0 {
		t.Fatalf("the payload after done: lens %v (%v), row 5 not zeroed: %x", lens, err, payload[5*32])
	}

	// Denoise: named inputs at the encode's lengths, the image, params.
	img := alloc(64 * 64 * 4)
	lat := alloc(3 * 4 * 8 * 8 * 4)
	spec.Params = engine.Params{"shift": engine.IntegerParam(7)}
	r := Request{Stage: StageDenoise, Model: "shapes", Spec: spec, Inputs: []Tensor{{DType: "uint8", Shape: []int64{l.Total}, Data: payload}},
		Output: Tensor{DType: "float32", Shape: []int64{3, 4, 8, 8}, Data: lat},
		Image:  &Tensor{DType: "uint8", Shape: []int64{64, 64, 4}, Data: img}}
	m, err = run(r, func(m *Msg) *Msg { return &Msg{T: TypeDone, Task: m.Task} })
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(m.Conds[0].Shape, []int64{5, 8}) || m.Conds[0].Len != 5*32 || m.RefImage == nil || !slices.Equal(m.RefImage.Shape, []int64{64, 64, 4}) {
		t.Fatalf("denoise: named inputs %+v, image %+v", m.Conds, m.RefImage)
	}
	if m.Params["shift"] != engine.NumberParam(7) || m.Params["sampler"] != engine.StringParam("euler") {
		t.Errorf("denoise params %v: want shift 7 (a number) and the default sampler", m.Params)
	}
	// A denoise without the required image, or with a parameter out of
	// range, never reaches the engine.
	r.Image = nil
	if err := s.Run(t.Context(), r); !errors.Is(err, ErrNoImage) {
		t.Errorf("a denoise without its image: %v, want ErrNoImage", err)
	}
	r.Image, r.Spec.Params = &Tensor{DType: "uint8", Shape: []int64{64, 64, 4}, Data: img}, engine.Params{"shift": engine.NumberParam(11)}
	if err := s.Run(t.Context(), r); !errors.Is(err, engine.ErrBadSpec) || !strings.Contains(err.Error(), `"shift": 11: must be in [1,10]`) {
		t.Errorf("a denoise with shift 11: %v, want ErrBadSpec naming the range", err)
	}

	// Decode of latent frame 2 (of 3): video frames 5-8.
	out := alloc(4 * 64 * 64 * 4)
	m, err = run(Request{Stage: StageDecode, Model: "shapes", Spec: spec, FirstFrame: 2, Frames: 1,
		Inputs: []Tensor{{DType: "float32", Shape: []int64{1, 4, 8, 8}, Data: lat[:4*8*8*4]}},
		Output: Tensor{DType: "uint8", Shape: []int64{4, 64, 64, 4}, Data: out}},
		func(m *Msg) *Msg { return &Msg{T: TypeDone, Task: m.Task} })
	if err != nil || m.VideoFirst != 5 || m.VideoFrames != 4 {
		t.Fatalf("decode of latent frame 2: video frames %d+%d (%v), want 5+4", m.VideoFirst, m.VideoFrames, err)
	}

	// A length past the maximum fails the encode, not the connection.
	_, err = run(Request{Stage: StageEncode, Model: "shapes", Spec: spec, Output: Tensor{DType: "uint8", Shape: []int64{l.Total}, Data: payload}},
		func(m *Msg) *Msg { return &Msg{T: TypeDone, Task: m.Task, Lens: map[string]int32{"tokens": 17}} })
	if !errors.Is(err, ErrBadOutput) || s.Engine() == nil {
		t.Errorf("an encode reporting length 17 of 16: %v (engine registered: %v), want ErrBadOutput", err, s.Engine() != nil)
	}
}

// An engine offering version 1 only registers the model as version 1
// knows it: no named tensors, no temporal latent, no image, no params.
func TestShapesDroppedWithoutTheFeatures(t *testing.T) {
	s, _ := testServer(t)
	reg := shapesRegister()
	reg.Versions, reg.Features = nil, nil
	dialEngineWith(t, s, reg)
	m, ok := s.Engine().Model(StageDenoise, "shapes")
	if !ok {
		t.Fatal("model not registered")
	}
	if m.Conds != nil || m.Latent.Temporal != 0 || m.Image != nil || m.Params != nil {
		t.Errorf("a v1 session kept the model's shapes: %+v", m)
	}
	if m.Cond.DType != "uint8" || m.LatentFrames(9) != 9 {
		t.Errorf("a v1 session: cond %v, 9 frames -> %d latent", m.Cond, m.LatentFrames(9))
	}
}
