package engine

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/latentmesh/latentmesh/transfer"
)

// Tensor is a dense payload passed between stages: a TensorMeta and its bytes.
// The engine's tensors are float32, little-endian, row-major, so a tensor
// written by one process can be read by another on any machine.
type Tensor struct {
	Meta transfer.TensorMeta
	Data []byte
}

// maxTensorBytes bounds what the engine accepts as input. DefaultLimits allow
// at most 4 Mi pixels, i.e. 64 Ki latent positions per channel; this leaves
// room for many channels while refusing absurd headers.
const maxTensorBytes = 1 << 30

// Validate checks that t's meta is well formed and that Data has exactly the
// size the meta describes.
func (t Tensor) Validate() error {
	if err := t.Meta.Validate(maxTensorBytes); err != nil {
		return fmt.Errorf("%w: %w", ErrBadTensor, err)
	}
	if n := t.Meta.Bytes(); int64(len(t.Data)) != n {
		return fmt.Errorf("%w: %d data bytes, meta says %d", ErrBadTensor, len(t.Data), n)
	}
	return nil
}

// Float32s decodes a float32 tensor into a new slice.
func (t Tensor) Float32s() ([]float32, error) {
	if t.Meta.DType != transfer.Float32 {
		return nil, fmt.Errorf("%w: dtype %q, want %q", ErrBadTensor, t.Meta.DType, transfer.Float32)
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	return BytesFloat32(t.Data)
}

// Float32Bytes encodes v as little-endian float32 bytes in one allocation.
func Float32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, f := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(f))
	}
	return b
}

// putFloat32s writes v, each value rounded to float32, into the first
// 4*len(v) bytes of dst in the engine's tensor encoding.
func putFloat32s(dst []byte, v []float64) {
	for i, f := range v {
		binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(float32(f)))
	}
}

// BytesFloat32 decodes little-endian float32 bytes into a new slice in one
// allocation. len(b) must be a multiple of 4.
func BytesFloat32(b []byte) ([]float32, error) {
	if len(b)%4 != 0 {
		return nil, fmt.Errorf("%w: %d bytes is not a whole number of float32s", ErrBadTensor, len(b))
	}
	v := make([]float32, len(b)/4)
	decodeFloat32s(v, b)
	return v, nil
}

// decodeFloat32s fills dst from len(dst)*4 bytes of src.
func decodeFloat32s(dst []float32, src []byte) {
	for i := range dst {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
	}
}

// checkTensor reports whether t is a float32 tensor of exactly the wanted
// shape whose values are all finite, and returns the values.
func checkTensor(what string, t Tensor, want []int64) ([]float32, error) {
	if !slices.Equal(t.Meta.Shape, want) {
		return nil, fmt.Errorf("%w: %s shape %v, want %v", ErrBadTensor, what, t.Meta.Shape, want)
	}
	v, err := t.Float32s()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	if err := checkFinite(v); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return v, nil
}

// checkFinite rejects NaN and infinite values, which no stage produces.
func checkFinite(v []float32) error {
	for i, f := range v {
		if f != f || f > math.MaxFloat32 || f < -math.MaxFloat32 {
			return fmt.Errorf("%w: element %d is %v", ErrBadTensor, i, f)
		}
	}
	return nil
}
