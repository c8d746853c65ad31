package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
)

// Checkpoint is a denoise sampler's state after Step of Total steps: enough
// for any worker to continue with byte-identical output (DenoiseOptions'
// Resume), or to continue with other conditioning, guidance or step count (a
// fork).
type Checkpoint struct {
	// Sampler names the state's format and schedule, e.g.
	// "builtin/v4/ddim-cosine"; a resume needs the same.
	Sampler string
	Step    int // steps done, 1..Total-1
	Total   int // the spec's Steps when it was taken
	// State is opaque. The built-in sampler's is a versioned header (the
	// spec's seed, size and frames, the latent's channels, the schedule) and
	// the latent at full float64 precision: only what does not derive from
	// the conditioning, so a fork may resume it with a new prompt.
	State []byte
}

// ErrStopped is DenoiseWith's answer when DenoiseOptions.Stop made it stop
// between steps.
var ErrStopped = errors.New("engine: denoise stopped at a checkpoint")

// ErrBadCheckpoint is returned (wrapped) for a checkpoint that does not
// decode, or that the sampler cannot resume for the spec at hand.
var ErrBadCheckpoint = errors.New("engine: bad checkpoint")

// Bounds of a Checkpoint's encoding, checked before anything is allocated.
const (
	maxSamplerLen = 128
	// maxCheckpointSteps is beyond any Limits.MaxSteps a model would set.
	maxCheckpointSteps = 1 << 16
	// maxStateBytes: the built-in's largest latent under DefaultLimits is
	// 64 Ki positions x 4 channels x 8 bytes = 2 MiB; 64 channels at
	// 4 Mi pixels is 32 MiB. External engines' states may be larger.
	maxStateBytes = 1 << 28
)

// checkpointMagic and checkpointVersion open MarshalBinary's encoding.
var checkpointMagic = [4]byte{'L', 'M', 'C', 'K'}

const checkpointVersion = 1

// checkpointHeader is magic, version, sampler length; then the sampler,
// step, total and state length (4 bytes each), the state, and a CRC-32C of
// everything before it.
const checkpointHeader = 4 + 1 + 1

// MarshalBinary encodes the whole Checkpoint: a magic, a version, the
// fields with their lengths, and a CRC-32C, so a damaged copy read back
// from a store is refused rather than resumed.
func (c Checkpoint) MarshalBinary() ([]byte, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	b := make([]byte, 0, checkpointHeader+len(c.Sampler)+12+len(c.State)+4)
	b = append(b, checkpointMagic[:]...)
	b = append(b, checkpointVersion, byte(len(c.Sampler)))
	b = append(b, c.Sampler...)
	b = binary.LittleEndian.AppendUint32(b, uint32(c.Step))
	b = binary.LittleEndian.AppendUint32(b, uint32(c.Total))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(c.State)))
	b = append(b, c.State...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// UnmarshalBinary decodes MarshalBinary's encoding into c. Lengths are
// checked against their bounds and against the input before anything is
// allocated; c.State is a copy, not a view of b.
func (c *Checkpoint) UnmarshalBinary(b []byte) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrBadCheckpoint, fmt.Sprintf(format, a...))
	}
	if len(b) < checkpointHeader+12+4 || len(b) > checkpointHeader+maxSamplerLen+12+maxStateBytes+4 {
		return bad("%d bytes", len(b))
	}
	if [4]byte(b[:4]) != checkpointMagic {
		return bad("no checkpoint magic")
	}
	if b[4] != checkpointVersion {
		return bad("version %d, want %d", b[4], checkpointVersion)
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return bad("checksum mismatch")
	}
	n := int(b[5])
	rest := body[checkpointHeader:]
	if n > maxSamplerLen || len(rest) < n+12 {
		return bad("sampler name of %d bytes in %d", n, len(rest))
	}
	sampler := string(rest[:n])
	rest = rest[n:]
	step, total := binary.LittleEndian.Uint32(rest), binary.LittleEndian.Uint32(rest[4:])
	size := binary.LittleEndian.Uint32(rest[8:])
	rest = rest[12:]
	if uint64(size) != uint64(len(rest)) {
		return bad("state of %d bytes, %d left", size, len(rest))
	}
	out := Checkpoint{Sampler: sampler, Step: int(step), Total: int(total), State: append([]byte(nil), rest...)}
	if err := out.check(); err != nil {
		return err
	}
	*c = out
	return nil
}

// check reports whether c's fields are within the encoding's bounds.
func (c Checkpoint) check() error {
	switch {
	case c.Sampler == "" || len(c.Sampler) > maxSamplerLen:
		return fmt.Errorf("%w: sampler name of %d bytes, want 1-%d", ErrBadCheckpoint, len(c.Sampler), maxSamplerLen)
	case c.Total < 2 || c.Total > maxCheckpointSteps || c.Step < 1 || c.Step >= c.Total:
		return fmt.Errorf("%w: step %d of %d, want 1 <= step < total <= %d", ErrBadCheckpoint, c.Step, c.Total, maxCheckpointSteps)
	case len(c.State) > maxStateBytes:
		return fmt.Errorf("%w: state of %d bytes, more than %d", ErrBadCheckpoint, len(c.State), maxStateBytes)
	}
	return nil
}

// samplerName names the built-in sampler's state format and schedule: the
// engine's ID (which changes with anything that changes its output), DDIM
// on the cosine schedule.
func (e *Engine) samplerName() string { return e.id + "/ddim-cosine" }

// The built-in sampler's state: a header, then the latent as float64s.
//
//	magic "LMSD", version (1 byte), seed (8), width, height, frames,
//	channels (4 each), schedule start step (4), its time (8, float64 bits)
const (
	stateVersion = 1
	stateHeader  = 4 + 1 + 8 + 4*4 + 4 + 8
)

var stateMagic = [4]byte{'L', 'M', 'S', 'D'}

// segment is the part of the schedule a run follows: from time t at step
// start down to 0 at the run's last step, in equal steps. A run from noise
// has start 0 and t 1; a fork that changes the step count starts a new
// segment at its checkpoint.
type segment struct {
	start int
	t     float64
}

// at is the time of step i of a run of total steps on segment g. For the
// segment from noise it is exactly 1 - i/total.
func (g segment) at(i, total int) float64 {
	return float64(g.t * (1 - float64(i-g.start)/float64(total-g.start)))
}

// checkpoint is the sampler's state after step steps of s.Steps, in a
// freshly allocated State.
func (sm *sampler) checkpoint(step int) Checkpoint {
	st := make([]byte, stateHeader+8*len(sm.x))
	copy(st, stateMagic[:])
	st[4] = stateVersion
	s := sm.s
	binary.LittleEndian.PutUint64(st[5:], uint64(s.Seed))
	binary.LittleEndian.PutUint32(st[13:], uint32(s.Width))
	binary.LittleEndian.PutUint32(st[17:], uint32(s.Height))
	binary.LittleEndian.PutUint32(st[21:], uint32(s.Frames))
	binary.LittleEndian.PutUint32(st[25:], uint32(sm.nc))
	binary.LittleEndian.PutUint32(st[29:], uint32(sm.seg.start))
	binary.LittleEndian.PutUint64(st[33:], math.Float64bits(sm.seg.t))
	putFloat64s(st[stateHeader:], sm.x)
	return Checkpoint{Sampler: sm.e.samplerName(), Step: step, Total: s.Steps, State: st}
}

// resume loads ck into the sampler, whose latent holds the seed's noise: the
// latent, and the schedule segment the rest of the run follows. It returns
// the steps already done. Seed, size and frames must be the checkpoint's;
// the conditioning, guidance and step count may differ (a fork).
func (sm *sampler) resume(ck *Checkpoint) (int, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrBadCheckpoint, fmt.Sprintf(format, a...))
	}
	if err := ck.check(); err != nil {
		return 0, err
	}
	s, st := sm.s, ck.State
	switch {
	case ck.Sampler != sm.e.samplerName():
		return 0, bad("sampler %q, this engine's is %q", ck.Sampler, sm.e.samplerName())
	case s.Steps <= ck.Step:
		return 0, bad("taken after step %d; the spec has only %d steps", ck.Step, s.Steps)
	case len(st) < stateHeader || [4]byte(st[:4]) != stateMagic:
		return 0, bad("state is not the built-in sampler's")
	case st[4] != stateVersion:
		return 0, bad("state version %d, want %d", st[4], stateVersion)
	}
	seed := int64(binary.LittleEndian.Uint64(st[5:]))
	w, h := binary.LittleEndian.Uint32(st[13:]), binary.LittleEndian.Uint32(st[17:])
	frames, nc := binary.LittleEndian.Uint32(st[21:]), binary.LittleEndian.Uint32(st[25:])
	g := segment{start: int(binary.LittleEndian.Uint32(st[29:])), t: math.Float64frombits(binary.LittleEndian.Uint64(st[33:]))}
	switch {
	case seed != s.Seed:
		return 0, bad("taken for seed %d, the spec has %d", seed, s.Seed)
	case uint64(w) != uint64(s.Width) || uint64(h) != uint64(s.Height) || uint64(frames) != uint64(s.Frames):
		return 0, bad("taken for %dx%dx%d, the spec is %dx%dx%d", w, h, frames, s.Width, s.Height, s.Frames)
	case uint64(nc) != uint64(sm.nc):
		return 0, bad("latent of %d channels, the engine's has %d", nc, sm.nc)
	case len(st) != stateHeader+8*len(sm.x):
		return 0, bad("latent of %d bytes, want %d", len(st)-stateHeader, 8*len(sm.x))
	case g.start < 0 || g.start >= ck.Total || g.start > ck.Step || !(g.t > 0 && g.t <= 1):
		return 0, bad("schedule from step %d at time %v", g.start, g.t)
	}
	x := make([]float64, len(sm.x))
	getFloat64s(x, st[stateHeader:])
	for i, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return 0, bad("latent element %d is %v", i, v)
		}
	}
	copy(sm.x, x)
	if s.Steps == ck.Total {
		sm.seg = g // the same schedule: byte-identical to a run never stopped
	} else {
		// Another step count: from the checkpoint's time down to 0 in
		// the steps that are left.
		sm.seg = segment{start: ck.Step, t: g.at(ck.Step, ck.Total)}
	}
	return ck.Step, nil
}
