package cache

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/transfer"
)

func testRef() transfer.Ref {
	return transfer.Ref{
		ID: "0123456789abcdef0123456789abcdef",
		Producer: transfer.Producer{
			PeerID:   "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",
			P2PAddrs: []string{"/ip4/127.0.0.1/tcp/4001"},
			DataAddr: "127.0.0.1:5001",
			Host:     "host-a",
		},
		Meta:     transfer.TensorMeta{DType: transfer.Float16, Shape: []int64{4, 64, 64}, NumChunks: 4},
		Checksum: 42,
	}
}

func validRequests() []request {
	return []request{
		{V: WireVersion, Op: opDrop, Object: "job-1.latent", Payload: "0123456789abcdef"},
		{V: WireVersion, Op: opStage, Object: "job-1.latent", Mode: Consume, Src: testRef()},
		{V: WireVersion, Op: opStage, Object: "preview", Mode: Cache, Src: testRef()},
	}
}

func validResponses() []response {
	return []response{
		{V: WireVersion},
		{V: WireVersion, Holder: Holder{Node: "n1", Tier: Disk, Ref: testRef()}},
		{V: WireVersion, ErrCode: codeFull, ErrMsg: "no room"},
	}
}

func encodeFrame(tb testing.TB, v any) []byte {
	tb.Helper()
	var b bytes.Buffer
	if err := transfer.WriteFrame(&b, v); err != nil {
		tb.Fatal(err)
	}
	return b.Bytes()
}

func seedFrames(f *testing.F) {
	for _, r := range validRequests() {
		f.Add(encodeFrame(f, &r))
	}
	for _, r := range validResponses() {
		f.Add(encodeFrame(f, &r))
	}
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 1, 0xc0})                         // nil
	f.Add([]byte{0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff}) // a huge array header
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})                   // a huge length
}

// FuzzRequestFrame checks that no frame panics the request decoder and that
// whatever decodes is valid and survives a round trip.
func FuzzRequestFrame(f *testing.F) {
	seedFrames(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m request
		if err := transfer.ReadFrame(bytes.NewReader(b), 16<<10, &m); err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("decoded request is invalid: %v", err)
		}
		var again request
		if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &m)), 16<<10, &again); err != nil {
			t.Fatalf("re-encoded request does not decode: %v", err)
		}
		if again.Op != m.Op || again.Object != m.Object || again.Payload != m.Payload || again.Src.ID != m.Src.ID {
			t.Fatalf("round trip changed the request: %+v -> %+v", m, again)
		}
	})
}

// FuzzResponseFrame is FuzzRequestFrame for responses.
func FuzzResponseFrame(f *testing.F) {
	seedFrames(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m response
		if err := transfer.ReadFrame(bytes.NewReader(b), 16<<10, &m); err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("decoded response is invalid: %v", err)
		}
		var again response
		if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &m)), 16<<10, &again); err != nil {
			t.Fatalf("re-encoded response does not decode: %v", err)
		}
		if again.ErrCode != m.ErrCode || again.Holder.Node != m.Holder.Node || again.Holder.Ref.ID != m.Holder.Ref.ID {
			t.Fatalf("round trip changed the response: %+v -> %+v", m, again)
		}
	})
}

func TestRequestValidate(t *testing.T) {
	stage := validRequests()[1]
	long := strings.Repeat("x", 300)
	for _, tc := range []struct {
		name string
		mod  func(*request)
		want error
	}{
		{"Version", func(r *request) { r.V = 2 }, transfer.ErrVersion},
		{"BadObject", func(r *request) { r.Object = "../x" }, ErrProtocol},
		{"NoObject", func(r *request) { r.Object = "" }, ErrProtocol},
		{"UnknownOp", func(r *request) { r.Op = "steal" }, ErrProtocol},
		{"BadMode", func(r *request) { r.Mode = "forever" }, ErrProtocol},
		{"NoSrc", func(r *request) { r.Src = transfer.Ref{} }, ErrProtocol},
		{"LongPeer", func(r *request) { r.Src.Producer.PeerID = long }, ErrProtocol},
		{"LongAddr", func(r *request) { r.Src.Producer.P2PAddrs = []string{long} }, ErrProtocol},
		{"ManyAddrs", func(r *request) { r.Src.Producer.P2PAddrs = make([]string, maxAddrs+1) }, ErrProtocol},
		{"BadMeta", func(r *request) { r.Src.Meta.DType = "int128" }, transfer.ErrBadMeta},
		{"DropWithoutPayload", func(r *request) { r.Op = opDrop }, ErrProtocol},
		{"DropLongPayload", func(r *request) { r.Op, r.Payload = opDrop, long }, ErrProtocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := stage
			r.Src.Producer.P2PAddrs = append([]string(nil), r.Src.Producer.P2PAddrs...)
			tc.mod(&r)
			if err := r.Validate(); !errors.Is(err, tc.want) {
				t.Fatalf("Validate = %v, want %v", err, tc.want)
			}
			// The decoder rejects it the same way.
			var got request
			if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &r)), 16<<10, &got); err == nil {
				t.Fatal("ReadFrame accepted it")
			}
		})
	}
	for _, r := range validRequests() {
		if err := r.Validate(); err != nil {
			t.Errorf("valid request %+v: %v", r, err)
		}
	}
}

func TestResponseValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		r    response
	}{
		{"Version", response{V: 0}},
		{"LongErr", response{V: WireVersion, ErrCode: codeFailed, ErrMsg: strings.Repeat("e", maxErrLen+1)}},
		{"BadTier", response{V: WireVersion, Holder: Holder{Node: "n", Tier: "tape", Ref: testRef()}}},
		{"LongNode", response{V: WireVersion, Holder: Holder{Node: strings.Repeat("n", maxNodeLen+1), Tier: Memory, Ref: testRef()}}},
		{"NoRef", response{V: WireVersion, Holder: Holder{Node: "n", Tier: Memory}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.r.Validate(); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	for _, r := range validResponses() {
		if err := r.Validate(); err != nil {
			t.Errorf("valid response %+v: %v", r, err)
		}
	}
}
