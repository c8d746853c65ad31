package transfer

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/latentmesh/latentmesh/transfer/shm"
)

// WireVersion is the version of the control messages this build speaks.
const WireVersion = 1

// Bounds on variable-length fields of control messages, checked after decode.
const (
	maxPayloadIDLen = 64
	maxTicketLen    = 512
	maxAddrLen      = 256
	maxAddrs        = 32
	maxErrMsgLen    = 1024
	maxPeerIDLen    = 128
	// MaxProofLen bounds TicketRequest.Proof. A claim proof (a task key, a
	// stage and a revision) takes about a tenth of it.
	MaxProofLen = 1024
)

// maxNesting bounds msgpack container nesting inside one frame; our messages
// nest two levels deep.
const maxNesting = 8

// validator is implemented by every control message; ReadFrame calls it after
// decoding so a message is never used before its bounds are checked.
type validator interface {
	Validate() error
}

// WriteFrame encodes v as msgpack and writes it with a 4-byte big-endian
// length prefix in a single Write.
func WriteFrame(w io.Writer, v any) error {
	var buf bytes.Buffer
	buf.Write([]byte{0, 0, 0, 0})
	enc := msgpack.NewEncoder(&buf)
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("transfer: encode frame: %w", err)
	}
	b := buf.Bytes()
	n := len(b) - 4
	if uint64(n) > math.MaxUint32 {
		return fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, n)
	}
	binary.BigEndian.PutUint32(b, uint32(n))
	_, err := w.Write(b)
	return err
}

// ReadFrame reads one length-prefixed msgpack frame of at most max bytes and
// decodes it into v, which must be a pointer to one of this package's message
// structs (anything implementing Validate() error). The length is checked
// before anything is allocated, every msgpack length inside the frame is
// checked against the bytes actually present before decoding (msgpack v5.4
// preallocates slices from the declared length), and the decoded message is
// validated, which rejects unknown versions.
func ReadFrame(r io.Reader, max int, v any) error {
	val, ok := v.(validator)
	if !ok {
		return fmt.Errorf("transfer: ReadFrame into %T: not a message type", v)
	}
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if max < 0 || uint64(n) > uint64(max) {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrFrameTooLarge, n, max)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return err
	}
	if err := scanMsgpack(b); err != nil {
		return err
	}
	if err := msgpack.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%w: decode: %v", ErrProtocol, err)
	}
	return val.Validate()
}

// scanMsgpack walks one msgpack value spanning exactly b without decoding it,
// and fails if any declared string, binary, array or map length exceeds the
// bytes that remain, if containers nest deeper than maxNesting, or if bytes
// trail the value. After it passes, decoding b allocates O(len(b)).
func scanMsgpack(b []byte) error {
	// stack holds, per open container, how many values it still owes.
	var stackArr [maxNesting + 1]int
	stack := stackArr[:1]
	stack[0] = 1
	i := 0
	need := func(k uint64) error {
		if k > uint64(len(b)-i) {
			return fmt.Errorf("%w: msgpack length %d exceeds frame", ErrProtocol, k)
		}
		return nil
	}
	for len(stack) > 0 {
		if stack[len(stack)-1] == 0 {
			stack = stack[:len(stack)-1]
			continue
		}
		stack[len(stack)-1]--
		if i >= len(b) {
			return fmt.Errorf("%w: truncated msgpack", ErrProtocol)
		}
		c := b[i]
		i++
		var skip uint64     // bytes of payload that follow
		var children uint64 // values nested inside
		switch {
		case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		case c >= 0x80 && c <= 0x8f:
			children = 2 * uint64(c&0x0f)
		case c >= 0x90 && c <= 0x9f:
			children = uint64(c & 0x0f)
		case c >= 0xa0 && c <= 0xbf:
			skip = uint64(c & 0x1f)
		default:
			var lenBytes int
			var kind byte // 's' skip, 'a' array, 'm' map, 'x' ext
			switch c {
			case 0xc4, 0xd9:
				lenBytes, kind = 1, 's'
			case 0xc5, 0xda:
				lenBytes, kind = 2, 's'
			case 0xc6, 0xdb:
				lenBytes, kind = 4, 's'
			case 0xc7:
				lenBytes, kind = 1, 'x'
			case 0xc8:
				lenBytes, kind = 2, 'x'
			case 0xc9:
				lenBytes, kind = 4, 'x'
			case 0xca:
				skip = 4
			case 0xcb:
				skip = 8
			case 0xcc, 0xd0:
				skip = 1
			case 0xcd, 0xd1:
				skip = 2
			case 0xce, 0xd2:
				skip = 4
			case 0xcf, 0xd3:
				skip = 8
			case 0xd4:
				skip = 2
			case 0xd5:
				skip = 3
			case 0xd6:
				skip = 5
			case 0xd7:
				skip = 9
			case 0xd8:
				skip = 17
			case 0xdc:
				lenBytes, kind = 2, 'a'
			case 0xdd:
				lenBytes, kind = 4, 'a'
			case 0xde:
				lenBytes, kind = 2, 'm'
			case 0xdf:
				lenBytes, kind = 4, 'm'
			default:
				return fmt.Errorf("%w: msgpack byte 0x%02x", ErrProtocol, c)
			}
			if lenBytes > 0 {
				if err := need(uint64(lenBytes)); err != nil {
					return err
				}
				var n uint64
				for _, x := range b[i : i+lenBytes] {
					n = n<<8 | uint64(x)
				}
				i += lenBytes
				switch kind {
				case 's':
					skip = n
				case 'x':
					skip = n + 1
				case 'a':
					children = n
				case 'm':
					children = 2 * n
				}
			}
		}
		if err := need(skip); err != nil {
			return err
		}
		i += int(skip)
		if children > 0 {
			// Every nested value takes at least one byte.
			if err := need(children); err != nil {
				return err
			}
			if len(stack) > maxNesting {
				return fmt.Errorf("%w: msgpack nested deeper than %d", ErrProtocol, maxNesting)
			}
			stack = append(stack, int(children))
		}
	}
	if i != len(b) {
		return fmt.Errorf("%w: %d bytes trail the message", ErrProtocol, len(b)-i)
	}
	return nil
}

// TicketRequest asks a producer, over ProtocolID, for a ticket to pull a payload.
type TicketRequest struct {
	V         int    `msgpack:"v"`
	PayloadID string `msgpack:"payload_id"`
	// Watch asks the producer to keep the stream open after the response and
	// send one ChunkEvent per chunk, in index order, as each becomes ready
	// (shm and rdma pulls read the producer's memory directly, so they learn
	// readiness this way).
	Watch bool `msgpack:"watch,omitempty"`
	// Proof is opaque to transfer: the consumer's evidence that it may read
	// the payload, which the producer's Config.AuthorizePayload judges
	// (the agent sends the claim of the task consuming it). At most
	// MaxProofLen bytes; empty when the pull carries none (WithTicketProof).
	Proof []byte `msgpack:"proof,omitempty"`
}

// Validate checks the version and bounds of a decoded request.
func (m *TicketRequest) Validate() error {
	if m.V != WireVersion {
		return fmt.Errorf("%w: ticket request v%d", ErrVersion, m.V)
	}
	if m.PayloadID == "" || len(m.PayloadID) > maxPayloadIDLen {
		return fmt.Errorf("%w: payload id of %d bytes", ErrProtocol, len(m.PayloadID))
	}
	if len(m.Proof) > MaxProofLen {
		return fmt.Errorf("%w: proof of %d bytes", ErrProtocol, len(m.Proof))
	}
	return nil
}

// TicketResponse answers a TicketRequest. On success Ticket is set and ErrCode
// is empty; the ticket is opaque to the consumer.
type TicketResponse struct {
	V        int        `msgpack:"v"`
	Ticket   []byte     `msgpack:"ticket"`
	Meta     TensorMeta `msgpack:"meta"`
	DataAddr string     `msgpack:"data_addr"`
	ErrCode  string     `msgpack:"err_code"`
	ErrMsg   string     `msgpack:"err_msg"`
	// Checksum is the XXH3-64 of the whole payload as published (0 for one
	// published with Begin). A consumer compares it with its Ref's, so a Ref
	// that does not describe what the producer holds is caught before the
	// per-block checksums vouch for the bytes.
	Checksum uint64 `msgpack:"checksum,omitempty"`
	// Shm names the payload in the producer's arena, for a consumer on the
	// same host; nil when the payload is not in the arena.
	Shm *shm.Handle `msgpack:"shm,omitempty"`
	// RDMA names the payload in the producer's registered arena; nil when
	// the producer has no RDMA device or the payload is not in the arena.
	RDMA *RDMARegion `msgpack:"rdma,omitempty"`
	// Complete, on a ticket issued ahead of a request (Service.Issue), says
	// every chunk was ready when it was issued, so a consumer may read the
	// payload without the producer's chunk events.
	Complete bool `msgpack:"complete,omitempty"`
}

// RDMARegion is where a payload lies in a producer's registered memory: the
// region (as rdma.MemInfo) and the payload's offset in it. The producer
// registers each payload as a region of its own, so Off is 0 and Len the
// payload's size: the rkey reaches no other payload's bytes.
type RDMARegion struct {
	Addr uint64 `msgpack:"addr"`
	RKey uint32 `msgpack:"rkey"`
	Len  uint64 `msgpack:"len"`
	Off  uint64 `msgpack:"off"`
}

// QPRequest opens an RDMAProtocolID stream: the consumer shows a ticket
// this producer issued to it (for any payload) before the producer creates
// a queue pair for it. The queue pair alone reads nothing: each payload's
// bytes are a region of their own whose rkey only that payload's ticket
// response carries.
type QPRequest struct {
	V      int    `msgpack:"v"`
	Ticket []byte `msgpack:"ticket"`
}

// Validate checks the version and bounds of a decoded request.
func (m *QPRequest) Validate() error {
	if m.V != WireVersion {
		return fmt.Errorf("%w: qp request v%d", ErrVersion, m.V)
	}
	if len(m.Ticket) == 0 || len(m.Ticket) > maxTicketLen {
		return fmt.Errorf("%w: ticket of %d bytes", ErrProtocol, len(m.Ticket))
	}
	return nil
}

// ChunkEvent follows a TicketResponse on a watched stream: chunk Chunk is
// ready (its bytes may be read), or, with Chunk -1, nothing changed yet (a
// heartbeat, sent every third of the producer's IOTimeout). ErrCode ends the
// stream with an error.
type ChunkEvent struct {
	V       int    `msgpack:"v"`
	Chunk   int    `msgpack:"chunk"`
	ErrCode string `msgpack:"err_code,omitempty"`
	ErrMsg  string `msgpack:"err_msg,omitempty"`
}

// Validate checks the version and bounds of a decoded event.
func (m *ChunkEvent) Validate() error {
	if m.V != WireVersion {
		return fmt.Errorf("%w: chunk event v%d", ErrVersion, m.V)
	}
	if len(m.ErrCode) > maxErrMsgLen || len(m.ErrMsg) > maxErrMsgLen {
		return fmt.Errorf("%w: error text too long", ErrProtocol)
	}
	if m.Chunk < -1 {
		return fmt.Errorf("%w: chunk %d", ErrProtocol, m.Chunk)
	}
	return nil
}

// Validate checks the version and bounds of a decoded response. Meta is
// checked against the largest payload any build accepts; the caller compares
// it with the Ref it pulls.
func (m *TicketResponse) Validate() error {
	if m.V != WireVersion {
		return fmt.Errorf("%w: ticket response v%d", ErrVersion, m.V)
	}
	if len(m.ErrCode) > maxErrMsgLen || len(m.ErrMsg) > maxErrMsgLen {
		return fmt.Errorf("%w: error text too long", ErrProtocol)
	}
	if m.ErrCode != "" {
		return nil
	}
	if len(m.Ticket) == 0 || len(m.Ticket) > maxTicketLen {
		return fmt.Errorf("%w: ticket of %d bytes", ErrProtocol, len(m.Ticket))
	}
	if m.DataAddr == "" || len(m.DataAddr) > maxAddrLen {
		return fmt.Errorf("%w: data addr of %d bytes", ErrProtocol, len(m.DataAddr))
	}
	if err := m.Meta.Validate(math.MaxInt64); err != nil {
		return err
	}
	if h := m.Shm; h != nil {
		if h.ArenaID == "" || len(h.ArenaID) > shm.MaxArenaIDLen || h.Off < 0 || h.Len <= 0 || h.Len > math.MaxInt64-h.Off {
			return fmt.Errorf("%w: shm handle %q off %d len %d", ErrProtocol, h.ArenaID, h.Off, h.Len)
		}
	}
	if r := m.RDMA; r != nil {
		if r.Len == 0 || r.Addr+r.Len < r.Addr || r.Off > r.Len {
			return fmt.Errorf("%w: rdma region %#x+%d off %d", ErrProtocol, r.Addr, r.Len, r.Off)
		}
	}
	return nil
}
