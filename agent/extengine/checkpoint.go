package extengine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/latentmesh/latentmesh/agent/engine"
)

// Checkpoint is an external engine's denoise after Step of Total steps
// (protocol v2): enough for any engine registering the same Sampler to
// continue with byte-identical output (Request.Resume).
type Checkpoint struct {
	// Sampler is the engine's name for its state format and schedule
	// (CheckpointSpec.Sampler, registered per model).
	Sampler     string
	Step, Total int
	// State is the engine's sampler state blob, at most MaxState bytes.
	State []byte
	// Latent is the latent at Step as the engine keeps it: the model's
	// CheckpointLatent layout, at most MaxCheckpointLatent bytes.
	Latent []byte
}

// ErrStopped is Run's answer when Request.Stop ended the task at a
// checkpoint.
var ErrStopped = errors.New("extengine: denoise stopped at a checkpoint")

// ErrBadCheckpoint is returned (wrapped) for a checkpoint that does not
// decode, or that the engine's model cannot resume.
var ErrBadCheckpoint = errors.New("extengine: bad checkpoint")

// TensorCache holds tensors an engine computed from conditioning alone
// (the negative prompt's attention keys and values), across requests:
// Get returns a value Put before (the caller does not modify it), Put takes
// ownership of v and may drop it. engine.KVCache is one. Safe for
// concurrent use.
type TensorCache interface {
	Get(key string) ([]byte, bool)
	Put(key string, v []byte)
}

// ckMagic and ckVersion open MarshalBinary's encoding.
var ckMagic = [4]byte{'L', 'M', 'X', 'C'}

const (
	ckVersion = 1
	// ckHeader is magic, version and the sampler's length.
	ckHeader = 4 + 1 + 1
	// ckFixed is step, total, the state's and the latent's lengths.
	ckFixed = 4 * 4
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// MarshalBinary encodes the whole Checkpoint: magic, version, the sampler,
// step, total, state and latent with their lengths, and a CRC-32C of it
// all, so a damaged copy is refused rather than resumed.
func (c Checkpoint) MarshalBinary() ([]byte, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	b := make([]byte, 0, ckHeader+len(c.Sampler)+ckFixed+len(c.State)+len(c.Latent)+4)
	b = append(b, ckMagic[:]...)
	b = append(b, ckVersion, byte(len(c.Sampler)))
	b = append(b, c.Sampler...)
	b = binary.LittleEndian.AppendUint32(b, uint32(c.Step))
	b = binary.LittleEndian.AppendUint32(b, uint32(c.Total))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(c.State)))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(c.Latent)))
	b = append(b, c.State...)
	b = append(b, c.Latent...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// UnmarshalBinary decodes MarshalBinary's encoding into c. Every length is
// checked against its bound and the input before anything is allocated;
// State and Latent are copies, not views of b.
func (c *Checkpoint) UnmarshalBinary(b []byte) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrBadCheckpoint, fmt.Sprintf(format, a...))
	}
	if len(b) < ckHeader+ckFixed+4 || len(b) > ckHeader+MaxSampler+ckFixed+MaxState+MaxCheckpointLatent+4 {
		return bad("%d bytes", len(b))
	}
	if [4]byte(b[:4]) != ckMagic {
		return bad("no checkpoint magic")
	}
	if b[4] != ckVersion {
		return bad("version %d, want %d", b[4], ckVersion)
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return bad("checksum mismatch")
	}
	n := int(b[5])
	rest := body[ckHeader:]
	if n > MaxSampler || len(rest) < n+ckFixed {
		return bad("sampler name of %d bytes in %d", n, len(rest))
	}
	sampler := string(rest[:n])
	rest = rest[n:]
	step, total := binary.LittleEndian.Uint32(rest), binary.LittleEndian.Uint32(rest[4:])
	ns, nl := uint64(binary.LittleEndian.Uint32(rest[8:])), uint64(binary.LittleEndian.Uint32(rest[12:]))
	rest = rest[ckFixed:]
	if ns > MaxState || nl > MaxCheckpointLatent || ns+nl != uint64(len(rest)) {
		return bad("state of %d and latent of %d bytes, %d left", ns, nl, len(rest))
	}
	if step > MaxLimitSteps || total > MaxLimitSteps {
		return bad("step %d of %d", step, total)
	}
	out := Checkpoint{Sampler: sampler, Step: int(step), Total: int(total),
		State: append([]byte(nil), rest[:ns]...), Latent: append([]byte(nil), rest[ns:]...)}
	if err := out.check(); err != nil {
		return err
	}
	*c = out
	return nil
}

// clone is c with State and Latent copied (OnCheckpoint's are views).
func (c Checkpoint) clone() Checkpoint {
	c.State, c.Latent = bytes.Clone(c.State), bytes.Clone(c.Latent)
	return c
}

// check reports whether c is within the protocol's bounds.
func (c Checkpoint) check() error {
	if err := validSampler(c.Sampler); err != nil {
		return fmt.Errorf("%w: %v", ErrBadCheckpoint, err)
	}
	if c.Step < 1 || c.Step >= c.Total || c.Total > MaxLimitSteps {
		return fmt.Errorf("%w: step %d of %d, want 1 <= step < total <= %d", ErrBadCheckpoint, c.Step, c.Total, MaxLimitSteps)
	}
	if len(c.State) > MaxState || len(c.Latent) == 0 || len(c.Latent) > MaxCheckpointLatent {
		return fmt.Errorf("%w: state of %d bytes (at most %d), latent of %d (1 to %d)", ErrBadCheckpoint, len(c.State), MaxState, len(c.Latent), MaxCheckpointLatent)
	}
	return nil
}

// EngineCheckpoint is c as the agent stores, resumes and forks denoise
// checkpoints (engine.Checkpoint): the same Sampler, Step and Total, and
// as State c's whole binary encoding (sampler state and latent, CRC'd).
func (c Checkpoint) EngineCheckpoint() (engine.Checkpoint, error) {
	b, err := c.MarshalBinary()
	if err != nil {
		return engine.Checkpoint{}, err
	}
	return engine.Checkpoint{Sampler: c.Sampler, Step: c.Step, Total: c.Total, State: b}, nil
}

// FromEngineCheckpoint is the Checkpoint EngineCheckpoint made ck of. A
// checkpoint of another engine (the built-in one's state is not this
// encoding) or one whose fields disagree with its encoding is an
// ErrBadCheckpoint, which the agent treats as a resume refused.
func FromEngineCheckpoint(ck engine.Checkpoint) (Checkpoint, error) {
	var c Checkpoint
	if err := c.UnmarshalBinary(ck.State); err != nil {
		return Checkpoint{}, fmt.Errorf("checkpoint of sampler %q: %w", ck.Sampler, err)
	}
	if c.Sampler != ck.Sampler || c.Step != ck.Step || c.Total != ck.Total {
		return Checkpoint{}, fmt.Errorf("%w: %q after step %d of %d, holding %q after step %d of %d", ErrBadCheckpoint,
			ck.Sampler, ck.Step, ck.Total, c.Sampler, c.Step, c.Total)
	}
	return c, nil
}
