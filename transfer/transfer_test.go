package transfer

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"
)

func randBytes(n int64, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func u8Meta(n int64) TensorMeta { return TensorMeta{DType: Uint8, Shape: []int64{n}} }

func TestPublishPullRoundTrip(t *testing.T) {
	sizes := []int64{1, 7, 4093, 1<<20 + 13, 8 << 20}
	for _, conns := range []int{1, 4} {
		cfg := testConfig(t)
		cfg.Conns = conns
		cfg.MinStripe = 1 << 16
		prod := startService(t, cfg)
		cons := startService(t, cfg)
		for _, n := range sizes {
			data := randBytes(n, uint64(n))
			ref, err := prod.Publish(u8Meta(n), data)
			if err != nil {
				t.Fatal(err)
			}
			got, err := cons.Pull(testCtx(t), ref)
			if err != nil {
				t.Fatalf("conns=%d n=%d: %v", conns, n, err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("conns=%d n=%d: data differs", conns, n)
			}
			dst := make([]byte, n)
			if err := cons.PullInto(testCtx(t), ref, dst); err != nil {
				t.Fatalf("conns=%d n=%d PullInto: %v", conns, n, err)
			}
			if !bytes.Equal(dst, data) {
				t.Fatalf("conns=%d n=%d PullInto: data differs", conns, n)
			}
		}
		if c, b := prod.Held(); c != len(sizes) || b == 0 {
			t.Fatalf("Held() = %d, %d", c, b)
		}
	}
}

func TestReleasedPayloadNotFound(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	ref, err := prod.Publish(u8Meta(100), randBytes(100, 1))
	if err != nil {
		t.Fatal(err)
	}
	prod.Release(ref.ID)
	if c, b := prod.Held(); c != 0 || b != 0 {
		t.Fatalf("Held() = %d, %d after release", c, b)
	}
	if _, err := cons.Pull(testCtx(t), ref); !errors.Is(err, ErrNotFound) {
		t.Fatalf("pull released: %v, want ErrNotFound", err)
	}
	if _, err := prod.Pull(testCtx(t), ref); !errors.Is(err, ErrNotFound) {
		t.Fatalf("local pull released: %v, want ErrNotFound", err)
	}
}

func TestSamePeerShortcut(t *testing.T) {
	s := startService(t, testConfig(t))
	data := randBytes(1000, 2)
	ref, err := s.Publish(u8Meta(1000), data)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Pull(testCtx(t), ref)
	if err != nil {
		t.Fatal(err)
	}
	if &got[0] != &data[0] {
		t.Fatal("same-peer Pull copied the buffer")
	}
	dst := make([]byte, 1000)
	if err := s.PullInto(testCtx(t), ref, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, data) {
		t.Fatal("same-peer PullInto: data differs")
	}
	if err := s.PullInto(testCtx(t), ref, make([]byte, 999)); !errors.Is(err, ErrBufferSize) {
		t.Fatalf("short dst: %v", err)
	}
}

// dialAs opens an authenticated data connection from s to prod.
func dialAs(t *testing.T, s, prod *Service) *dataConn {
	t.Helper()
	c, _, err := s.pool.get(testCtx(t), prod.DataAddr(), prod.self)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.pool.discard(c) })
	return c
}

func TestTicketChecks(t *testing.T) {
	var skew atomic.Int64
	clock := func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	prod := startServiceClock(t, testConfig(t), clock)
	cons := startService(t, testConfig(t))
	third := startService(t, testConfig(t))
	data := randBytes(4096, 3)
	ref, err := prod.Publish(u8Meta(4096), data)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cons.requestTicket(testCtx(t), prod.self, ref)
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 4096)
	fetch := func(s *Service, tk []byte, off, n int64) error {
		_, _, err := s.fetch(testCtx(t), dialAs(t, s, prod), tk, off, dst[:n])
		return err
	}
	if err := fetch(cons, resp.Ticket, 0, 4096); err != nil || !bytes.Equal(dst, data) {
		t.Fatalf("valid ticket: %v", err)
	}
	tampered := bytes.Clone(resp.Ticket)
	tampered[3] ^= 1
	cases := []struct {
		name   string
		s      *Service
		ticket []byte
		off, n int64
		want   error
		code   string
	}{
		{"replayed by third peer", third, resp.Ticket, 0, 4096, ErrTicket, CodeWrongPeer},
		{"tampered", cons, tampered, 0, 4096, ErrTicket, CodeBadTicket},
		{"truncated", cons, resp.Ticket[:10], 0, 4096, ErrTicket, CodeBadTicket},
		{"range past end", cons, resp.Ticket, 4000, 97, ErrRange, CodeRange},
		{"offset past end", cons, resp.Ticket, 4097, 0, ErrRange, CodeRange},
	}
	for _, tc := range cases {
		err := fetch(tc.s, tc.ticket, tc.off, tc.n)
		var re *RemoteError
		if !errors.Is(err, tc.want) || !errors.As(err, &re) || re.Code != tc.code {
			t.Errorf("%s: %v, want %v (%s)", tc.name, err, tc.want, tc.code)
		}
	}

	skew.Store(int64(time.Minute))
	err = fetch(cons, resp.Ticket, 0, 4096)
	if !errors.Is(err, ErrTicketExpired) {
		t.Fatalf("expired ticket: %v", err)
	}
	// A pull whose ticket expires mid-way fetches a fresh one and goes on.
	tk := &ticketHolder{s: cons, pid: prod.self, ref: ref, ticket: resp.Ticket}
	clear(dst)
	c, _, err := cons.fetchSpan(testCtx(t), nil, prod.DataAddr(), prod.self, tk, span{0, 4096, 0}, dst)
	if err != nil {
		t.Fatalf("pull with expired ticket did not refresh: %v", err)
	}
	cons.pool.put(c)
	if !bytes.Equal(dst, data) {
		t.Fatal("refreshed pull: data differs")
	}
}

func TestCorruptionDetected(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))

	data := randBytes(3<<20, 4)
	ref, err := prod.Publish(u8Meta(3<<20), data)
	if err != nil {
		t.Fatal(err)
	}
	bad := ref
	bad.Checksum++
	if _, err := cons.Pull(testCtx(t), bad); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("wrong checksum: %v, want ErrCorrupt", err)
	}
	// The producer's buffer changes under it. Corrupt only payloads no
	// pull has read yet, and sync through the registry lock, so the race
	// detector sees the flip happen before the producer reads.
	ref2, err := prod.Publish(u8Meta(3<<20), bytes.Clone(data))
	if err != nil {
		t.Fatal(err)
	}
	prod.reg.get(ref2.ID).buf[12345] ^= 0x40
	prod.Held()
	if _, err := cons.Pull(testCtx(t), ref2); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("flipped byte: %v, want ErrCorrupt", err)
	}
	if got, err := cons.Pull(testCtx(t), ref); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("intact payload after corrupt one: %v", err)
	}

	// Chunked payloads carry per-chunk checksums.
	meta := TensorMeta{DType: Float32, Shape: []int64{4, 256}, NumChunks: 4}
	p, cref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	copy(p.Buf(), randBytes(meta.Bytes(), 5))
	for k := range 4 {
		if err := p.ChunkReady(k); err != nil {
			t.Fatal(err)
		}
	}
	p.Buf()[3*1024+5] ^= 1
	prod.Held()
	if _, err := cons.Pull(testCtx(t), cref); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("flipped byte in chunk: %v, want ErrCorrupt", err)
	}
}
