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
)

func validRegister() *Msg {
	return &Msg{T: TypeRegister, Engine: "test/1", Slots: map[string]int32{"decode": 2}, Models: []Model{{
		Name: "m", Stages: []string{"decode"}, Cond: Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8},
	}}}
}

// v2Frames are one well-formed frame of every type and field of protocol
// v2: the round trip's cases and the fuzzer's seeds.
func v2Frames() []*Msg {
	reg := v2Register([]int32{Version1, Version2}, FeatureCheckpoint, FeatureTensorCache)
	lat := Region{Off: 4096, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}}
	task := &Msg{V: Version2, T: TypeTask, Task: 2, Stage: StageDenoise, Model: "m2",
		Spec:   &engine.Spec{Model: "m2", Prompt: "p", Width: 64, Height: 64, Frames: 1, Steps: 8, GuidanceScale: 5},
		Inputs: []Region{{Off: 0, Len: 1024, DType: "float32", Shape: []int64{2, 8, 16}}}, Output: &lat,
		CheckpointEvery: 3, CheckpointBuf: &Region{Off: 8192, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}},
		Resume: &Resume{Sampler: "s/1", Step: 3, Total: 8, State: []byte{3, 0, 0, 0}, Latent: Region{Off: 12288, Len: 1024, DType: "float32", Shape: []int64{1, 4, 8, 8}}}}
	return []*Msg{
		reg,
		{V: Version1, T: TypeWelcome, ArenaSize: 1 << 20, HeartbeatMS: 1000, Node: "n", Version: Version2, Features: []string{FeatureCheckpoint, FeatureTensorCache}},
		task,
		{V: Version2, T: TypeStop, Task: 2},
		{V: Version2, T: TypeCheckpoint, Task: 2, Step: 6, Total: 8, State: []byte{6, 0, 0, 0}},
		{V: Version2, T: TypeCheckpointed, Task: 2, Step: 6},
		{V: Version2, T: TypeTensorGet, Task: 2, Key: "neg/0a1b", Len: 64},
		{V: Version2, T: TypeTensor, Task: 2, Key: "neg/0a1b", Found: true, Region: &Region{Off: 0, Len: 64, DType: "uint8", Shape: []int64{64}}},
		{V: Version2, T: TypeTensorPut, Task: 2, Key: "neg/0a1b", Data: make([]byte, 64)},
		{V: Version2, T: TypeFailed, Task: 2, Code: CodeStopped},
	}
}

func TestMsgRoundTrip(t *testing.T) {
	for _, m := range append([]*Msg{
		validRegister(),
		{T: TypeHeartbeat},
		{T: TypeProgress, Task: 3, Step: 2, Total: 5},
		{T: TypePreview, Task: 3, Step: 2, Image: []byte("png")},
		{T: TypeDone, Task: 9},
		{T: TypeFailed, Task: 9, Code: CodeBadInput, Reason: "NaN"},
	}, slices.Concat(v2Frames(), shapeFrames(), lifecycleFrames())...) {
		b, err := EncodeMsg(m)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ReadMsg(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("%s: %v", m.T, err)
		}
		if got.T != m.T || got.Task != m.Task || got.Step != m.Step || len(got.Models) != len(m.Models) || got.Reason != m.Reason {
			t.Errorf("%s: round trip gave %+v", m.T, got)
		}
		again, err := EncodeMsg(got)
		if err != nil || !bytes.Equal(again, b) {
			t.Errorf("%s: re-encoded differently (%v)", m.T, err)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	enc := func(m any) []byte { b, _ := msgpack.Marshal(m); return b }
	huge := make([]byte, 5)
	binary.BigEndian.PutUint32(huge, MaxFrame+1)
	cases := map[string][]byte{
		"empty":             {},
		"not a map":         {0x93, 1, 2, 3},
		"array of 2^32-1":   {0x81, 0xa1, 't', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"str of 2^32-1":     {0x81, 0xa1, 't', 0xdb, 0xff, 0xff, 0xff, 0xff},
		"nested deep":       append([]byte{0x81, 0xa1, 'm'}, bytes.Repeat([]byte{0x91}, 100)...),
		"wrong version":     enc(map[string]any{"v": 9, "t": "heartbeat"}),
		"unknown type":      enc(map[string]any{"v": 1, "t": "launch"}),
		"progress past end": enc(map[string]any{"v": 1, "t": "progress", "task": 1, "step": 6, "total": 5}),
		"no models":         enc(map[string]any{"v": 1, "t": "register"}),
		"bad model name":    enc(map[string]any{"v": 1, "t": "register", "models": []any{map[string]any{"name": "a b", "stages": []string{"decode"}}}}),
		"preview too big":   enc(map[string]any{"v": 1, "t": "preview", "task": 1, "image": make([]byte, MaxPreview+1)}),
		"trailing bytes":    append(enc(map[string]any{"v": 1, "t": "heartbeat"}), 0xc0),
		// Protocol v2's frames and fields.
		"v2 type at v1":          enc(map[string]any{"v": 1, "t": "checkpoint", "task": 1, "step": 1, "total": 2}),
		"v2 field at v1":         enc(map[string]any{"v": 1, "t": "task", "task": 1, "stage": "denoise", "spec": map[string]any{}, "output": map[string]any{"off": 0, "len": 4, "dtype": "float32", "shape": []int{1}}, "checkpoint_every": 2}),
		"version 3":              enc(map[string]any{"v": 3, "t": "heartbeat"}),
		"checkpoint at the end":  enc(map[string]any{"v": 2, "t": "checkpoint", "task": 1, "step": 2, "total": 2}),
		"checkpoint at step 0":   enc(map[string]any{"v": 2, "t": "checkpoint", "task": 1, "step": 0, "total": 2}),
		"state too large":        enc(map[string]any{"v": 2, "t": "checkpoint", "task": 1, "step": 1, "total": 2, "state": make([]byte, MaxState+1)}),
		"checkpointed step 0":    enc(map[string]any{"v": 2, "t": "checkpointed", "task": 1}),
		"stop without a task":    enc(map[string]any{"v": 2, "t": "stop"}),
		"key with a space":       enc(map[string]any{"v": 2, "t": "tensor_get", "task": 1, "key": "a b"}),
		"key too long":           enc(map[string]any{"v": 2, "t": "tensor_get", "task": 1, "key": strings.Repeat("k", MaxKey+1)}),
		"no key":                 enc(map[string]any{"v": 2, "t": "tensor_put", "task": 1, "data": []byte{1}}),
		"len past MaxTensor":     enc(map[string]any{"v": 2, "t": "tensor_get", "task": 1, "key": "k", "len": MaxTensor + 1}),
		"negative len":           enc(map[string]any{"v": 2, "t": "tensor_get", "task": 1, "key": "k", "len": -1}),
		"inline past the bound":  enc(map[string]any{"v": 2, "t": "tensor_put", "task": 1, "key": "k", "data": make([]byte, MaxInlineTensor+1)}),
		"found without a region": enc(map[string]any{"v": 2, "t": "tensor", "task": 1, "key": "k", "found": true}),
		"too many features":      mustBody(v2Register([]int32{Version2}, strings.Split(strings.Repeat("f,", MaxFeatures+1), ",")[:MaxFeatures+1]...)),
		"feature in capitals":    enc(map[string]any{"v": 1, "t": "welcome", "arena_size": 1, "heartbeat_ms": 1, "features": []string{"Checkpoint"}}),
		"welcome of version 3":   enc(map[string]any{"v": 1, "t": "welcome", "arena_size": 1, "heartbeat_ms": 1, "version": 3}),
		"resume past its total":  resumeAt(3, 3),
		"negative period":        enc(map[string]any{"v": 2, "t": "task", "task": 1, "stage": "denoise", "spec": map[string]any{}, "output": map[string]any{"off": 0, "len": 4, "dtype": "float32", "shape": []int{1}}, "checkpoint_every": -1}),
		"checkpoint of a decode": checkpointOfDecode(),
	}
	for name, b := range cases {
		if _, err := DecodeMsg(b); !errors.Is(err, ErrBadFrame) && !errors.Is(err, ErrTooLarge) {
			t.Errorf("%s: got %v, want a bad frame", name, err)
		}
	}
	if _, err := ReadMsg(bytes.NewReader(huge)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a frame declaring %d bytes: got %v, want ErrTooLarge before reading the body", MaxFrame+1, err)
	}
}

// mustBody is m's frame body.
func mustBody(m *Msg) []byte {
	b, err := EncodeMsg(m)
	if err != nil {
		panic(err)
	}
	return b[4:]
}

// resumeAt is a v2 denoise task resuming after step of total.
func resumeAt(step, total int32) []byte {
	m := v2Frames()[2]
	m.Resume.Step, m.Resume.Total = step, total
	b, _ := EncodeMsg(m)
	return b[4:]
}

// checkpointOfDecode registers a model that checkpoints but serves no denoise.
func checkpointOfDecode() []byte {
	m := v2Register([]int32{Version2})
	m.Models[0].Stages = []string{StageDecode}
	b, _ := EncodeMsg(m)
	return b[4:]
}

// FuzzDecodeMsg feeds the agent's decoder arbitrary bytes: it must return
// a frame or an error, never panic, and whatever it accepts must validate
// and encode again. The seeds hold a frame of every type, v2's included,
// and every field of the model shapes (shapeFrames), the lifecycle and
// batching.
func FuzzDecodeMsg(f *testing.F) {
	seeds := slices.Concat(v2Frames(), shapeFrames(), lifecycleFrames(), batchFrames())
	for _, m := range append([]*Msg{validRegister(), {T: TypeHeartbeat}, {T: TypeProgress, Task: 1, Step: 1, Total: 2}, {T: TypeFailed, Task: 1, Code: "x"}}, seeds...) {
		b, err := EncodeMsg(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b[4:])
	}
	f.Add([]byte{0x81, 0xa1, 't', 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeMsg(b)
		if err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("accepted a frame that does not validate: %v", err)
		}
		if _, err := EncodeMsg(m); err != nil && !errors.Is(err, ErrTooLarge) {
			t.Fatalf("accepted a frame that does not encode: %v", err)
		}
	})
}

// An engine in another language writes register's versions as a msgpack
// array of ints (Python's msgpack does), never bin: the agent must read it.
func TestRegisterVersionsAreAnArray(t *testing.T) {
	b, err := msgpack.Marshal(map[string]any{"v": 1, "t": "register", "versions": []any{1, 2}, "features": []string{"checkpoint"}, "models": validRegister().Models})
	if err != nil {
		t.Fatal(err)
	}
	m, err := DecodeMsg(b)
	if err != nil || len(m.Versions) != 2 || m.Versions[0] != 1 || m.Versions[1] != 2 {
		t.Fatalf("versions [1, 2] as an array: %+v, %v", m, err)
	}
	enc := mustBody(v2Register([]int32{Version1, Version2}))
	if !bytes.Contains(enc, []byte("versions\x92\x01\x02")) {
		t.Errorf("the agent's own encoding of versions is not an array of ints: % x", enc)
	}
}
