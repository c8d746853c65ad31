package rdma

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
)

func sampleQPInfo() QPInfo {
	return QPInfo{V: WireVersion, LID: 0x1234, QPN: 0xabcdef, PSN: 0x123456,
		GID: [16]byte{0xfe, 0x80, 15: 1}, MTU: 5, Port: 1}
}

func TestQPInfoRoundTrip(t *testing.T) {
	in := sampleQPInfo()
	b, err := in.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != QPInfoSize {
		t.Fatalf("encoded %d bytes, want %d", len(b), QPInfoSize)
	}
	var out QPInfo
	if err := out.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if out != in {
		t.Fatalf("round trip %+v != %+v", out, in)
	}
	in.V = 0 // zero means the current version
	b2, err := in.MarshalBinary()
	if err != nil || !bytes.Equal(b, b2) {
		t.Fatalf("V=0 encodes differently: %v", err)
	}
}

func TestMemInfoRoundTrip(t *testing.T) {
	in := MemInfo{Addr: 0x7f00_0000_1000, RKey: 0xdeadbeef, Len: 1 << 30}
	b, err := in.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != MemInfoSize {
		t.Fatalf("encoded %d bytes, want %d", len(b), MemInfoSize)
	}
	var out MemInfo
	if err := out.UnmarshalBinary(b); err != nil || out != in {
		t.Fatalf("round trip %+v, %v", out, err)
	}
}

func TestQPInfoRejects(t *testing.T) {
	good, _ := sampleQPInfo().MarshalBinary()
	mutate := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(good)) }
	mem, _ := MemInfo{Addr: 1, RKey: 2, Len: 3}.MarshalBinary()
	cases := []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"short", good[:QPInfoSize-1]},
		{"long", append(bytes.Clone(good), 0)},
		{"version", mutate(func(b []byte) []byte { b[0] = 2; return b })},
		{"kind", mutate(func(b []byte) []byte { b[1] = kindMemInfo; return b })},
		{"meminfo", mem},
		{"qpn zero", mutate(func(b []byte) []byte { copy(b[4:8], []byte{0, 0, 0, 0}); return b })},
		{"qpn 25 bits", mutate(func(b []byte) []byte { b[4] = 1; return b })},
		{"psn 25 bits", mutate(func(b []byte) []byte { b[8] = 1; return b })},
		{"mtu 0", mutate(func(b []byte) []byte { b[28] = 0; return b })},
		{"mtu 6", mutate(func(b []byte) []byte { b[28] = 6; return b })},
		{"port 0", mutate(func(b []byte) []byte { b[29] = 0; return b })},
		{"no address", mutate(func(b []byte) []byte { clear(b[2:4]); clear(b[12:28]); return b })},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			q := sampleQPInfo()
			if err := q.UnmarshalBinary(tc.b); !errors.Is(err, ErrBadMessage) {
				t.Fatalf("err = %v, want ErrBadMessage", err)
			}
			if q != sampleQPInfo() {
				t.Fatal("failed decode modified the receiver")
			}
		})
	}
	if _, err := (QPInfo{V: 9, QPN: 1, MTU: 1, Port: 1, LID: 1}).MarshalBinary(); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("marshal of a future version: %v", err)
	}
}

func TestMemInfoRejects(t *testing.T) {
	good, _ := MemInfo{Addr: 4096, RKey: 7, Len: 4096}.MarshalBinary()
	q, _ := sampleQPInfo().MarshalBinary()
	wrap, _ := MemInfo{Addr: 1, RKey: 1, Len: 1}.MarshalBinary()
	copy(wrap[2:10], bytes.Repeat([]byte{0xff}, 8))
	empty := bytes.Clone(good)
	clear(empty[14:22])
	cases := map[string][]byte{
		"short":   good[:MemInfoSize-1],
		"long":    append(bytes.Clone(good), 1),
		"version": append([]byte{0}, good[1:]...),
		"qpinfo":  q,
		"wraps":   wrap,
		"empty":   empty,
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			var m MemInfo
			if err := m.UnmarshalBinary(b); !errors.Is(err, ErrBadMessage) {
				t.Fatalf("err = %v, want ErrBadMessage", err)
			}
		})
	}
}

func FuzzQPInfoUnmarshal(f *testing.F) {
	good, _ := sampleQPInfo().MarshalBinary()
	f.Add(good)
	f.Add([]byte{})
	f.Add(good[:10])
	f.Fuzz(func(t *testing.T, b []byte) {
		var q QPInfo
		if err := q.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatalf("error %v does not wrap ErrBadMessage", err)
			}
			return
		}
		out, err := q.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded %+v does not re-encode: %v", q, err)
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", b, out)
		}
	})
}

func FuzzMemInfoUnmarshal(f *testing.F) {
	good, _ := MemInfo{Addr: 4096, RKey: 7, Len: 4096}.MarshalBinary()
	f.Add(good)
	f.Add([]byte{})
	f.Add(good[:5])
	f.Fuzz(func(t *testing.T, b []byte) {
		var m MemInfo
		if err := m.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrBadMessage) {
				t.Fatalf("error %v does not wrap ErrBadMessage", err)
			}
			return
		}
		out, err := m.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded %+v does not re-encode: %v", m, err)
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", b, out)
		}
	})
}

func TestExchange(t *testing.T) {
	a, b := net.Pipe() // unbuffered: both sides writing first would deadlock
	defer a.Close()
	defer b.Close()
	ia, ib := sampleQPInfo(), sampleQPInfo()
	ib.QPN, ib.PSN = 0x42, 0x99
	type result struct {
		q   QPInfo
		err error
	}
	rc := make(chan result, 1)
	go func() {
		q, err := Exchange(context.Background(), b, ib)
		rc <- result{q, err}
	}()
	got, err := Exchange(context.Background(), a, ia)
	if err != nil {
		t.Fatal(err)
	}
	r := <-rc
	if r.err != nil {
		t.Fatal(r.err)
	}
	if got != ib || r.q != ia {
		t.Fatalf("a got %+v, b got %+v", got, r.q)
	}
}

func TestExchangeCancel(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Exchange(ctx, a, sampleQPInfo()); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestExchangeBadPeer(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	go func() {
		buf := make([]byte, QPInfoSize)
		_, _ = b.Read(buf)
		_, _ = b.Write(make([]byte, QPInfoSize)) // all zero: bad version
		b.Close()
	}()
	if _, err := Exchange(context.Background(), a, sampleQPInfo()); !errors.Is(err, ErrBadMessage) {
		t.Fatalf("err = %v, want ErrBadMessage", err)
	}
}
