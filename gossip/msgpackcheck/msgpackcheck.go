// Package msgpackcheck walks msgpack bytes before anything decodes them,
// so a decoder's memory is bounded by the bytes that arrived, not by the
// lengths they declare: vmihailenco/msgpack/v5 sizes allocations from
// headers (and is reported to ignore its own allocation limit). Gossip node
// meta and the engine protocol both check every frame with it first.
package msgpackcheck

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// ErrInvalid marks bytes that are not one bounded msgpack value.
var ErrInvalid = errors.New("msgpackcheck: invalid msgpack")

// Limits bound what a value may declare.
type Limits struct {
	// MaxLen bounds any one string, binary or extension length.
	MaxLen int
	// MaxDepth bounds nesting of arrays and maps.
	MaxDepth int
}

// Check walks one msgpack value that must span all of b. Every string,
// binary and extension length must fit in the remaining bytes and in
// MaxLen, every array or map count must be coverable by the remaining
// bytes (each element takes at least one), and nesting is bounded by
// MaxDepth. Errors wrap ErrInvalid.
func (l Limits) Check(b []byte) error {
	n, err := l.skip(b, 0)
	if err != nil {
		return err
	}
	if n != len(b) {
		return fmt.Errorf("%w: %d trailing bytes", ErrInvalid, len(b)-n)
	}
	return nil
}

// skip returns the length of the msgpack value at the start of b.
func (l Limits) skip(b []byte, depth int) (int, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("%w: truncated", ErrInvalid)
	}
	c := b[0]
	switch {
	case c <= 0x7f || c >= 0xe0: // positive and negative fixint
		return 1, nil
	case c <= 0x8f: // fixmap
		return l.items(b, 1, 2*int(c&0x0f), depth)
	case c <= 0x9f: // fixarray
		return l.items(b, 1, int(c&0x0f), depth)
	case c <= 0xbf: // fixstr
		return skipBytes(b, 1, int(c&0x1f))
	}
	switch c {
	case 0xc0, 0xc2, 0xc3: // nil, false, true
		return 1, nil
	case 0xcc, 0xd0: // uint8, int8
		return skipBytes(b, 1, 1)
	case 0xcd, 0xd1: // uint16, int16
		return skipBytes(b, 1, 2)
	case 0xca, 0xce, 0xd2: // float32, uint32, int32
		return skipBytes(b, 1, 4)
	case 0xcb, 0xcf, 0xd3: // float64, uint64, int64
		return skipBytes(b, 1, 8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16: type byte + data
		return skipBytes(b, 1, 1+(1<<(c-0xd4)))
	case 0xc4, 0xd9: // bin8, str8
		n, err := l.lenAt(b, 1)
		return skipAfterLen(b, 2, n, err)
	case 0xc5, 0xda: // bin16, str16
		n, err := l.lenAt(b, 2)
		return skipAfterLen(b, 3, n, err)
	case 0xc6, 0xdb: // bin32, str32
		n, err := l.lenAt(b, 4)
		return skipAfterLen(b, 5, n, err)
	case 0xc7: // ext8: len, type, data
		n, err := l.lenAt(b, 1)
		return skipAfterLen(b, 3, n, err)
	case 0xc8: // ext16
		n, err := l.lenAt(b, 2)
		return skipAfterLen(b, 4, n, err)
	case 0xc9: // ext32
		n, err := l.lenAt(b, 4)
		return skipAfterLen(b, 6, n, err)
	case 0xdc: // array16
		n, err := l.lenAt(b, 2)
		if err != nil {
			return 0, err
		}
		return l.items(b, 3, n, depth)
	case 0xdd: // array32
		n, err := l.lenAt(b, 4)
		if err != nil {
			return 0, err
		}
		return l.items(b, 5, n, depth)
	case 0xde: // map16
		n, err := l.lenAt(b, 2)
		if err != nil {
			return 0, err
		}
		return l.items(b, 3, 2*n, depth)
	case 0xdf: // map32
		n, err := l.lenAt(b, 4)
		if err != nil {
			return 0, err
		}
		return l.items(b, 5, 2*n, depth)
	}
	return 0, fmt.Errorf("%w: bad msgpack code 0x%02x", ErrInvalid, c)
}

// lenAt reads a big-endian length of size bytes following the code byte.
// Lengths are bounded by MaxLen long before they could overflow int.
func (l Limits) lenAt(b []byte, size int) (int, error) {
	if len(b) < 1+size {
		return 0, fmt.Errorf("%w: truncated length", ErrInvalid)
	}
	var n uint64
	switch size {
	case 1:
		n = uint64(b[1])
	case 2:
		n = uint64(binary.BigEndian.Uint16(b[1:]))
	default:
		n = uint64(binary.BigEndian.Uint32(b[1:]))
	}
	if n > uint64(l.MaxLen) {
		return 0, fmt.Errorf("%w: length %d exceeds %d", ErrInvalid, n, l.MaxLen)
	}
	return int(n), nil
}

func skipAfterLen(b []byte, hdr, n int, err error) (int, error) {
	if err != nil {
		return 0, err
	}
	return skipBytes(b, hdr, n)
}

// skipBytes checks that hdr header bytes and n payload bytes are present.
func skipBytes(b []byte, hdr, n int) (int, error) {
	if hdr+n > len(b) {
		return 0, fmt.Errorf("%w: %d bytes declared, %d present", ErrInvalid, n, len(b)-hdr)
	}
	return hdr + n, nil
}

// skipItems walks count values after an hdr-byte container header.
func (l Limits) items(b []byte, hdr, count, depth int) (int, error) {
	if depth >= l.MaxDepth {
		return 0, fmt.Errorf("%w: nested deeper than %d", ErrInvalid, l.MaxDepth)
	}
	if hdr > len(b) || count > len(b)-hdr {
		return 0, fmt.Errorf("%w: %d elements declared in %d bytes", ErrInvalid, count, len(b)-min(hdr, len(b)))
	}
	off := hdr
	for range count {
		n, err := l.skip(b[off:], depth+1)
		if err != nil {
			return 0, err
		}
		off += n
	}
	return off, nil
}
