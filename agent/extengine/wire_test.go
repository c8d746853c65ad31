package extengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func validRegister() *Msg {
	return &Msg{T: TypeRegister, Engine: "test/1", Slots: map[string]int32{"decode": 2}, Models: []Model{{
		Name: "m", Stages: []string{"decode"}, Cond: Layout{DType: "float32", Shape: []int64{2, 8, 16}},
		Latent: LatentLayout{DType: "float32", Channels: 4, Scale: 8},
	}}}
}

func TestMsgRoundTrip(t *testing.T) {
	for _, m := range []*Msg{
		validRegister(),
		{T: TypeHeartbeat},
		{T: TypeProgress, Task: 3, Step: 2, Total: 5},
		{T: TypePreview, Task: 3, Step: 2, Image: []byte("png")},
		{T: TypeDone, Task: 9},
		{T: TypeFailed, Task: 9, Code: CodeBadInput, Reason: "NaN"},
	} {
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

// FuzzDecodeMsg feeds the engine-side decoder arbitrary bytes: it must
// return a frame or an error, never panic, and whatever it accepts must
// validate and encode again.
func FuzzDecodeMsg(f *testing.F) {
	for _, m := range []*Msg{validRegister(), {T: TypeHeartbeat}, {T: TypeProgress, Task: 1, Step: 1, Total: 2}, {T: TypeFailed, Task: 1, Code: "x"}} {
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
