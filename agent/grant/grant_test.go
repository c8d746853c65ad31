package grant

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/p2ptest"
)

type got struct {
	from peer.ID
	m    Msg
}

// A member's grant reaches the producer with its sender; a non-member's
// is not taken.
func TestGrantDeliveredFromMembersOnly(t *testing.T) {
	producer, worker, stranger := p2ptest.NewHost(t), p2ptest.NewHost(t), p2ptest.NewHost(t)
	ch := make(chan got, 2)
	stop := Serve(producer, func(p peer.ID) bool { return p != stranger.ID() }, func(from peer.ID, m Msg) { ch <- got{from, m} }, zap.NewNop())
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := Send(ctx, worker, producer.ID(), p2ptest.Addrs(producer), New("decode", 2, 1500*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	select {
	case g := <-ch:
		if g.from != worker.ID() || g.m.Stage != "decode" || g.m.Free != 2 || g.m.TTL() != 1500*time.Millisecond {
			t.Fatalf("took %+v from %s, want 2 decode slots for 1.5s from %s", g.m, g.from, worker.ID())
		}
	case <-ctx.Done():
		t.Fatal("the grant never arrived")
	}
	Send(ctx, stranger, producer.ID(), p2ptest.Addrs(producer), New("decode", 1, time.Second)) // refused by a reset, or written and dropped
	select {
	case g := <-ch:
		t.Fatalf("a non-member's grant was taken: %+v", g)
	case <-time.After(300 * time.Millisecond):
	}
	decline := New("decode", 0, time.Second)
	decline.Decline = true
	if err := Send(ctx, worker, producer.ID(), p2ptest.Addrs(producer), decline); err != nil {
		t.Fatal(err)
	}
	select {
	case g := <-ch:
		if !g.m.Decline || g.m.Free != 0 || g.m.Stage != "decode" {
			t.Fatalf("took %+v, want a decline of decode", g.m)
		}
	case <-ctx.Done():
		t.Fatal("the decline never arrived")
	}
	if err := Send(ctx, worker, producer.ID(), p2ptest.Addrs(producer), New("decode", MaxFree+1, time.Second)); err == nil {
		t.Fatal("an out-of-bounds grant was sent")
	}
}

func TestMsgBounds(t *testing.T) {
	for _, m := range []Msg{
		{V: 2, Stage: "decode", Free: 1, TTLMs: 100},
		{V: wireVersion, Free: 1, TTLMs: 100},
		{V: wireVersion, Stage: string(make([]byte, maxStageLen+1)), Free: 1, TTLMs: 100},
		{V: wireVersion, Stage: "decode", Free: -1, TTLMs: 100},
		{V: wireVersion, Stage: "decode", Free: MaxFree + 1, TTLMs: 100},
		{V: wireVersion, Stage: "decode", Free: 1},
		{V: wireVersion, Stage: "decode", Free: 1, TTLMs: int(MaxTTL/time.Millisecond) + 1},
		{V: wireVersion, Stage: "decode", Free: 1, TTLMs: 100, Decline: true},
		{V: wireVersion, Stage: "decode", TTLMs: 100, Decline: true, Waiting: true},
	} {
		if err := m.Validate(); err == nil {
			t.Errorf("grant %+v passed Validate", m)
		}
	}
	var buf bytes.Buffer
	if err := transfer.WriteFrame(&buf, &Msg{V: wireVersion, Stage: string(bytes.Repeat([]byte("x"), maxFrame)), Free: 1, TTLMs: 1}); err != nil {
		t.Fatal(err)
	}
	var m Msg
	if err := transfer.ReadFrame(&buf, maxFrame, &m); !errors.Is(err, transfer.ErrFrameTooLarge) {
		t.Fatalf("oversized frame: %v", err)
	}
}

// FuzzGrantFrame checks that no frame panics the decoder, that whatever
// decodes is within the bounds, and that it survives a round trip.
func FuzzGrantFrame(f *testing.F) {
	f.Add(p2ptest.Frame(f, &Msg{V: wireVersion, Stage: "decode", Free: 2, TTLMs: 2000}))
	f.Add(p2ptest.Frame(f, &Msg{V: wireVersion, Stage: "decode", Free: 3, TTLMs: 500, Waiting: true}))
	f.Add(p2ptest.Frame(f, &Msg{V: wireVersion, Stage: "decode", TTLMs: 500, Decline: true}))
	raw, _ := msgpack.Marshal(map[string]any{"v": 1, "stage": "decode", "free": -5, "ttl_ms": 1})
	f.Add(append([]byte{0, 0, 0, byte(len(raw))}, raw...))
	f.Add([]byte{0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff}) // a huge array header
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})                   // a huge length
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Msg
		if err := transfer.ReadFrame(bytes.NewReader(b), maxFrame, &m); err != nil {
			return
		}
		if m.V != wireVersion || m.Stage == "" || len(m.Stage) > maxStageLen || m.Free < 0 || m.Free > MaxFree || m.TTLMs <= 0 || m.TTL() > MaxTTL || m.Decline && m.Free != 0 {
			t.Fatalf("accepted an out-of-bounds grant %+v", m)
		}
		var again Msg
		if err := transfer.ReadFrame(bytes.NewReader(p2ptest.Frame(t, &m)), maxFrame, &again); err != nil || again != m {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, again, err)
		}
	})
}
