package msgpackcheck

import (
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

var limits = Limits{MaxLen: 1 << 10, MaxDepth: 3}

func TestCheck(t *testing.T) {
	ok, err := msgpack.Marshal(map[string]any{"a": []any{1, "x", []byte{1, 2}, 1.5, nil, true}, "b": map[string]int{"c": 3}})
	if err != nil {
		t.Fatal(err)
	}
	if err := limits.Check(ok); err != nil {
		t.Fatalf("valid value refused: %v", err)
	}
	deep, _ := msgpack.Marshal([]any{[]any{[]any{[]any{1}}}})
	for what, b := range map[string][]byte{
		"empty":                {},
		"trailing bytes":       append(append([]byte{}, ok...), 0x01),
		"truncated":            ok[:len(ok)-1],
		"array of 2^32-1":      {0xdd, 0xff, 0xff, 0xff, 0xff},
		"map of 65535 entries": {0xde, 0xff, 0xff},
		"str of 1 MiB":         {0xdb, 0x00, 0x10, 0x00, 0x00},
		"bin longer than left": {0xc4, 0x05, 0x01},
		"nested too deep":      deep,
		"never-used code":      {0xc1},
	} {
		if err := limits.Check(b); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", what, err)
		}
	}
}

// Whatever the bytes, Check answers without panicking, and what it accepts
// decodes within the memory the bytes allow.
func FuzzCheck(f *testing.F) {
	ok, _ := msgpack.Marshal(map[string]any{"a": []any{1, "x"}, "b": map[string]int{"c": 3}})
	f.Add(ok)
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x91, 0x91, 0x91, 0x91, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		if limits.Check(b) != nil {
			return
		}
		var v any
		if err := msgpack.Unmarshal(b, &v); err != nil {
			return // well-formed but not what a caller decodes into: fine
		}
	})
}
