package transfer

import (
	"bytes"
	"testing"

	"github.com/zeebo/xxh3"
)

// A payload published with PublishCopy is hashed only when read over tcp,
// and consumers still verify every block: a copy pulled from it is
// identical, and its Ref carries the checksum it was published with.
func TestPublishCopyVerifiesOnRead(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 1 << 16
	prod := startService(t, cfg)
	cons := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{8, 1 << 17}, NumChunks: 8} // 8 chunks of 128 KiB
	data := randBytes(meta.Bytes(), 3)
	sum := xxh3.Hash(data)
	ref, err := prod.PublishCopy(meta, data, sum, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if ref.Checksum != sum {
		t.Fatalf("ref checksum %x, published with %x", ref.Checksum, sum)
	}
	e := prod.reg.get(ref.ID)
	for k := range e.sums {
		if e.sums[k] != nil {
			t.Fatalf("chunk %d hashed at publish", k)
		}
	}
	for range 2 { // the second read uses the sums the first computed
		dst := make([]byte, len(data))
		if err := cons.PullInto(testCtx(t), ref, dst); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(dst, data) {
			t.Fatal("copy differs")
		}
	}
	// A ref claiming another whole checksum is refused before any byte moves.
	bad := ref
	bad.Checksum++
	if err := cons.PullInto(testCtx(t), bad, make([]byte, len(data))); err == nil {
		t.Fatal("a ref with a wrong checksum pulled")
	}
}

// PullCopy hands back the block checksums a tcp pull verified, and
// PublishCopy serves them without hashing the copy again.
func TestPullCopyKeepsVerifiedSums(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 1 << 16
	prod := startService(t, cfg)
	holder := startService(t, cfg)
	reader := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{4, 3 << 18}, NumChunks: 4} // chunks of 768 KiB
	data := randBytes(meta.Bytes(), 9)
	src, err := prod.Publish(meta, data)
	if err != nil {
		t.Fatal(err)
	}
	cp := make([]byte, len(data))
	sums, err := holder.PullCopy(testCtx(t), src, cp)
	if err != nil {
		t.Fatal(err)
	}
	for k := range sums {
		off, n := meta.ChunkRange(k)
		if want := blockSums(data[off:off+n], nil); len(sums[k]) != len(want) || sums[k][0] != want[0] || sums[k][len(want)-1] != want[len(want)-1] {
			t.Fatalf("chunk %d: %d sums received, want the producer's %d", k, len(sums[k]), len(want))
		}
	}
	ref, err := holder.PublishCopy(meta, cp, src.Checksum, sums, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := holder.reg.get(ref.ID)
	for k := range e.sums {
		if e.sums[k] == nil {
			t.Fatalf("chunk %d: the received sums were not kept", k)
		}
	}
	got := make([]byte, len(data))
	if err := reader.PullInto(testCtx(t), ref, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("second-hand copy differs")
	}
}
