package shm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strings"
	"unicode/utf8"
)

// The wire format is fixed-size little-endian binary rather than msgpack: the
// two frames are tiny, hot (one pin and one release per in-place read) and
// a fixed layout is trivially bounded, so each is checked field by field
// before use.

// Handshake header, sent once by the producer with the memfd attached.
const (
	headerMagic   = "LMSH"
	headerVersion = 1
	// MaxArenaIDLen bounds Handle.ArenaID and the id in the handshake.
	MaxArenaIDLen = 64
	headerSize    = 4 + 2 + 2 + 8 + MaxArenaIDLen
	// maxArenaSize bounds the arena size a peer may claim (64 TiB).
	maxArenaSize = 1 << 46
)

type header struct {
	ArenaSize int64
	ArenaID   string
}

func (h header) encode(b *[headerSize]byte) {
	*b = [headerSize]byte{}
	copy(b[0:4], headerMagic)
	binary.LittleEndian.PutUint16(b[4:6], headerVersion)
	binary.LittleEndian.PutUint16(b[6:8], uint16(len(h.ArenaID)))
	binary.LittleEndian.PutUint64(b[8:16], uint64(h.ArenaSize))
	copy(b[16:], h.ArenaID)
}

func decodeHeader(b []byte) (header, error) {
	if len(b) != headerSize {
		return header{}, fmt.Errorf("%w: header is %d bytes, want %d", ErrBadMessage, len(b), headerSize)
	}
	if string(b[0:4]) != headerMagic {
		return header{}, fmt.Errorf("%w: bad magic %q", ErrBadMessage, b[0:4])
	}
	if v := binary.LittleEndian.Uint16(b[4:6]); v != headerVersion {
		return header{}, fmt.Errorf("%w: header version %d, want %d", ErrBadMessage, v, headerVersion)
	}
	idLen := int(binary.LittleEndian.Uint16(b[6:8]))
	size := int64(binary.LittleEndian.Uint64(b[8:16]))
	if size <= 0 || size > maxArenaSize {
		return header{}, fmt.Errorf("%w: arena size %d", ErrBadMessage, size)
	}
	idField := b[16:]
	if idLen > len(idField) {
		return header{}, fmt.Errorf("%w: arena id length %d", ErrBadMessage, idLen)
	}
	if len(bytes.Trim(idField[idLen:], "\x00")) != 0 {
		return header{}, fmt.Errorf("%w: arena id padding not zero", ErrBadMessage)
	}
	id := string(idField[:idLen])
	if err := validArenaID(id); err != nil {
		return header{}, err
	}
	return header{ArenaSize: size, ArenaID: id}, nil
}

func validArenaID(id string) error {
	if id == "" || len(id) > MaxArenaIDLen || !utf8.ValidString(id) || strings.IndexByte(id, 0) >= 0 {
		return fmt.Errorf("%w: arena id %q must be 1-%d bytes of UTF-8 without NUL", ErrBadMessage, id, MaxArenaIDLen)
	}
	return nil
}

// Frames exchanged after the handshake.
const (
	frameVersion = 1
	frameSize    = 1 + 1 + 2 + 4 + 8 + 8 + 8

	typeAcquire = 1 // consumer -> producer: pin a buffer, reply follows
	typeRelease = 2 // consumer -> producer: drop one pin, no reply
	typeReply   = 3 // producer -> consumer: outcome of an acquire
)

// Reply codes: stable, they cross the wire.
const (
	codeOK         = 0
	codeUnknownBuf = 1 // not a live buffer of this arena (freed, stale, forged)
	codeTooMany    = 2 // the consumer holds too many pins
	maxCode        = codeTooMany
)

type frame struct {
	Type uint8
	Code uint16
	Seq  uint32
	Off  int64
	Len  int64
	Gen  uint64
}

func (f frame) encode(b *[frameSize]byte) {
	b[0] = f.Type
	b[1] = frameVersion
	binary.LittleEndian.PutUint16(b[2:4], f.Code)
	binary.LittleEndian.PutUint32(b[4:8], f.Seq)
	binary.LittleEndian.PutUint64(b[8:16], uint64(f.Off))
	binary.LittleEndian.PutUint64(b[16:24], uint64(f.Len))
	binary.LittleEndian.PutUint64(b[24:32], f.Gen)
}

func decodeFrame(b []byte) (frame, error) {
	if len(b) != frameSize {
		return frame{}, fmt.Errorf("%w: frame is %d bytes, want %d", ErrBadMessage, len(b), frameSize)
	}
	if b[1] != frameVersion {
		return frame{}, fmt.Errorf("%w: frame version %d, want %d", ErrBadMessage, b[1], frameVersion)
	}
	f := frame{
		Type: b[0],
		Code: binary.LittleEndian.Uint16(b[2:4]),
		Seq:  binary.LittleEndian.Uint32(b[4:8]),
		Off:  int64(binary.LittleEndian.Uint64(b[8:16])),
		Len:  int64(binary.LittleEndian.Uint64(b[16:24])),
		Gen:  binary.LittleEndian.Uint64(b[24:32]),
	}
	switch f.Type {
	case typeAcquire, typeRelease:
		if f.Code != 0 {
			return frame{}, fmt.Errorf("%w: code %d on a request", ErrBadMessage, f.Code)
		}
		if f.Off < 0 || f.Len <= 0 || f.Off > maxArenaSize || f.Len > maxArenaSize {
			return frame{}, fmt.Errorf("%w: range off %d len %d", ErrBadMessage, f.Off, f.Len)
		}
	case typeReply:
		if f.Code > maxCode {
			return frame{}, fmt.Errorf("%w: reply code %d", ErrBadMessage, f.Code)
		}
		if f.Off != 0 || f.Len != 0 || f.Gen != 0 {
			return frame{}, fmt.Errorf("%w: reply carries a range", ErrBadMessage)
		}
	default:
		return frame{}, fmt.Errorf("%w: frame type %d", ErrBadMessage, f.Type)
	}
	return f, nil
}
