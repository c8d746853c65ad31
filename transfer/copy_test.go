package transfer

import (
	"bytes"
	"errors"
	"slices"
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

// A tcp PullChunks hands on, with each chunk, the block checksums the chunk
// was verified against: the producer's.
func TestPullChunksHandsOnVerifiedSums(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 1 << 16
	prod := startService(t, cfg)
	cons := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{4, 3 << 18}, NumChunks: 4} // chunks of 768 KiB, several stripes each
	data := randBytes(meta.Bytes(), 5)
	ref, err := prod.Publish(meta, data)
	if err != nil {
		t.Fatal(err)
	}
	pull, err := cons.PullChunks(testCtx(t), ref, make([]byte, len(data)))
	if err != nil {
		t.Fatal(err)
	}
	seen := 0
	for ch := range pull.Chunks() {
		off, n := meta.ChunkRange(ch.Index)
		if want := blockSums(data[off:off+n], nil); !slices.Equal(ch.Sums, want) {
			t.Fatalf("chunk %d came with %d sums, want the producer's %d", ch.Index, len(ch.Sums), len(want))
		}
		seen++
	}
	if err := pull.Wait(); err != nil || seen != 4 {
		t.Fatalf("%d chunks, %v", seen, err)
	}
	// Without checksums on the wire, chunks come without sums.
	lax := testConfig(t)
	lax.ChecksumTCP = false
	pull, err = startService(t, lax).PullChunks(testCtx(t), ref, make([]byte, len(data)))
	if err != nil {
		t.Fatal(err)
	}
	for ch := range pull.Chunks() {
		if ch.Sums != nil {
			t.Fatalf("chunk %d came with sums that were not verified", ch.Index)
		}
	}
	if err := pull.Wait(); err != nil {
		t.Fatal(err)
	}
}

// A copy in flight marked ready with ChunkCopied is not hashed: it serves
// the checksums its pull verified, so a reader of the copy checks it
// against the first producer's, and a copy corrupted since is refused.
func TestChunkCopiedServesVerifiedSums(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 1 << 16
	prod := startService(t, cfg)
	holder := startService(t, cfg)
	reader := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{4, 3 << 18}, NumChunks: 4}
	data := randBytes(meta.Bytes(), 6)
	src, err := prod.Publish(meta, data)
	if err != nil {
		t.Fatal(err)
	}
	copyOf := func() (Ref, *entry) {
		p, ref, err := holder.Begin(meta)
		if err != nil {
			t.Fatal(err)
		}
		pull, err := holder.PullChunks(testCtx(t), src, p.Buf())
		if err != nil {
			t.Fatal(err)
		}
		e := holder.reg.get(ref.ID)
		for ch := range pull.Chunks() {
			if err := p.ChunkCopied(ch.Index, ch.Sums); err != nil {
				t.Fatal(err)
			}
			ch.Sums[0]++ // the caller's slice is its own again
			if off, n := meta.ChunkRange(ch.Index); !slices.Equal(e.sums[ch.Index], blockSums(data[off:off+n], nil)) {
				t.Fatalf("chunk %d: the verified sums were not kept", ch.Index)
			}
		}
		if err := pull.Wait(); err != nil {
			t.Fatal(err)
		}
		if err := p.ChunkCopied(0, nil); err == nil {
			t.Fatal("a chunk marked ready twice")
		}
		return ref, e
	}
	good, _ := copyOf()
	got := make([]byte, len(data))
	if err := reader.PullInto(testCtx(t), good, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("copy of the copy: %v, equal=%v", err, bytes.Equal(got, data))
	}
	bad, e := copyOf()
	e.buf[len(data)-7] ^= 0x10 // the copy rots after it was verified
	if err := reader.PullInto(testCtx(t), bad, got); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("rotten copy: %v, want ErrCorrupt", err)
	}
}

// A chunk marked ready with ChunkCopied without sums (it came over shm or
// rdma), or with sums that do not fit it, is hashed on its first tcp read,
// not before, and served verified.
func TestChunkCopiedWithoutSumsHashesOnRead(t *testing.T) {
	cfg := testConfig(t)
	cfg.MinStripe = 1 << 16
	holder := startService(t, cfg)
	reader := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{2, 1 << 19}, NumChunks: 2}
	data := randBytes(meta.Bytes(), 8)
	p, ref, err := holder.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ChunkCopied(2, nil); err == nil {
		t.Fatal("chunk 2 of 2 marked ready")
	}
	copy(p.Buf(), data)
	if err := p.ChunkCopied(0, nil); err != nil {
		t.Fatal(err)
	}
	if err := p.ChunkCopied(1, []uint64{1, 2, 3}); err != nil { // 3 sums for 2 blocks
		t.Fatal(err)
	}
	e := holder.reg.get(ref.ID)
	if e.sums[0] != nil || e.sums[1] != nil {
		t.Fatal("a chunk without usable sums was hashed before any read")
	}
	got := make([]byte, len(data))
	if err := reader.PullInto(testCtx(t), ref, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("pull: %v, equal=%v", err, bytes.Equal(got, data))
	}
	for k := range 2 {
		if off, n := meta.ChunkRange(k); !slices.Equal(e.sums[k], blockSums(data[off:off+n], nil)) {
			t.Fatalf("chunk %d: not hashed by its first tcp read", k)
		}
	}
}
