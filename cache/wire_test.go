package cache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/latentmesh/latentmesh/transfer"
)

// testFrame is the frame bound the wire tests read with: the default's.
var testFrame = DefaultConfig().MaxFrame

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

// inlineRequest is a valid inline stage request of n bytes.
func inlineRequest(n int) request {
	data := pattern(n, 9)
	src := testRef()
	src.Meta = transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(n)}}
	src.Checksum = xxh3.Hash(data)
	return request{V: inlineVersion, Op: opStage, Object: "job-1.result", Mode: Pinned, Src: src, Data: data}
}

func validRequests() []request {
	return []request{
		{V: baseVersion, Op: opDrop, Object: "job-1.latent", Payload: "0123456789abcdef"},
		{V: baseVersion, Op: opStage, Object: "job-1.latent", Mode: Consume, Src: testRef()},
		{V: baseVersion, Op: opStage, Object: "preview", Mode: Cache, Src: testRef()},
		{V: inlineVersion, Op: opStage, Object: "job-1.latent", Mode: Consume, Src: testRef()}, // v2 without data
		inlineRequest(1),
		inlineRequest(4096),
		inlineRequest(DefaultConfig().InlineMax),
		{V: baseVersion, Op: opKeep, Object: "job-1.result", Payload: "0123456789abcdef"},
		chainRequest(true, 2),
		chainRequest(false, 1),
		{V: chainVersion, Op: opWait, Object: "job-1.ckpt", Payload: "0123456789abcdef"},
		issuedRequest(chainRequest(false, 1), 300),
		issuedRequest(request{V: baseVersion, Op: opStage, Object: "job-1.latent", Mode: Consume, Src: testRef()}, maxIssued),
		deferredRequest(chainRequest(true, 1)),
		deferredRequest(issuedRequest(chainRequest(true, 0), 300)),
		{V: deferredVersion, Op: opFill, Object: "job-1.ckpt", Payload: "0123456789abcdef"},
	}
}

// deferredRequest is stage request r (in flight) with its fill deferred.
func deferredRequest(r request) request {
	r.V, r.Deferred = deferredVersion, true
	return r
}

// issuedRequest is stage request r carrying an issued ticket of n bytes.
func issuedRequest(r request, n int) request {
	r.V, r.Issued = issuedVersion, pattern(n, 3)
	return r
}

// chainRequest is a valid chained stage request: in flight when early,
// with fallbacks copies of its source under other ids.
func chainRequest(early bool, fallbacks int) request {
	r := request{V: chainVersion, Op: opStage, Object: "job-1.ckpt", Mode: TTL, Src: testRef(), Early: early}
	for i := range fallbacks {
		f := testRef()
		f.ID = fmt.Sprintf("%032x", i+1)
		r.Fallback = append(r.Fallback, f)
	}
	return r
}

func validResponses() []response {
	return []response{
		{V: baseVersion},
		{V: baseVersion, Holder: Holder{Node: "n1", Tier: Disk, Ref: testRef()}},
		{V: baseVersion, ErrCode: codeFull, ErrMsg: "no room"},
	}
}

// invalidInlineFrames are inline requests the decoder must refuse: data
// where the version has none, data that is not the object's size, data
// without a checksum, data on a drop, and a bin header declaring more data
// than the frame holds.
func invalidInlineFrames(tb testing.TB) [][]byte {
	v1 := inlineRequest(64)
	v1.V = baseVersion
	short := inlineRequest(64)
	short.Data = short.Data[:63]
	noSum := inlineRequest(64)
	noSum.Src.Checksum = 0
	drop := validRequests()[0]
	drop.V, drop.Data = inlineVersion, []byte{1}
	out := [][]byte{encodeFrame(tb, &v1), encodeFrame(tb, &short), encodeFrame(tb, &noSum), encodeFrame(tb, &drop)}
	// The 64 data bytes of an inline request, declared as bin32 of 1 GiB.
	r := inlineRequest(64)
	f := encodeFrame(tb, &r)
	i := bytes.Index(f, []byte("data\xc4\x40")) // the key, then a bin8 of 64
	if i < 0 {
		tb.Fatal("no bin8 data field in an inline request's frame")
	}
	i += len("data")
	lie := append(append(append([]byte{}, f[:i]...), 0xc6, 0x40, 0, 0, 0), f[i+2:]...)
	binary.BigEndian.PutUint32(lie, uint32(len(lie)-4))
	return append(out, lie)
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
	for _, b := range invalidInlineFrames(f) {
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 1, 0xc0})                         // nil
	f.Add([]byte{0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff}) // a huge array header
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})                   // a huge length
}

// FuzzRequestFrame checks that no frame panics the request decoder, that
// whatever decodes is valid and survives a round trip, and that inline data
// is never larger than its bound or than the object it claims to be.
func FuzzRequestFrame(f *testing.F) {
	seedFrames(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m request
		if err := transfer.ReadFrame(bytes.NewReader(b), testFrame, &m); err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("decoded request is invalid: %v", err)
		}
		if len(m.Fallback) > maxFallback || ((m.Early || len(m.Fallback) > 0) && (m.V < chainVersion || len(m.Data) > 0)) {
			t.Fatalf("accepted %d fallbacks (early %v) in a v%d request with %d bytes of data", len(m.Fallback), m.Early, m.V, len(m.Data))
		}
		if n := len(m.Issued); n > 0 && (n > maxIssued || m.V < issuedVersion || m.Op != opStage || len(m.Data) > 0) {
			t.Fatalf("accepted an issued ticket of %d bytes in a v%d %s with %d bytes of data", n, m.V, m.Op, len(m.Data))
		}
		if (m.Deferred || m.Op == opFill) && (m.V < deferredVersion || (m.Deferred && (!m.Early || m.Op != opStage))) {
			t.Fatalf("accepted a deferred fill (early %v) in a v%d %s", m.Early, m.V, m.Op)
		}
		if n := len(m.Data); n > 0 && (n > maxInline || n > len(b) || int64(n) != m.Src.Meta.Bytes() || m.V < inlineVersion) {
			t.Fatalf("accepted %d bytes of data (v%d) for a %d-byte object from a %d-byte frame", n, m.V, m.Src.Meta.Bytes(), len(b))
		}
		var again request
		if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &m)), testFrame, &again); err != nil {
			t.Fatalf("re-encoded request does not decode: %v", err)
		}
		if again.V != m.V || again.Op != m.Op || again.Object != m.Object || again.Payload != m.Payload || again.Src.ID != m.Src.ID ||
			again.Src.Checksum != m.Src.Checksum || !bytes.Equal(again.Data, m.Data) || again.Early != m.Early || len(again.Fallback) != len(m.Fallback) ||
			!bytes.Equal(again.Issued, m.Issued) || again.Deferred != m.Deferred {
			t.Fatalf("round trip changed the request: %+v -> %+v", m, again)
		}
		if m.checkInline() == nil && len(m.Data) > 0 && xxh3.Hash(m.Data) != m.Src.Checksum {
			t.Fatal("checkInline passed data that does not match its checksum")
		}
	})
}

// FuzzResponseFrame is FuzzRequestFrame for responses.
func FuzzResponseFrame(f *testing.F) {
	seedFrames(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var m response
		if err := transfer.ReadFrame(bytes.NewReader(b), testFrame, &m); err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("decoded response is invalid: %v", err)
		}
		var again response
		if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &m)), testFrame, &again); err != nil {
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
		{"Version", func(r *request) { r.V = WireVersion + 1 }, transfer.ErrVersion},
		{"NoVersion", func(r *request) { r.V = 0 }, transfer.ErrVersion},
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
		{"DropWithData", func(r *request) { r.V, r.Op, r.Payload, r.Data = inlineVersion, opDrop, "p", []byte{1} }, ErrProtocol},
		{"KeepWithoutPayload", func(r *request) { r.Op = opKeep }, ErrProtocol},
		{"KeepWithData", func(r *request) { r.V, r.Op, r.Payload, r.Data = inlineVersion, opKeep, "p", []byte{1} }, ErrProtocol},
		{"InlineInV1", func(r *request) { *r = inlineRequest(64); r.V = baseVersion }, ErrProtocol},
		{"InlineShort", func(r *request) { *r = inlineRequest(64); r.Data = r.Data[:63] }, ErrProtocol},
		{"InlineLong", func(r *request) { *r = inlineRequest(64); r.Data = append(r.Data, 0) }, ErrProtocol},
		{"InlineNoChecksum", func(r *request) { *r = inlineRequest(64); r.Src.Checksum = 0 }, ErrProtocol},
		{"InlineNoSrc", func(r *request) { *r = inlineRequest(64); r.Src.ID = "" }, ErrProtocol},
		{"InlineOverBound", func(r *request) { *r = inlineRequest(maxInline + 1) }, ErrProtocol},
		{"EarlyInV2", func(r *request) { *r = chainRequest(true, 0); r.V = inlineVersion }, ErrProtocol},
		{"FallbackInV2", func(r *request) { *r = chainRequest(false, 1); r.V = inlineVersion }, ErrProtocol},
		{"ManyFallbacks", func(r *request) { *r = chainRequest(false, maxFallback+1) }, ErrProtocol},
		{"BadFallback", func(r *request) { *r = chainRequest(false, 1); r.Fallback[0].ID = "" }, ErrProtocol},
		{"FallbackOtherSize", func(r *request) { *r = chainRequest(false, 1); r.Fallback[0].Meta.Shape = []int64{8, 64, 64} }, ErrProtocol},
		{"ChainWithData", func(r *request) { *r = inlineRequest(64); r.V, r.Early = chainVersion, true }, ErrProtocol},
		{"WaitInV2", func(r *request) { r.V, r.Op, r.Payload = inlineVersion, opWait, "p" }, ErrProtocol},
		{"WaitWithoutPayload", func(r *request) { r.V, r.Op = chainVersion, opWait }, ErrProtocol},
		{"WaitEarly", func(r *request) { r.V, r.Op, r.Payload, r.Early = chainVersion, opWait, "p", true }, ErrProtocol},
		{"IssuedInV3", func(r *request) { *r = issuedRequest(chainRequest(true, 0), 64); r.V = chainVersion }, ErrProtocol},
		{"IssuedOverBound", func(r *request) { *r = issuedRequest(*r, maxIssued+1) }, ErrProtocol},
		{"IssuedWithData", func(r *request) { *r = inlineRequest(64); r.V, r.Issued = issuedVersion, []byte{1} }, ErrProtocol},
		{"WaitWithIssued", func(r *request) { r.V, r.Op, r.Payload, r.Issued = issuedVersion, opWait, "p", []byte{1} }, ErrProtocol},
		{"DeferredInV4", func(r *request) { *r = deferredRequest(chainRequest(true, 0)); r.V = issuedVersion }, ErrProtocol},
		{"DeferredNotEarly", func(r *request) { *r = deferredRequest(chainRequest(false, 1)) }, ErrProtocol},
		{"FillInV4", func(r *request) { r.V, r.Op, r.Payload = issuedVersion, opFill, "p" }, ErrProtocol},
		{"FillWithoutPayload", func(r *request) { r.V, r.Op = deferredVersion, opFill }, ErrProtocol},
		{"WaitDeferred", func(r *request) { r.V, r.Op, r.Payload, r.Deferred = deferredVersion, opWait, "p", true }, ErrProtocol},
		{"DropWithFallback", func(r *request) {
			r.V, r.Op, r.Payload, r.Fallback = chainVersion, opDrop, "p", []transfer.Ref{testRef()}
		}, ErrProtocol},
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
			if err := transfer.ReadFrame(bytes.NewReader(encodeFrame(t, &r)), maxInline+requestRoom, &got); err == nil {
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
		{"NewerVersion", response{V: baseVersion + 1}}, // responses have one version so far
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

// An inline request's data is checked against the checksum its Src
// declares before anything is staged.
func TestCheckInline(t *testing.T) {
	r := inlineRequest(4096)
	if err := r.checkInline(); err != nil {
		t.Fatalf("intact data: %v", err)
	}
	r.Data[100] ^= 1
	if err := r.Validate(); err != nil {
		t.Fatalf("Validate does not hash: %v", err)
	}
	if err := r.checkInline(); !errors.Is(err, transfer.ErrCorrupt) {
		t.Fatalf("flipped bit: checkInline = %v, want ErrCorrupt", err)
	}
	pull := validRequests()[1]
	if err := pull.checkInline(); err != nil {
		t.Fatalf("a pull request: %v", err)
	}
}

// Inline data is bounded before a byte of it is allocated: a frame longer
// than the reader's MaxFrame is refused from its length prefix alone, and
// a bin header that declares more than the frame holds fails the scan
// before msgpack decodes it.
func TestInlineBoundedBeforeAllocation(t *testing.T) {
	r := inlineRequest(DefaultConfig().InlineMax)
	f := encodeFrame(t, &r)
	if len(f) > testFrame {
		t.Fatalf("an inline request of InlineMax bytes takes a %d-byte frame; MaxFrame is %d", len(f), testFrame)
	}
	var got request
	if err := transfer.ReadFrame(bytes.NewReader(f[:4]), len(f)-5, &got); !errors.Is(err, transfer.ErrFrameTooLarge) {
		t.Fatalf("frame over the bound = %v, want ErrFrameTooLarge", err)
	}
	for i, b := range invalidInlineFrames(t) {
		if err := transfer.ReadFrame(bytes.NewReader(b), testFrame, &got); err == nil {
			t.Errorf("invalid inline frame %d decoded: %+v", i, got)
		}
	}
}

// requestRoom holds the largest request without data: every field at its
// bound. MaxFrame is InlineMax plus requestRoom, so an inline request of
// InlineMax bytes always fits.
func TestRequestRoom(t *testing.T) {
	field := func(n int) string { return strings.Repeat("x", n) }
	src := transfer.Ref{
		ID: field(maxPayloadIDLen),
		Producer: transfer.Producer{
			PeerID: field(maxAddrLen), DataAddr: field(maxAddrLen), Host: field(maxAddrLen), ShmSocket: field(maxAddrLen), RDMA: true,
		},
		Meta:     transfer.TensorMeta{DType: transfer.Float16, Shape: make([]int64, maxRank), ChunkDim: 1 << 30, NumChunks: 1 << 30},
		Checksum: 1<<64 - 1,
	}
	for i := range src.Meta.Shape {
		src.Meta.Shape[i] = 1<<63 - 1
	}
	for range maxAddrs {
		src.Producer.P2PAddrs = append(src.Producer.P2PAddrs, field(maxAddrLen))
	}
	r := request{V: WireVersion, Op: opStage, Object: field(MaxIDLen), Mode: Consume, Src: src, Payload: field(maxPayloadIDLen), Issued: make([]byte, maxIssued)}
	if n := len(encodeFrame(t, &r)); n > 12<<10 || n >= requestRoom {
		t.Fatalf("the largest request takes %d bytes; requestRoom is %d and its comment says under 12 KiB", n, requestRoom)
	}
}

// A marker's value is written by any node: decodeThin takes any bytes
// without panicking, refuses one over maxThin or naming more than
// maxHolders holders, and what it accepts encodes back to the same record.
func FuzzThinRecord(f *testing.F) {
	rec := Record{ID: "j1.result", Checksum: 7, Mode: Pinned, Replicas: 2,
		Holders: []Holder{{Node: "a", Tier: Memory, Ref: transfer.Ref{ID: "p1"}}, {Node: "b", Tier: Disk, Ref: transfer.Ref{ID: "p2"}}}}
	f.Add([]byte(encodeThin(rec)))
	f.Add([]byte(`{"i":"x","h":[` + strings.Repeat(`{"n":"a"},`, 20) + `{"n":"a"}]}`))
	f.Add([]byte(`{"i":"../x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := decodeThin(b)
		if err != nil {
			return
		}
		if len(b) > maxThin || len(got.Holders) > maxHolders || !ValidID(got.ID) {
			t.Fatalf("accepted %d bytes naming %d holders, id %q", len(b), len(got.Holders), got.ID)
		}
		again, err := decodeThin([]byte(encodeThin(got)))
		if err != nil || !reflect.DeepEqual(again, got) {
			t.Fatalf("round trip: %+v %v, want %+v", again, err, got)
		}
	})
}
