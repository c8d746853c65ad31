package transfer

import "testing"

// Retain keeps an arena region allocated past its Buffer's release, so an
// external engine still writing it never shares memory with a new buffer;
// releasing the retain frees it.
func TestRetainOutlivesRelease(t *testing.T) {
	s := startService(t, arenaConfig(t, shmDir(t), 8<<20))
	fd, size, ok := s.ArenaFd()
	if !ok || fd < 0 || size < 8<<20 {
		t.Fatalf("ArenaFd: %d %d %v", fd, size, ok)
	}
	b, err := s.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	off, ok := s.ArenaOffset(b.Bytes()[4096:])
	if !ok {
		t.Fatal("a sub-slice of an arena buffer has no arena offset")
	}
	if base, _ := s.ArenaOffset(b.Bytes()); off != base+4096 {
		t.Fatalf("sub-slice offset %d, want %d", off, base+4096)
	}
	release, ok := s.Retain(b.Bytes()[4096:8192])
	if !ok {
		t.Fatal("Retain of a live buffer's sub-slice failed")
	}
	freeBefore := s.Stats().Arena.Free
	b.Release()
	if free := s.Stats().Arena.Free; free != freeBefore {
		t.Fatalf("released buffer freed %d bytes while retained", free-freeBefore)
	}
	release()
	release() // idempotent
	if free := s.Stats().Arena.Free; free <= freeBefore {
		t.Fatalf("arena free %d after the retain ended, want more than %d", free, freeBefore)
	}
	if _, ok := s.Retain(make([]byte, 16)); ok {
		t.Error("Retain accepted heap memory")
	}
}
