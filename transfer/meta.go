package transfer

import "fmt"

// DType names the element type of a tensor payload.
type DType string

// The element types latentmesh moves. Engines may use others as long as both
// ends agree; ElemSize reports 0 for unknown types and Validate rejects them.
const (
	Float32  DType = "float32"
	Float16  DType = "float16"
	BFloat16 DType = "bfloat16"
	Uint8    DType = "uint8"
)

// MaxDims bounds the rank of a tensor so a hostile header cannot ask a decoder
// to allocate an absurd shape slice.
const MaxDims = 8

// MaxChunks bounds a payload's chunk count: pulls size per-chunk state by
// it, and refs reach a consumer from other agents. 4096 covers a video of
// thousands of frames at one chunk each.
const MaxChunks = 4096

// ElemSize is the size in bytes of one element of d, or 0 when d is unknown.
func (d DType) ElemSize() int64 {
	switch d {
	case Float32:
		return 4
	case Float16, BFloat16:
		return 2
	case Uint8:
		return 1
	}
	return 0
}

// TensorMeta describes a dense, row-major tensor payload. It travels with every
// payload reference (in etcd task records and in transfer tickets) so a
// consumer can size its destination buffer before a single byte arrives.
//
// A payload may be split into NumChunks equal chunks along ChunkDim. Chunks are
// contiguous byte ranges only when ChunkDim is 0 (the outermost dimension), so
// producers that chunk (video latents, frame-major [T,C,h,w]) put the chunked
// dimension first.
type TensorMeta struct {
	DType     DType   `msgpack:"dtype" json:"dtype"`
	Shape     []int64 `msgpack:"shape" json:"shape"`
	ChunkDim  int     `msgpack:"chunk_dim" json:"chunk_dim"`
	NumChunks int     `msgpack:"num_chunks" json:"num_chunks"`
}

// Validate checks that m describes a payload of at most maxBytes bytes whose
// chunks are contiguous, equal byte ranges.
func (m TensorMeta) Validate(maxBytes int64) error {
	if m.DType.ElemSize() == 0 {
		return fmt.Errorf("%w: unknown dtype %q", ErrBadMeta, m.DType)
	}
	if len(m.Shape) == 0 || len(m.Shape) > MaxDims {
		return fmt.Errorf("%w: rank %d not in [1,%d]", ErrBadMeta, len(m.Shape), MaxDims)
	}
	n := m.DType.ElemSize()
	for i, d := range m.Shape {
		if d <= 0 {
			return fmt.Errorf("%w: dim %d is %d", ErrBadMeta, i, d)
		}
		if n > maxBytes/d {
			return fmt.Errorf("%w: more than %d bytes", ErrBadMeta, maxBytes)
		}
		n *= d
	}
	if n > maxBytes {
		return fmt.Errorf("%w: %d bytes exceeds %d", ErrBadMeta, n, maxBytes)
	}
	nc := m.chunks()
	if nc > 1 {
		if m.ChunkDim != 0 {
			return fmt.Errorf("%w: chunk_dim %d: only the outermost dimension (0) can be chunked", ErrBadMeta, m.ChunkDim)
		}
		if m.Shape[0]%int64(nc) != 0 {
			return fmt.Errorf("%w: dim 0 (%d) not divisible into %d chunks", ErrBadMeta, m.Shape[0], nc)
		}
	}
	if m.NumChunks < 0 || m.NumChunks > MaxChunks {
		return fmt.Errorf("%w: num_chunks %d not in [0,%d]", ErrBadMeta, m.NumChunks, MaxChunks)
	}
	return nil
}

// Bytes is the payload size. Call it only on a validated TensorMeta.
func (m TensorMeta) Bytes() int64 {
	n := m.DType.ElemSize()
	for _, d := range m.Shape {
		n *= d
	}
	return n
}

// chunks is NumChunks with 0 meaning "one chunk".
func (m TensorMeta) chunks() int {
	if m.NumChunks <= 1 {
		return 1
	}
	return m.NumChunks
}

// Chunks is the number of chunks the payload is delivered in (at least 1).
func (m TensorMeta) Chunks() int { return m.chunks() }

// ChunkRange is the byte range [off, off+n) of chunk k of a validated TensorMeta.
func (m TensorMeta) ChunkRange(k int) (off, n int64) {
	n = m.Bytes() / int64(m.chunks())
	return int64(k) * n, n
}
