package gossip

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/hashicorp/memberlist"
	"github.com/vmihailenco/msgpack/v5"
)

// MetaVersion is the NodeMeta encoding this package writes. Fields are only
// ever added, so DecodeMeta accepts any version >= 1 and ignores keys it does
// not know; a peer running newer code is still understood.
const MetaVersion = 1

// MetaMaxSize is memberlist's limit on node meta; an encoded NodeMeta must fit.
const MetaMaxSize = memberlist.MetaMaxSize

// MaxMetaRoles bounds the roles list in a NodeMeta. There are three roles;
// the slack leaves room for new ones without a version bump.
const MaxMetaRoles = 8

// MaxMetaModels bounds the models list in a NodeMeta, and MaxModelLen each
// name, so that a full list still fits memberlist's 512 bytes.
const (
	MaxMetaModels = 6
	MaxModelLen   = 48
)

// maxMsgpackDepth bounds nesting in meta bytes. NodeMeta is a map of scalars
// and one array of strings; unknown future keys get a little headroom.
const maxMsgpackDepth = 4

// StageCredits is a count per pipeline stage.
type StageCredits struct {
	Encode  uint32 `msgpack:"e,omitempty"`
	Denoise uint32 `msgpack:"n,omitempty"`
	Decode  uint32 `msgpack:"d,omitempty"`
}

// For is the count of role ("encode", "denoise" or "decode"); 0 for others.
func (c StageCredits) For(role string) uint32 {
	switch role {
	case RoleEncode:
		return c.Encode
	case RoleDenoise:
		return c.Denoise
	case RoleDecode:
		return c.Decode
	}
	return 0
}

// Set sets the count of role; other roles are ignored.
func (c *StageCredits) Set(role string, n uint32) {
	switch role {
	case RoleEncode:
		c.Encode = n
	case RoleDenoise:
		c.Denoise = n
	case RoleDecode:
		c.Decode = n
	}
}

// NodeMeta is the soft, frequently changing state a node gossips through
// memberlist: what it can take right now. It must encode to at most
// MetaMaxSize bytes. Keys are one or two letters to keep it small.
type NodeMeta struct {
	Version         uint8        `msgpack:"v"`
	Roles           []string     `msgpack:"r,omitempty"`
	Free            StageCredits `msgpack:"f"`           // free credits per stage
	Queued          uint32       `msgpack:"q,omitempty"` // tasks accepted, not started
	Running         uint32       `msgpack:"u,omitempty"` // tasks executing
	Load            float32      `msgpack:"l,omitempty"` // 0 idle .. 1 saturated (may exceed 1)
	FreeBufferBytes uint64       `msgpack:"b,omitempty"` // free bytes in the transfer arena
	StoreFree       uint64       `msgpack:"s,omitempty"` // the largest object its Store can take now
	// Models lists the models the node's engine serves, with the stages of
	// each; empty means the built-in model on every role (older agents).
	Models []ModelStages `msgpack:"m,omitempty"`
}

// ModelStages is one model a node serves and on which stages.
type ModelStages struct {
	Name   string `msgpack:"n"`
	Stages uint8  `msgpack:"s"` // bit 0 encode, 1 denoise, 2 decode
}

// stageBit maps a role to its bit in ModelStages.Stages.
func stageBit(role string) uint8 {
	switch role {
	case RoleEncode:
		return 1
	case RoleDenoise:
		return 2
	case RoleDecode:
		return 4
	}
	return 0
}

// NewModelStages builds the entry for model served on roles.
func NewModelStages(model string, roles ...string) ModelStages {
	m := ModelStages{Name: model}
	for _, r := range roles {
		m.Stages |= stageBit(r)
	}
	return m
}

// Serves reports whether the node serves role of model. A node that
// gossips no models (an agent from before models) serves only
// defaultModel, on all its roles.
func (m NodeMeta) Serves(role, model, defaultModel string) bool {
	if len(m.Models) == 0 {
		return model == defaultModel
	}
	for _, ms := range m.Models {
		if ms.Name == model {
			return ms.Stages&stageBit(role) != 0
		}
	}
	return false
}

// EncodeMeta encodes m for memberlist. A zero Version is written as
// MetaVersion. It fails with ErrMetaTooLarge if the result would exceed
// MetaMaxSize, and with ErrInvalidMeta if m breaks the bounds DecodeMeta
// enforces (so every encoding decodes).
func EncodeMeta(m NodeMeta) ([]byte, error) {
	if m.Version == 0 {
		m.Version = MetaVersion
	}
	if len(m.Roles) > MaxMetaRoles {
		return nil, fmt.Errorf("%w: %d roles, at most %d", ErrMetaTooLarge, len(m.Roles), MaxMetaRoles)
	}
	if err := m.check(); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	enc.UseCompactFloats(true)
	if err := enc.Encode(&m); err != nil {
		return nil, fmt.Errorf("gossip: encode meta: %w", err)
	}
	if buf.Len() > MetaMaxSize {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrMetaTooLarge, buf.Len(), MetaMaxSize)
	}
	return buf.Bytes(), nil
}

// DecodeMeta decodes node meta received from a peer. It rejects input longer
// than MetaMaxSize before looking at it, checks every length and element
// count in the msgpack structure against the bytes actually present (so a
// forged header cannot make the decoder allocate), and only then decodes into
// the fixed NodeMeta struct.
func DecodeMeta(b []byte) (NodeMeta, error) {
	if len(b) > MetaMaxSize {
		return NodeMeta{}, fmt.Errorf("%w: %d bytes, at most %d", ErrMetaTooLarge, len(b), MetaMaxSize)
	}
	if len(b) == 0 {
		return NodeMeta{}, fmt.Errorf("%w: empty", ErrInvalidMeta)
	}
	if b[0]&0xf0 != 0x80 && b[0] != 0xde && b[0] != 0xdf {
		return NodeMeta{}, fmt.Errorf("%w: not a msgpack map", ErrInvalidMeta)
	}
	if err := checkMsgpack(b); err != nil {
		return NodeMeta{}, err
	}
	var m NodeMeta
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&m); err != nil {
		return NodeMeta{}, fmt.Errorf("%w: %v", ErrInvalidMeta, err)
	}
	if m.Version == 0 {
		return NodeMeta{}, fmt.Errorf("%w: missing version", ErrInvalidMeta)
	}
	if len(m.Roles) > MaxMetaRoles {
		return NodeMeta{}, fmt.Errorf("%w: %d roles, at most %d", ErrInvalidMeta, len(m.Roles), MaxMetaRoles)
	}
	if err := m.check(); err != nil {
		return NodeMeta{}, err
	}
	return m, nil
}

func (m NodeMeta) check() error {
	if len(m.Models) > MaxMetaModels {
		return fmt.Errorf("%w: %d models, at most %d", ErrInvalidMeta, len(m.Models), MaxMetaModels)
	}
	for _, ms := range m.Models {
		if ms.Name == "" || len(ms.Name) > MaxModelLen {
			return fmt.Errorf("%w: model name of %d bytes", ErrInvalidMeta, len(ms.Name))
		}
	}
	if math.IsNaN(float64(m.Load)) || math.IsInf(float64(m.Load), 0) || m.Load < 0 {
		return fmt.Errorf("%w: load %v", ErrInvalidMeta, m.Load)
	}
	return nil
}

func (m NodeMeta) clone() NodeMeta {
	m.Roles = append([]string(nil), m.Roles...)
	m.Models = append([]ModelStages(nil), m.Models...)
	return m
}

// checkMsgpack walks one msgpack value that must span all of b. Every string,
// binary and extension length must fit in the remaining bytes, every array
// or map count must be coverable by the remaining bytes (each element takes
// at least one), and nesting is bounded. msgpack/v5 sizes allocations from
// such headers, so this walk is what keeps DecodeMeta's memory bounded.
func checkMsgpack(b []byte) error {
	n, err := skipMsgpack(b, 0)
	if err != nil {
		return err
	}
	if n != len(b) {
		return fmt.Errorf("%w: %d trailing bytes", ErrInvalidMeta, len(b)-n)
	}
	return nil
}

// skipMsgpack returns the length of the msgpack value at the start of b.
func skipMsgpack(b []byte, depth int) (int, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("%w: truncated", ErrInvalidMeta)
	}
	c := b[0]
	switch {
	case c <= 0x7f || c >= 0xe0: // positive and negative fixint
		return 1, nil
	case c <= 0x8f: // fixmap
		return skipItems(b, 1, 2*int(c&0x0f), depth)
	case c <= 0x9f: // fixarray
		return skipItems(b, 1, int(c&0x0f), depth)
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
		n, err := lenAt(b, 1)
		return skipAfterLen(b, 2, n, err)
	case 0xc5, 0xda: // bin16, str16
		n, err := lenAt(b, 2)
		return skipAfterLen(b, 3, n, err)
	case 0xc6, 0xdb: // bin32, str32
		n, err := lenAt(b, 4)
		return skipAfterLen(b, 5, n, err)
	case 0xc7: // ext8: len, type, data
		n, err := lenAt(b, 1)
		return skipAfterLen(b, 3, n, err)
	case 0xc8: // ext16
		n, err := lenAt(b, 2)
		return skipAfterLen(b, 4, n, err)
	case 0xc9: // ext32
		n, err := lenAt(b, 4)
		return skipAfterLen(b, 6, n, err)
	case 0xdc: // array16
		n, err := lenAt(b, 2)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 3, n, depth)
	case 0xdd: // array32
		n, err := lenAt(b, 4)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 5, n, depth)
	case 0xde: // map16
		n, err := lenAt(b, 2)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 3, 2*n, depth)
	case 0xdf: // map32
		n, err := lenAt(b, 4)
		if err != nil {
			return 0, err
		}
		return skipItems(b, 5, 2*n, depth)
	}
	return 0, fmt.Errorf("%w: bad msgpack code 0x%02x", ErrInvalidMeta, c)
}

// lenAt reads a big-endian length of size bytes following the code byte.
// Lengths are bounded by MetaMaxSize long before they could overflow int.
func lenAt(b []byte, size int) (int, error) {
	if len(b) < 1+size {
		return 0, fmt.Errorf("%w: truncated length", ErrInvalidMeta)
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
	if n > MetaMaxSize {
		return 0, fmt.Errorf("%w: length %d exceeds %d", ErrInvalidMeta, n, MetaMaxSize)
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
		return 0, fmt.Errorf("%w: %d bytes declared, %d present", ErrInvalidMeta, n, len(b)-hdr)
	}
	return hdr + n, nil
}

// skipItems walks count values after an hdr-byte container header.
func skipItems(b []byte, hdr, count, depth int) (int, error) {
	if depth >= maxMsgpackDepth {
		return 0, fmt.Errorf("%w: nested deeper than %d", ErrInvalidMeta, maxMsgpackDepth)
	}
	if hdr > len(b) || count > len(b)-hdr {
		return 0, fmt.Errorf("%w: %d elements declared in %d bytes", ErrInvalidMeta, count, len(b)-min(hdr, len(b)))
	}
	off := hdr
	for range count {
		n, err := skipMsgpack(b[off:], depth+1)
		if err != nil {
			return 0, err
		}
		off += n
	}
	return off, nil
}
