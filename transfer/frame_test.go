package transfer

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/transfer/shm"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/vmihailenco/msgpack/v5"
)

const fuzzMaxFrame = 64 << 10

func frameBytes(t testing.TB, v any) []byte {
	var b bytes.Buffer
	if err := WriteFrame(&b, v); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func goodResponse() *TicketResponse {
	return &TicketResponse{
		V: WireVersion, Ticket: []byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789ab"),
		Meta:     TensorMeta{DType: Float16, Shape: []int64{4, 16, 64, 64}, NumChunks: 4},
		DataAddr: "127.0.0.1:9000",
	}
}

func TestFrameRoundTrip(t *testing.T) {
	req := &TicketRequest{V: WireVersion, PayloadID: "abc", Proof: []byte("claim")}
	var got TicketRequest
	if err := ReadFrame(bytes.NewReader(frameBytes(t, req)), 1024, &got); err != nil || got.PayloadID != req.PayloadID || string(got.Proof) != "claim" {
		t.Fatalf("request: %+v, %v", got, err)
	}
	var resp TicketResponse
	if err := ReadFrame(bytes.NewReader(frameBytes(t, goodResponse())), 1024, &resp); err != nil {
		t.Fatal(err)
	}
	if resp.Meta.Bytes() != goodResponse().Meta.Bytes() || resp.DataAddr != "127.0.0.1:9000" {
		t.Fatalf("response: %+v", resp)
	}
}

func TestReadFrameRejects(t *testing.T) {
	// A Shape array claiming 2^32-1 elements inside a tiny frame: msgpack
	// v5.4 would allocate 32 GiB for it. The pre-scan must refuse it.
	var bombFrame bytes.Buffer
	body := []byte{0x82, 0xa1, 'v', 0x01, 0xa4, 'm', 'e', 't', 'a', 0x81, 0xa5, 's', 'h', 'a', 'p', 'e', 0xdd, 0xff, 0xff, 0xff, 0xff}
	binary.Write(&bombFrame, binary.BigEndian, uint32(len(body)))
	bombFrame.Write(body)

	oldVersion := frameBytes(t, &TicketRequest{V: 99, PayloadID: "x"})
	bigRank := goodResponse()
	bigRank.Meta.Shape = make([]int64, 100)
	huge := []byte{0xff, 0xff, 0xff, 0xff}
	trailing := append(frameBytes(t, &TicketRequest{V: 1, PayloadID: "x"}), 0xc0)
	binary.BigEndian.PutUint32(trailing, binary.BigEndian.Uint32(trailing)+1)

	cases := []struct {
		name  string
		frame []byte
		v     interface{ Validate() error }
		want  error
	}{
		{"alloc bomb", bombFrame.Bytes(), &TicketResponse{}, ErrProtocol},
		{"unknown version", oldVersion, &TicketRequest{}, ErrVersion},
		{"rank over MaxDims", frameBytes(t, bigRank), &TicketResponse{}, ErrBadMeta},
		{"length over max", huge, &TicketRequest{}, ErrFrameTooLarge},
		{"trailing bytes", trailing, &TicketRequest{}, ErrProtocol},
		{"empty payload id", frameBytes(t, &TicketRequest{V: 1}), &TicketRequest{}, ErrProtocol},
		{"proof too long", frameBytes(t, &TicketRequest{V: 1, PayloadID: "x", Proof: make([]byte, MaxProofLen+1)}), &TicketRequest{}, ErrProtocol},
	}
	for _, tc := range cases {
		if err := ReadFrame(bytes.NewReader(tc.frame), fuzzMaxFrame, tc.v); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	var x struct{ A int }
	if err := ReadFrame(bytes.NewReader(oldVersion), fuzzMaxFrame, &x); err == nil {
		t.Error("ReadFrame decoded into a non-message type")
	}
}

func TestRefEncodings(t *testing.T) {
	ref := Ref{
		ID:       "abc",
		Producer: Producer{PeerID: "12D3", P2PAddrs: []string{"/ip4/1.2.3.4/tcp/1"}, DataAddr: "1.2.3.4:5"},
		Meta:     TensorMeta{DType: BFloat16, Shape: []int64{2, 3}},
		Checksum: 42,
	}
	j, err := json.Marshal(ref)
	if err != nil {
		t.Fatal(err)
	}
	var back Ref
	if err := json.Unmarshal(j, &back); err != nil || back.Producer.DataAddr != ref.Producer.DataAddr || back.Checksum != 42 {
		t.Fatalf("json: %+v %v", back, err)
	}
	m, err := msgpack.Marshal(ref)
	if err != nil {
		t.Fatal(err)
	}
	back = Ref{}
	if err := msgpack.Unmarshal(m, &back); err != nil || back.Meta.Shape[1] != 3 || back.Producer.P2PAddrs[0] != ref.Producer.P2PAddrs[0] {
		t.Fatalf("msgpack: %+v %v", back, err)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().validate(); err != nil {
		t.Fatal(err)
	}
	for name, mut := range map[string]func(*Config){
		"conns":     func(c *Config) { c.Conns = 0 },
		"timeout":   func(c *Config) { c.IOTimeout = 0 },
		"ttl":       func(c *Config) { c.TicketTTL = -1 },
		"frame":     func(c *Config) { c.MaxFrame = 10 },
		"logger":    func(c *Config) { c.Logger = nil },
		"listen":    func(c *Config) { c.DataListen = "" },
		"maxbytes":  func(c *Config) { c.MaxPayloadBytes = 0 },
		"minstripe": func(c *Config) { c.MinStripe = 0 },
	} {
		c := DefaultConfig()
		mut(&c)
		if err := c.validate(); err == nil {
			t.Errorf("%s: invalid config accepted", name)
		}
	}
}

// Fuzz targets: each decoder must reject garbage without panicking or
// allocating beyond its bounds, and accept what its encoder writes.

func FuzzReadFrameTicketRequest(f *testing.F) {
	f.Add(frameBytes(f, &TicketRequest{V: WireVersion, PayloadID: "0123456789abcdef"}))
	f.Add(frameBytes(f, &TicketRequest{V: 2, PayloadID: "x"}))
	f.Add(frameBytes(f, &TicketRequest{V: WireVersion, PayloadID: "x", Proof: []byte(`{"task_key":"/lm/tasks/decode/1/x","rev":7}`)}))
	f.Add(frameBytes(f, &TicketRequest{V: WireVersion, PayloadID: "x", Proof: make([]byte, MaxProofLen+1)}))
	f.Add([]byte{0, 0, 0, 5, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m TicketRequest
		if err := ReadFrame(bytes.NewReader(b), fuzzMaxFrame, &m); err != nil {
			return
		}
		if m.V != WireVersion || m.PayloadID == "" || len(m.PayloadID) > maxPayloadIDLen || len(m.Proof) > MaxProofLen {
			t.Fatalf("accepted invalid request %+v", m)
		}
		var again TicketRequest
		if err := ReadFrame(bytes.NewReader(frameBytes(t, &m)), fuzzMaxFrame, &again); err != nil ||
			again.V != m.V || again.PayloadID != m.PayloadID || again.Watch != m.Watch || !bytes.Equal(again.Proof, m.Proof) {
			t.Fatalf("re-encode: %+v, %v", again, err)
		}
	})
}

func FuzzReadFrameQPRequest(f *testing.F) {
	f.Add(frameBytes(f, &QPRequest{V: WireVersion, Ticket: make([]byte, 80)}))
	f.Add(frameBytes(f, &QPRequest{V: WireVersion, Ticket: make([]byte, maxTicketLen+1)}))
	f.Add(frameBytes(f, &QPRequest{V: 2, Ticket: []byte{1}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m QPRequest
		if err := ReadFrame(bytes.NewReader(b), fuzzMaxFrame, &m); err != nil {
			return
		}
		if m.V != WireVersion || len(m.Ticket) == 0 || len(m.Ticket) > maxTicketLen {
			t.Fatalf("accepted invalid qp request %+v", m)
		}
	})
}

func FuzzReadFrameTicketResponse(f *testing.F) {
	f.Add(frameBytes(f, goodResponse()))
	f.Add(frameBytes(f, &TicketResponse{V: WireVersion, ErrCode: CodeNotFound, ErrMsg: "gone"}))
	bad := goodResponse()
	bad.Meta.Shape = []int64{1 << 40, 1 << 40}
	f.Add(frameBytes(f, bad))
	f.Add([]byte{0, 0, 0, 7, 0x81, 0xa5, 's', 'h', 'a', 'p', 'e'})
	withHandles := goodResponse()
	withHandles.Shm = &shm.Handle{ArenaID: "12D3KooW", Off: 4096, Len: 1 << 20, Gen: 3}
	withHandles.RDMA = &RDMARegion{Addr: 1 << 40, RKey: 7, Len: 1 << 30, Off: 4096}
	f.Add(frameBytes(f, withHandles))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m TicketResponse
		if err := ReadFrame(bytes.NewReader(b), fuzzMaxFrame, &m); err != nil {
			return
		}
		if m.V != WireVersion {
			t.Fatalf("accepted version %d", m.V)
		}
		if m.ErrCode == "" {
			if len(m.Ticket) == 0 || len(m.Ticket) > maxTicketLen || len(m.Meta.Shape) > MaxDims {
				t.Fatalf("accepted invalid response %+v", m)
			}
			_ = m.Meta.Bytes()
		}
	})
}

func FuzzReadFrameChunkEvent(f *testing.F) {
	f.Add(frameBytes(f, &ChunkEvent{V: WireVersion, Chunk: 3}))
	f.Add(frameBytes(f, &ChunkEvent{V: WireVersion, Chunk: -1}))
	f.Add(frameBytes(f, &ChunkEvent{V: WireVersion, Chunk: 0, ErrCode: CodeNotFound, ErrMsg: "released"}))
	f.Add([]byte{0, 0, 0, 3, 0x81, 0xa1, 'v'})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m ChunkEvent
		if err := ReadFrame(bytes.NewReader(b), fuzzMaxFrame, &m); err != nil {
			return
		}
		if m.V != WireVersion || m.Chunk < -1 || len(m.ErrCode) > maxErrMsgLen || len(m.ErrMsg) > maxErrMsgLen {
			t.Fatalf("accepted invalid event %+v", m)
		}
	})
}

func FuzzReadRequest(f *testing.F) {
	f.Add(appendRequest(nil, request{Offset: 0, Length: 4096, Ticket: make([]byte, 80)}))
	f.Add(appendRequest(nil, request{Offset: 1 << 62, Length: 1 << 63, Ticket: []byte{1}}))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var rb reqBuf
		q, err := readRequest(bytes.NewReader(b), &rb)
		if err != nil {
			return
		}
		if len(q.Ticket) == 0 || len(q.Ticket) > maxTicketLen {
			t.Fatalf("ticket of %d bytes accepted", len(q.Ticket))
		}
		if got := appendRequest(nil, q); !bytes.Equal(got, b[:len(got)]) {
			t.Fatal("re-encode differs")
		}
	})
}

func FuzzReadAuth(f *testing.F) {
	var ok bytes.Buffer
	writeAuth(&ok, authMsg{PeerID: []byte("peer"), PubKey: make([]byte, 36), Sig: make([]byte, 64)})
	f.Add(ok.Bytes())
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := readAuth(bytes.NewReader(b))
		if err != nil {
			return
		}
		if len(m.PeerID) > maxPeerIDLen || len(m.PubKey) > maxPubKey || len(m.Sig) > maxSig {
			t.Fatal("oversized auth accepted")
		}
		var nonce [nonceLen]byte
		if _, err := verifyAuth(&nonce, []byte("producer"), m); err == nil {
			t.Fatal("garbage signature verified")
		}
	})
}

func FuzzReadErrStatus(f *testing.F) {
	var b bytes.Buffer
	writeErrStatus(&b, CodeExpired, "ticket expired")
	f.Add(b.Bytes()[1:])
	f.Add([]byte{0xff, 0, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		err := readErrStatus(bytes.NewReader(b))
		var re *RemoteError
		if errors.As(err, &re) && (len(re.Code) > 255 || len(re.Msg) > maxErrMsgLen) {
			t.Fatal("oversized error accepted")
		}
	})
}

func FuzzTicketVerify(f *testing.F) {
	k := &ticketKey{}
	good := k.mint(ticket{payloadID: "0123456789abcdef", consumer: peer.ID("consumer"), expiry: time.Unix(100, 0)})
	f.Add(good)
	f.Add(good[:20])
	f.Add([]byte{1})
	f.Fuzz(func(t *testing.T, b []byte) {
		tk, _, err := k.verify(b)
		if err != nil {
			return
		}
		// Only the minter can produce a valid MAC, so anything accepted
		// must re-mint to the same bytes.
		if again := k.mint(tk); !bytes.Equal(again, b) {
			t.Fatalf("accepted forged ticket %x", b)
		}
	})
}
