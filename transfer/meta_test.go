package transfer

import (
	"errors"
	"testing"
)

func TestTensorMetaValidate(t *testing.T) {
	const max = 1 << 30
	tests := []struct {
		name string
		m    TensorMeta
		ok   bool
	}{
		{"image latent", TensorMeta{DType: Float32, Shape: []int64{1, 4, 32, 32}}, true},
		{"video in frame chunks", TensorMeta{DType: Float32, Shape: []int64{8, 4, 32, 32}, NumChunks: 8}, true},
		{"unknown dtype", TensorMeta{DType: "float8", Shape: []int64{4}}, false},
		{"no dims", TensorMeta{DType: Uint8}, false},
		{"too many dims", TensorMeta{DType: Uint8, Shape: []int64{1, 1, 1, 1, 1, 1, 1, 1, 1}}, false},
		{"zero dim", TensorMeta{DType: Uint8, Shape: []int64{4, 0}}, false},
		{"overflowing dims", TensorMeta{DType: Float32, Shape: []int64{1 << 40, 1 << 40}}, false},
		{"over the size limit", TensorMeta{DType: Uint8, Shape: []int64{max + 1}}, false},
		{"inner chunk dim", TensorMeta{DType: Uint8, Shape: []int64{4, 4}, ChunkDim: 1, NumChunks: 2}, false},
		{"uneven chunks", TensorMeta{DType: Uint8, Shape: []int64{5}, NumChunks: 2}, false},
		{"negative chunks", TensorMeta{DType: Uint8, Shape: []int64{4}, NumChunks: -1}, false},
		// A peer's ref must not make a consumer size per-chunk state by billions.
		{"too many chunks", TensorMeta{DType: Uint8, Shape: []int64{1 << 20}, NumChunks: MaxChunks * 2}, false},
	}
	for _, tt := range tests {
		err := tt.m.Validate(max)
		if (err == nil) != tt.ok || (err != nil && !errors.Is(err, ErrBadMeta)) {
			t.Errorf("%s: Validate = %v, want ok=%v", tt.name, err, tt.ok)
		}
	}
}
