package rdma

import (
	"fmt"
	"slices"
	"testing"
)

func TestPlan(t *testing.T) {
	cases := []struct {
		name             string
		addr             uint64
		localOff, n, max int64
		want             []WR
	}{
		{"invalid n", 0, 0, 0, 4, nil},
		{"invalid max", 0, 0, 10, 0, nil},
		{"negative local", 0, -1, 10, 4, nil},
		{"single", 1000, 5, 3, 4, []WR{{0, 1000, 5, 0, 3}}},
		{"exact", 1000, 0, 8, 4, []WR{{0, 1000, 0, 0, 4}, {1, 1004, 4, 4, 4}}},
		{"ragged", 1000, 100, 10, 4, []WR{{0, 1000, 100, 0, 4}, {1, 1004, 104, 4, 4}, {2, 1008, 108, 8, 2}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := Plan(tc.addr, tc.localOff, tc.n, tc.max); !slices.Equal(got, tc.want) {
				t.Fatalf("Plan = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestPlanChunksRespectsBoundaries(t *testing.T) {
	cases := []struct{ n, max, chunk int64 }{
		{100, 7, 25}, {100, 30, 25}, {100, 100, 10}, {10, 3, 4}, {1, 1, 1}, {64, 8, 0}, {64, 8, 1000},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("n%d_max%d_chunk%d", tc.n, tc.max, tc.chunk), func(t *testing.T) {
			wrs := PlanChunks(50, 10, tc.n, tc.max, tc.chunk)
			chunk := tc.chunk
			if chunk <= 0 || chunk > tc.n {
				chunk = tc.n
			}
			var off int64
			for i, w := range wrs {
				switch {
				case w.ID != uint64(i), w.Off != off, w.Len < 1, w.Len > tc.max:
					t.Fatalf("wr %d = %+v", i, w)
				case w.RemoteAddr != 50+uint64(w.Off), w.LocalOff != 10+w.Off:
					t.Fatalf("wr %d addresses %+v", i, w)
				case w.Off/chunk != (w.Off+w.Len-1)/chunk:
					t.Fatalf("wr %d %+v crosses a %d-byte chunk boundary", i, w, chunk)
				}
				off += w.Len
			}
			if off != tc.n {
				t.Fatalf("plan covers %d bytes, want %d", off, tc.n)
			}
		})
	}
}

func TestTrackerDepthAndChunks(t *testing.T) {
	wrs := PlanChunks(0, 0, 100, 10, 25) // chunks 25 bytes: WRs 10,10,5 per chunk
	tr, err := NewTracker(wrs, 25, 4)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Chunks() != 4 || len(wrs) != 12 {
		t.Fatalf("chunks %d, wrs %d", tr.Chunks(), len(wrs))
	}
	if p := tr.Postable(); len(p) != 4 {
		t.Fatalf("postable %d, want depth 4", len(p))
	}
	tr.Posted(2)
	if p := tr.Postable(); len(p) != 2 || p[0].ID != 2 {
		t.Fatalf("postable after 2 posted: %v", p)
	}
	tr.Posted(2)
	if len(tr.Postable()) != 0 || tr.Outstanding() != 4 {
		t.Fatal("queue should be full")
	}
	mustComplete := func(id uint64, want ...int) {
		t.Helper()
		got, err := tr.Complete(id)
		if err != nil || !slices.Equal(got, want) {
			t.Fatalf("Complete(%d) = %v, %v; want %v", id, got, err, want)
		}
	}
	mustComplete(1)
	mustComplete(3) // chunk 1 is WRs 3,4,5
	mustComplete(2)
	if tr.ChunkDone(0) {
		t.Fatal("chunk 0 done before wr 0")
	}
	mustComplete(0, 0) // chunk 0 is WRs 0,1,2
	if !tr.ChunkDone(0) || tr.ChunkDone(1) || tr.ChunkDone(-1) || tr.ChunkDone(9) {
		t.Fatal("ChunkDone")
	}
	if _, err := tr.Complete(2); err == nil {
		t.Fatal("duplicate completion accepted")
	}
	if _, err := tr.Complete(7); err == nil {
		t.Fatal("completion of an unposted wr accepted")
	}
	for !tr.Done() {
		p := tr.Postable()
		tr.Posted(len(p))
		for _, w := range p {
			if _, err := tr.Complete(w.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	for k := range 4 {
		if !tr.ChunkDone(k) {
			t.Fatalf("chunk %d not done", k)
		}
	}
}

func TestTrackerSpanningWR(t *testing.T) {
	wrs := Plan(0, 0, 30, 15) // two WRs; chunks of 10 bytes: WR 0 covers 0,1; WR 1 covers 1,2
	tr, err := NewTracker(wrs, 10, 8)
	if err != nil {
		t.Fatal(err)
	}
	tr.Posted(2)
	if got, _ := tr.Complete(1); !slices.Equal(got, []int{2}) {
		t.Fatalf("Complete(1) = %v, want [2]", got)
	}
	if got, _ := tr.Complete(0); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("Complete(0) = %v, want [0 1]", got)
	}
	if !tr.Done() {
		t.Fatal("not done")
	}
}

func TestNewTrackerRejects(t *testing.T) {
	good := Plan(0, 0, 10, 4)
	bad := slices.Clone(good)
	bad[1].Off++
	cases := []struct {
		name  string
		wrs   []WR
		depth int
	}{
		{"empty", nil, 1},
		{"depth 0", good, 0},
		{"gap", bad, 1},
		{"reordered", []WR{good[1], good[0]}, 1},
	}
	for _, tc := range cases {
		if _, err := NewTracker(tc.wrs, 0, tc.depth); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func TestTrackerPostedPanicsBeyondPostable(t *testing.T) {
	tr, _ := NewTracker(Plan(0, 0, 10, 4), 0, 2)
	defer func() {
		if recover() == nil {
			t.Fatal("Posted(3) with depth 2 did not panic")
		}
	}()
	tr.Posted(3)
}

func ExamplePlan() {
	for _, w := range Plan(0x1000, 0, 10<<20, 4<<20) {
		fmt.Printf("wr %d: read %d bytes at %#x into local offset %d\n", w.ID, w.Len, w.RemoteAddr, w.LocalOff)
	}
	// Output:
	// wr 0: read 4194304 bytes at 0x1000 into local offset 0
	// wr 1: read 4194304 bytes at 0x401000 into local offset 4194304
	// wr 2: read 2097152 bytes at 0x801000 into local offset 8388608
}

func ExampleTracker() {
	// A 3 MiB payload of three 1 MiB chunks, read in 512 KiB requests, at most
	// four in flight.
	wrs := PlanChunks(0x10000, 0, 3<<20, 512<<10, 1<<20)
	tr, _ := NewTracker(wrs, 1<<20, 4)
	for !tr.Done() {
		batch := tr.Postable()
		tr.Posted(len(batch)) // ibv_post_send
		for _, w := range batch {
			landed, _ := tr.Complete(w.ID) // ibv_poll_cq
			for _, k := range landed {
				fmt.Println("chunk", k, "landed")
			}
		}
	}
	// Output:
	// chunk 0 landed
	// chunk 1 landed
	// chunk 2 landed
}
