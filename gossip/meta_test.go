package gossip

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
)

func fullMeta() NodeMeta {
	return NodeMeta{
		Version:         MetaVersion,
		Roles:           []string{RoleEncode, RoleDenoise, RoleDecode},
		Free:            StageCredits{Encode: 4, Denoise: 1 << 20, Decode: math.MaxUint32},
		Queued:          17,
		Running:         3,
		Load:            0.75,
		FreeBufferBytes: 64 << 30,
	}
}

func TestMetaRoundTrip(t *testing.T) {
	for _, m := range []NodeMeta{{Version: MetaVersion}, fullMeta()} {
		b, err := EncodeMeta(m)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > MetaMaxSize {
			t.Fatalf("%d bytes", len(b))
		}
		got, err := DecodeMeta(b)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got.clone(), m.clone()) {
			t.Fatalf("round trip: got %+v, want %+v", got, m)
		}
	}
	// A zero version is written as the current one.
	b, _ := EncodeMeta(NodeMeta{})
	if got, err := DecodeMeta(b); err != nil || got.Version != MetaVersion {
		t.Fatalf("zero version: %+v, %v", got, err)
	}
}

func TestEncodeMetaLimits(t *testing.T) {
	for _, tc := range []struct {
		name string
		meta NodeMeta
		want error
	}{
		{"huge roles list", NodeMeta{Roles: make([]string, 1000)}, ErrMetaTooLarge},
		{"roles just over the count", NodeMeta{Roles: make([]string, MaxMetaRoles+1)}, ErrMetaTooLarge},
		{"huge role name", NodeMeta{Roles: []string{strings.Repeat("x", MetaMaxSize)}}, ErrMetaTooLarge},
		{"NaN load", NodeMeta{Load: float32(math.NaN())}, ErrInvalidMeta},
		{"negative load", NodeMeta{Load: -1}, ErrInvalidMeta},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := EncodeMeta(tc.meta); !errors.Is(err, tc.want) {
				t.Fatalf("EncodeMeta = %v, want %v", err, tc.want)
			}
		})
	}
}

// be returns a code byte followed by a big-endian uint32.
func be(code byte, n uint32) []byte {
	return binary.BigEndian.AppendUint32([]byte{code}, n)
}

func TestDecodeMetaRejects(t *testing.T) {
	valid, _ := EncodeMeta(fullMeta())
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"over 512 bytes", append(bytes.Clone(valid), make([]byte, MetaMaxSize)...), ErrMetaTooLarge},
		{"empty", nil, ErrInvalidMeta},
		{"not a map", []byte{0x93, 1, 2, 3}, ErrInvalidMeta},
		{"garbage", []byte("hello, world"), ErrInvalidMeta},
		{"truncated", valid[:len(valid)-3], ErrInvalidMeta},
		{"trailing bytes", append(bytes.Clone(valid), 0x01), ErrInvalidMeta},
		{"map32 of 4G entries", be(0xdf, math.MaxUint32), ErrInvalidMeta},
		{"roles array32 of 4G entries", append([]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'r'}, be(0xdd, math.MaxUint32)...), ErrInvalidMeta},
		{"str32 of 4 GB", append([]byte{0x81, 0xa1, 'r', 0x91}, be(0xdb, math.MaxUint32)...), ErrInvalidMeta},
		{"bin32 of 4 GB as unknown key", append([]byte{0x81, 0xa1, 'z'}, be(0xc6, math.MaxUint32)...), ErrInvalidMeta},
		{"too many roles", append([]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'r', 0x9f}, bytes.Repeat([]byte{0xa0}, 15)...), ErrInvalidMeta},
		{"deep nesting", append([]byte{0x81, 0xa1, 'z'}, bytes.Repeat([]byte{0x91}, 20)...), ErrInvalidMeta},
		{"reserved code", []byte{0x81, 0xa1, 'z', 0xc1}, ErrInvalidMeta},
		{"missing version", []byte{0x81, 0xa1, 'q', 0x05}, ErrInvalidMeta},
		{"wrong type for roles", []byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'r', 0x05}, ErrInvalidMeta},
		{"NaN load", append([]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'l'}, be(0xca, math.Float32bits(float32(math.NaN())))...), ErrInvalidMeta},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if m, err := DecodeMeta(tc.in); !errors.Is(err, tc.want) {
				t.Fatalf("DecodeMeta = %+v, %v; want %v", m, err, tc.want)
			}
		})
	}
}

func TestDecodeMetaSkipsUnknownKeys(t *testing.T) {
	// A newer peer's meta: version 2 and a key this version does not know.
	in := []byte{0x83, 0xa1, 'v', 0x02, 0xa2, 'z', 'z', 0x92, 0x01, 0xa1, 'x', 0xa1, 'q', 0x07}
	m, err := DecodeMeta(in)
	if err != nil {
		t.Fatal(err)
	}
	if m.Version != 2 || m.Queued != 7 {
		t.Fatalf("decoded %+v", m)
	}
}

func FuzzDecodeMeta(f *testing.F) {
	for _, m := range []NodeMeta{{}, fullMeta(), {Roles: []string{RoleDecode}, Load: 1.5, Running: 1}} {
		b, err := EncodeMeta(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x83, 0xa1, 'v', 0x02, 0xa2, 'z', 'z', 0x92, 0x01, 0xa1, 'x', 0xa1, 'q', 0x07})
	f.Add(be(0xdf, math.MaxUint32))
	f.Add([]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'r', 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := DecodeMeta(in)
		if err != nil {
			if !errors.Is(err, ErrInvalidMeta) && !errors.Is(err, ErrMetaTooLarge) {
				t.Fatalf("unexpected error class: %v", err)
			}
			return
		}
		// Whatever decodes must re-encode within the limit and decode
		// to the same value.
		b, err := EncodeMeta(m)
		if err != nil {
			t.Fatalf("decoded %+v does not re-encode: %v", m, err)
		}
		again, err := DecodeMeta(b)
		if err != nil {
			t.Fatalf("re-encoding %x does not decode: %v", b, err)
		}
		if fmt.Sprintf("%+v", again) != fmt.Sprintf("%+v", m) {
			t.Fatalf("round trip: %+v != %+v", again, m)
		}
	})
}

func ExampleEncodeMeta() {
	b, err := EncodeMeta(NodeMeta{
		Roles: []string{RoleDenoise},
		Free:  StageCredits{Denoise: 2},
		Load:  0.5,
	})
	if err != nil {
		panic(err)
	}
	m, err := DecodeMeta(b)
	fmt.Println(len(b) <= MetaMaxSize, m.Version, m.Roles, m.Free.Denoise, m.Load, err)
	// Output: true 1 [denoise] 2 0.5 <nil>
}

func TestStageCreditsByRole(t *testing.T) {
	var c StageCredits
	for i, role := range []string{RoleEncode, RoleDenoise, RoleDecode} {
		c.Set(role, uint32(i+1))
	}
	c.Set("render", 9) // not a stage: ignored
	if c != (StageCredits{Encode: 1, Denoise: 2, Decode: 3}) {
		t.Fatalf("Set: %+v", c)
	}
	for i, role := range []string{RoleEncode, RoleDenoise, RoleDecode} {
		if got := c.For(role); got != uint32(i+1) {
			t.Errorf("For(%s) = %d", role, got)
		}
	}
	if c.For("render") != 0 {
		t.Error("For of a non-stage is not 0")
	}
}

// A full models list (MaxMetaModels names of MaxModelLen bytes) fits in
// memberlist's meta beside everything else, and survives a round trip.
func TestMetaModels(t *testing.T) {
	m := NodeMeta{Roles: []string{RoleEncode, RoleDenoise, RoleDecode}, Free: StageCredits{4, 1, 2}, Running: 3, Load: 0.5,
		FreeBufferBytes: 1 << 40, StoreFree: 1 << 40}
	for i := range MaxMetaModels {
		name := strings.Repeat(string(rune('a'+i)), MaxModelLen)
		ms := NewModelStages(name, RoleEncode, RoleDecode)
		ms.DefaultSteps = 1<<16 - 1 // the widest encoding
		m.Models = append(m.Models, ms)
	}
	b, err := EncodeMeta(m)
	if err != nil {
		t.Fatalf("a full models list does not fit: %v", err)
	}
	got, err := DecodeMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	if n := got.DefaultSteps(m.Models[1].Name); n != 1<<16-1 {
		t.Errorf("default steps after a round trip: %d", n)
	}
	if n := got.DefaultSteps("nosuch"); n != 0 {
		t.Errorf("default steps of a model not served: %d", n)
	}
	name := m.Models[2].Name
	if !got.Serves(RoleEncode, name, "builtin") || got.Serves(RoleDenoise, name, "builtin") || got.Serves(RoleEncode, "builtin", "builtin") {
		t.Errorf("served stages wrong after a round trip: %+v", got.Models)
	}
	if old := (NodeMeta{Version: 1}); !old.Serves(RoleDenoise, "builtin", "builtin") || old.Serves(RoleDenoise, "other", "builtin") {
		t.Error("a node gossiping no models must serve the default model only")
	}
	m.Models = append(m.Models, NewModelStages("one-too-many", RoleDecode))
	if _, err := EncodeMeta(m); err == nil {
		t.Error("more than MaxMetaModels models encoded")
	}
}
