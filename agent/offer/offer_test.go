package offer

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/p2ptest"
)

type got struct {
	from peer.ID
	m    Msg
}

// A member's offer reaches the worker with its sender, byte for byte; a
// non-member's is not taken.
func TestOfferDeliveredFromMembersOnly(t *testing.T) {
	worker, producer, stranger := p2ptest.NewHost(t), p2ptest.NewHost(t), p2ptest.NewHost(t)
	ch := make(chan got, 2)
	stop := Serve(worker, func(p peer.ID) bool { return p != stranger.ID() }, func(from peer.ID, m Msg) { ch <- got{from, m} }, zap.NewNop())
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	o := jobs.Offer{Stage: jobs.Denoise, Node: "den-1", Key: "/latentmesh/default/queues/denoise/claims/den-1/t1", Value: []byte(`{"task":"t1"}`)}
	if err := Send(ctx, producer, worker.ID(), p2ptest.Addrs(worker), o); err != nil {
		t.Fatal(err)
	}
	select {
	case g := <-ch:
		if g.from != producer.ID() || g.m.Stage != "denoise" || g.m.Key != o.Key || !bytes.Equal(g.m.Value, o.Value) {
			t.Fatalf("took %+v from %s, want %+v from %s", g.m, g.from, o, producer.ID())
		}
	case <-ctx.Done():
		t.Fatal("the offer never arrived")
	}
	Send(ctx, stranger, worker.ID(), p2ptest.Addrs(worker), o) // refused by a reset, or written and dropped
	select {
	case g := <-ch:
		t.Fatalf("a non-member's offer was taken: %+v", g)
	case <-time.After(300 * time.Millisecond):
	}
	o.Value = make([]byte, jobs.MaxOfferBytes+1)
	if err := Send(ctx, producer, worker.ID(), p2ptest.Addrs(worker), o); err == nil {
		t.Fatal("an out-of-bounds offer was sent")
	}
}

func TestMsgBounds(t *testing.T) {
	for _, m := range []Msg{
		{V: 2, Stage: "decode", Key: "k", Value: []byte("v")},
		{V: wireVersion, Key: "k", Value: []byte("v")},
		{V: wireVersion, Stage: string(make([]byte, maxStageLen+1)), Key: "k", Value: []byte("v")},
		{V: wireVersion, Stage: "decode", Value: []byte("v")},
		{V: wireVersion, Stage: "decode", Key: string(make([]byte, maxKeyLen+1)), Value: []byte("v")},
		{V: wireVersion, Stage: "decode", Key: "k"},
		{V: wireVersion, Stage: "decode", Key: "k", Value: make([]byte, jobs.MaxOfferBytes+1)},
	} {
		if err := m.Validate(); err == nil {
			t.Errorf("offer %+v passed Validate", m)
		}
	}
	var buf bytes.Buffer
	if err := transfer.WriteFrame(&buf, &Msg{V: wireVersion, Stage: "decode", Key: "k", Value: make([]byte, maxFrame)}); err != nil {
		t.Fatal(err)
	}
	var m Msg
	if err := transfer.ReadFrame(&buf, maxFrame, &m); !errors.Is(err, transfer.ErrFrameTooLarge) {
		t.Fatalf("oversized frame: %v", err)
	}
}

// FuzzOfferFrame checks that no frame panics the decoder, that whatever
// decodes is within the bounds, and that it survives a round trip.
func FuzzOfferFrame(f *testing.F) {
	f.Add(p2ptest.Frame(f, &Msg{V: wireVersion, Stage: "decode", Key: "/p/queues/decode/claims/n/t", Value: []byte(`{"task":"t","pushed":true}`)}))
	raw, _ := msgpack.Marshal(map[string]any{"v": 1, "stage": "decode", "key": "k", "value": []byte{}})
	f.Add(append([]byte{0, 0, 0, byte(len(raw))}, raw...))
	f.Add([]byte{0, 0, 0, 5, 0xc6, 0xff, 0xff, 0xff, 0xff}) // a huge bin header
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})                   // a huge length
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Msg
		if err := transfer.ReadFrame(bytes.NewReader(b), maxFrame, &m); err != nil {
			return
		}
		if m.Validate() != nil {
			t.Fatalf("accepted an out-of-bounds offer %+v", m)
		}
		var again Msg
		if err := transfer.ReadFrame(bytes.NewReader(p2ptest.Frame(t, &m)), maxFrame, &again); err != nil ||
			again.V != m.V || again.Stage != m.Stage || again.Key != m.Key || !bytes.Equal(again.Value, m.Value) {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, again, err)
		}
	})
}
