package gossip

import (
	"bytes"
	"fmt"
	"math"

	"github.com/hashicorp/memberlist"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/gossip/msgpackcheck"
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
	Version uint8        `msgpack:"v"`
	Roles   []string     `msgpack:"r,omitempty"`
	Free    StageCredits `msgpack:"f"` // free credits per stage
	// Room is, per stage, how many more tasks pushed to the node beyond
	// its free slots it would start soon enough to keep rather than give
	// back (a short stage's queue credit; routing.QueuePolicy.HoldFor).
	Room            StageCredits `msgpack:"o,omitempty"`
	Queued          uint32       `msgpack:"q,omitempty"` // tasks accepted, not started
	Running         uint32       `msgpack:"u,omitempty"` // tasks executing
	Load            float32      `msgpack:"l,omitempty"` // 0 idle .. 1 saturated (may exceed 1)
	FreeBufferBytes uint64       `msgpack:"b,omitempty"` // free bytes in the transfer arena
	StoreFree       uint64       `msgpack:"s,omitempty"` // the largest object its Store can take now
	// Models lists the models the node's engine serves, with the stages of
	// each; empty means the built-in model on every role (older agents).
	Models []ModelStages `msgpack:"m,omitempty"`
	// Waiting has a stage's bit (StageBit) set while the node dispatches
	// tasks of that stage that wait for a worker: a worker of the stage
	// with a free slot grants it credit.
	Waiting uint8 `msgpack:"w,omitempty"`
	// Yields has a stage's bit set while the node runs batch work of that
	// stage that it would stop for interactive work pushed to it.
	Yields uint8 `msgpack:"y,omitempty"`
}

// ModelStages is one model a node serves and on which stages.
type ModelStages struct {
	Name   string `msgpack:"n"`
	Stages uint8  `msgpack:"s"` // bit 0 encode, 1 denoise, 2 decode
	// DefaultSteps is the model's usual denoise step count as its engine
	// registered it (0: none): a request that names no steps gets it.
	DefaultSteps uint16 `msgpack:"d,omitempty"`
}

// StageBit maps a role to its bit in ModelStages.Stages, NodeMeta.Waiting
// and NodeMeta.Yields.
func StageBit(role string) uint8 { return stageBit(role) }

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

// DefaultSteps is the default step count the node's engine registered for
// model, or 0.
func (m NodeMeta) DefaultSteps(model string) int {
	for _, ms := range m.Models {
		if ms.Name == model {
			return int(ms.DefaultSteps)
		}
	}
	return 0
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
	if err := (msgpackcheck.Limits{MaxLen: MetaMaxSize, MaxDepth: maxMsgpackDepth}).Check(b); err != nil {
		return NodeMeta{}, fmt.Errorf("%w: %w", ErrInvalidMeta, err)
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
