package shm

import (
	"bytes"
	"testing"
)

func FuzzDecodeHeader(f *testing.F) {
	var b [headerSize]byte
	header{ArenaSize: 1 << 30, ArenaID: "agent-7"}.encode(&b)
	f.Add(b[:])
	header{ArenaSize: 4096, ArenaID: string(bytes.Repeat([]byte("z"), MaxArenaIDLen))}.encode(&b)
	f.Add(b[:])
	f.Add([]byte("LMSH"))
	f.Add(make([]byte, headerSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		h, err := decodeHeader(in)
		if err != nil {
			return
		}
		if h.ArenaSize <= 0 || h.ArenaSize > maxArenaSize || validArenaID(h.ArenaID) != nil {
			t.Fatalf("accepted out-of-bounds header %+v", h)
		}
		var out [headerSize]byte
		h.encode(&out)
		if !bytes.Equal(out[:], in) {
			t.Fatalf("round trip: %x != %x", out, in)
		}
	})
}

func FuzzDecodeFrame(f *testing.F) {
	var b [frameSize]byte
	for _, fr := range []frame{
		{Type: typeAcquire, Seq: 1, Off: 4096, Len: 1 << 20, Gen: 3},
		{Type: typeRelease, Off: 0, Len: 1, Gen: 1},
		{Type: typeReply, Code: codeUnknownBuf, Seq: 9},
	} {
		fr.encode(&b)
		f.Add(b[:])
	}
	f.Add([]byte{})
	f.Add(make([]byte, frameSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		fr, err := decodeFrame(in)
		if err != nil {
			return
		}
		switch fr.Type {
		case typeAcquire, typeRelease:
			if fr.Off < 0 || fr.Len <= 0 || fr.Off > maxArenaSize || fr.Len > maxArenaSize || fr.Code != 0 {
				t.Fatalf("accepted bad request %+v", fr)
			}
		case typeReply:
			if fr.Code > maxCode {
				t.Fatalf("accepted bad reply %+v", fr)
			}
		default:
			t.Fatalf("accepted type %d", fr.Type)
		}
		var out [frameSize]byte
		fr.encode(&out)
		if !bytes.Equal(out[:], in) {
			t.Fatalf("round trip: %x != %x", out, in)
		}
	})
}
