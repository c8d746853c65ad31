package extengine

import (
	"bytes"
	"errors"
	"testing"

	"github.com/latentmesh/latentmesh/agent/engine"
)

func testCheckpoint() Checkpoint {
	lat := make([]byte, 256)
	for i := range lat {
		lat[i] = byte(i * 31)
	}
	return Checkpoint{Sampler: "torch-tiny/ddim/1", Step: 3, Total: 8, State: []byte("state after 3"), Latent: lat}
}

// A Checkpoint survives the way the agent stores it (engine.Checkpoint,
// itself encoded for the Store) byte for byte, and a damaged or foreign
// one is an ErrBadCheckpoint, never a resume from garbage.
func TestCheckpointThroughTheAgentsStore(t *testing.T) {
	ck := testCheckpoint()
	eck, err := ck.EngineCheckpoint()
	if err != nil {
		t.Fatal(err)
	}
	if eck.Sampler != ck.Sampler || eck.Step != 3 || eck.Total != 8 {
		t.Fatalf("engine checkpoint %q after %d of %d", eck.Sampler, eck.Step, eck.Total)
	}
	stored, err := eck.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var back engine.Checkpoint
	if err := back.UnmarshalBinary(stored); err != nil {
		t.Fatal(err)
	}
	got, err := FromEngineCheckpoint(back)
	if err != nil {
		t.Fatal(err)
	}
	if got.Sampler != ck.Sampler || got.Step != ck.Step || got.Total != ck.Total || !bytes.Equal(got.State, ck.State) || !bytes.Equal(got.Latent, ck.Latent) {
		t.Fatalf("round trip gave %+v", got)
	}

	// Every single damaged byte of the encoding is caught.
	enc, _ := ck.MarshalBinary()
	for i := range enc {
		bad := bytes.Clone(enc)
		bad[i] ^= 0x40
		var c Checkpoint
		if err := c.UnmarshalBinary(bad); !errors.Is(err, ErrBadCheckpoint) {
			t.Fatalf("byte %d damaged: %v, want ErrBadCheckpoint", i, err)
		}
	}
	for name, e := range map[string]engine.Checkpoint{
		"the built-in engine's": {Sampler: "builtin/v4/ddim-cosine", Step: 3, Total: 8, State: []byte("LMSD....")},
		"another step":          {Sampler: eck.Sampler, Step: 4, Total: 8, State: eck.State},
		"another sampler":       {Sampler: "other/1", Step: 3, Total: 8, State: eck.State},
	} {
		if _, err := FromEngineCheckpoint(e); !errors.Is(err, ErrBadCheckpoint) {
			t.Errorf("%s: %v, want ErrBadCheckpoint", name, err)
		}
	}
	for name, c := range map[string]Checkpoint{
		"no latent":        {Sampler: "s", Step: 1, Total: 2},
		"the last step":    {Sampler: "s", Step: 2, Total: 2, Latent: []byte{1}},
		"a sampler of tab": {Sampler: "a\tb", Step: 1, Total: 2, Latent: []byte{1}},
		"a state too big":  {Sampler: "s", Step: 1, Total: 2, State: make([]byte, MaxState+1), Latent: []byte{1}},
	} {
		if _, err := c.MarshalBinary(); !errors.Is(err, ErrBadCheckpoint) {
			t.Errorf("%s: %v, want ErrBadCheckpoint", name, err)
		}
	}
}

// FuzzCheckpoint: UnmarshalBinary bounds every length before allocating,
// never panics, and what it accepts encodes to the same bytes.
func FuzzCheckpoint(f *testing.F) {
	enc, err := testCheckpoint().MarshalBinary()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(enc)
	f.Add(enc[:len(enc)-5])
	f.Add([]byte("LMXC\x01\xff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var c Checkpoint
		if err := c.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrBadCheckpoint) {
				t.Fatalf("error %v is not an ErrBadCheckpoint", err)
			}
			return
		}
		again, err := c.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("accepted a checkpoint that encodes differently (%v)", err)
		}
	})
}
