package transfer

import (
	"bytes"
	"testing"
)

// Stats.Transfers counts each completed pull with its bytes and its time,
// by the transport that moved it; a failed pull counts nothing.
func TestPullTotals(t *testing.T) {
	dir := shmDir(t)
	prod := startService(t, arenaConfig(t, dir, 16<<20))
	cons := startService(t, arenaConfig(t, dir, 16<<20))
	const size = 3<<20 + 7
	data := randBytes(size, 1)
	shmRef := publishArena(t, prod, u8Meta(size), data)            // in the arena: shm
	heapRef, err := prod.Publish(u8Meta(5000), randBytes(5000, 2)) // on the heap: tcp
	if err != nil {
		t.Fatal(err)
	}
	if got, err := cons.Pull(testCtx(t), shmRef); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("shm pull: %v", err)
	}
	if _, err := cons.Pull(testCtx(t), heapRef); err != nil {
		t.Fatalf("tcp pull: %v", err)
	}
	prod.Release(heapRef.ID)
	if _, err := cons.Pull(testCtx(t), heapRef); err == nil {
		t.Fatal("pull of a released payload succeeded")
	}
	st := cons.Stats()
	for tr, want := range map[string]int64{TransportShm: size, TransportTCP: 5000, TransportRDMA: 0, TransportLocal: 0} {
		got := st.Transfers[tr]
		pulls := int64(0)
		if want > 0 {
			pulls = 1
		}
		if got.Pulls != pulls || got.Bytes != want || (pulls > 0) != (got.Time > 0) {
			t.Errorf("%s: %+v, want %d pull(s) of %d bytes", tr, got, pulls, want)
		}
		if st.Pulls[tr] != got.Pulls {
			t.Errorf("%s: Pulls %d, Transfers %d", tr, st.Pulls[tr], got.Pulls)
		}
	}
	if n := st.StoreTransfers[TransportTCP].Pulls + st.StoreTransfers[TransportShm].Pulls; n != 0 {
		t.Errorf("stage pulls counted as Store pulls: %+v", st.StoreTransfers)
	}
}
