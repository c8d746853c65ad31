package cache

import (
	"fmt"
	"math"

	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/zeebo/xxh3"

	"github.com/latentmesh/latentmesh/transfer"
)

// ProtocolID is the libp2p protocol of store requests between agents.
const ProtocolID protocol.ID = "/latentmesh/store/1"

// Versions of the store messages. A message's V says which fields it may
// use, and a reader refuses a version it does not know (transfer.ErrVersion):
//
//	1: the first. A stage request names a payload for the holder to pull.
//	2: a stage request may carry the object's bytes (Data: an inline put).
//	3: a stage request may ask for its copy in flight (Early) and name
//	   sources to fall back on (Fallback); the wait op.
//	4: a stage request may carry a ticket for Src that its producer, the
//	   putter, issued to the holder (Issued).
//	5: a stage request in flight may defer its fill until asked
//	   (Deferred); the fill op.
//
// A request is sent at the lowest version its fields need, so a holder of a
// version-1 build still serves every request of a newer putter but an
// inline one. That one it refuses as a bad request (the version, or a frame
// over the 16 KiB MaxFrame of those builds), and the putter sends it again
// without Data, to be pulled (Store.stageOn); a version-2 holder refuses a
// chained stage request so, and gets it again as a plain one: a complete
// copy pulled from Src; a version-3 holder refuses an issued ticket so,
// and gets the request again without it; a version-4 holder refuses a
// deferred fill so, and gets the request again filling at once
// (Store.stageOn drops one field at a time). Responses have not changed
// since version 1 and are sent as version 1, which every build reads.
const (
	WireVersion     = deferredVersion // the newest version this build speaks
	baseVersion     = 1               // every response; every request without Data
	inlineVersion   = 2               // a stage request with Data
	chainVersion    = 3               // a stage request with Early or Fallback; a wait
	issuedVersion   = 4               // a stage request with Issued
	deferredVersion = 5               // a stage request with Deferred; a fill
)

// version is the lowest version whose fields req uses: what it is sent as.
func (m *request) version() int {
	switch {
	case m.Deferred || m.Op == opFill:
		return deferredVersion
	case len(m.Issued) > 0:
		return issuedVersion
	case m.Early || len(m.Fallback) > 0 || m.Op == opWait:
		return chainVersion
	case len(m.Data) > 0:
		return inlineVersion
	}
	return baseVersion
}

// Request operations.
const (
	opStage = "stage" // copy Src (or Data) onto this node as a staged copy of Object
	opDrop  = "drop"  // drop the copy Payload of Object (an aborted put)
	// opKeep asks whether the copy Payload of Object is still held, and
	// restarts its stage timeout while no record names it: a putter whose
	// commit waits (an etcd outage, a reclaimed task) keeps its copies so.
	opKeep = "keep"
	// opWait asks to be answered once the copy Payload of Object is
	// complete: at once for a copy staged whole, when its last chunk has
	// landed for one staged in flight (Early), and with an error when its
	// fill failed (the copy is gone then).
	opWait = "wait"
	// opFill is opWait for a copy staged Deferred: it starts the copy's
	// fill first (a copy already filling, or complete, is only waited for).
	opFill = "fill"
)

// Bounds of variable-length fields, checked after decode.
const (
	maxPayloadIDLen = 64
	maxAddrs        = 32
	maxAddrLen      = 256
	maxNodeLen      = 128
	maxErrLen       = 1024
	maxRank         = 8 // transfer.MaxDims is smaller; any tensor rank fits
	// maxFallback bounds a stage request's Fallback: the earlier holders
	// of a chain and the putter's source, at most R of them (R <= 8).
	maxFallback = 8
	// maxInline bounds a request's Data, whatever a Config allows: bulk
	// bytes belong on the data plane (striped, checked block by block, shm
	// or rdma where it can), and a holder reads a request's frame whole
	// before decoding it. Config.InlineMax is at most this.
	maxInline = 1 << 20
	// maxIssued bounds a stage request's Issued: a ticket response as
	// transfer.Service.Issue encodes it (a ticket, the payload's meta, its
	// data address and shm or rdma handle) takes a few hundred bytes.
	maxIssued = 2 << 10
	// requestRoom is what a request takes besides its Data: with every
	// field at its bound (an id, two producers' addresses, an issued
	// ticket) it encodes to under 12 KiB (TestRequestRoom). MaxFrame
	// holds InlineMax plus this.
	requestRoom = 16 << 10
)

// request is one store control message: a length-prefixed msgpack frame on
// a fresh stream, answered by one response. The reader's MaxFrame bounds
// the frame before any of it is allocated, Data included.
type request struct {
	V       int          `msgpack:"v"`
	Op      string       `msgpack:"op"`
	Object  string       `msgpack:"object"`
	Mode    Mode         `msgpack:"mode,omitempty"`
	Src     transfer.Ref `msgpack:"src"`
	Payload string       `msgpack:"payload,omitempty"`
	// Data, from version 2, is the object's bytes, sent with a stage
	// request when the object is small (Config.InlineMax): the holder
	// copies them instead of pulling Src, once they match Src's size and
	// XXH3 (checkInline). Src still names the putter's payload, so the
	// request can be sent again without Data to a holder that refuses it.
	Data []byte `msgpack:"data,omitempty"`
	// Early, from version 3, asks the holder to publish its copy in
	// flight (a memory copy the transfer service serves chunk by chunk as
	// it lands) and to answer as soon as it is published, filling it
	// afterwards; readers and the next holder of a chain pull its chunks
	// as they land. A holder without memory room for it refuses (full).
	Early bool `msgpack:"early,omitempty"`
	// Fallback, from version 3, are the sources to copy from, in order,
	// when Src fails: the earlier holders of a chain, then the putter's
	// payload.
	Fallback []transfer.Ref `msgpack:"fallback,omitempty"`
	// Issued, from version 4, is a ticket for Src that its producer (the
	// putter, Src being its own payload) issued to the holder
	// (transfer.Service.Issue): the holder's pull of Src uses it instead
	// of asking for one, so the stage request stands in for the ticket
	// round trip. The transfer service checks it as any ticket, and pulls
	// as usual when it does not fit.
	Issued []byte `msgpack:"issued,omitempty"`
	// Deferred, from version 5, with Early, asks the holder to publish its
	// copy in flight at once but to start filling it only when the putter
	// asks (opFill), or after half its fill's time if no one does: the
	// putter of a FirstCopy put starts the second copy of its chain once
	// it knows the first is whole, so that copy shares no core with the
	// put (chain.go).
	Deferred bool `msgpack:"deferred,omitempty"`
}

// response answers a request: the new holder on success, else a code.
type response struct {
	V       int    `msgpack:"v"`
	Holder  Holder `msgpack:"holder"`
	ErrCode string `msgpack:"err_code,omitempty"`
	ErrMsg  string `msgpack:"err_msg,omitempty"`
}

// Validate checks the version and every bound of a decoded request. It
// does not hash Data: checkInline does, where a mismatch is answered as
// such rather than as a malformed request.
func (m *request) Validate() error {
	if m.V < baseVersion || m.V > WireVersion {
		return fmt.Errorf("%w: request v%d", transfer.ErrVersion, m.V)
	}
	if !ValidID(m.Object) {
		return fmt.Errorf("%w: object id of %d bytes", ErrProtocol, len(m.Object))
	}
	switch m.Op {
	case opStage:
		if !m.Mode.Valid() {
			return fmt.Errorf("%w: mode %q", ErrProtocol, m.Mode)
		}
		if err := validRef(m.Src); err != nil {
			return err
		}
		if err := m.validChain(); err != nil {
			return err
		}
		if err := m.validIssued(); err != nil {
			return err
		}
		if m.Deferred && (!m.Early || m.V < deferredVersion) {
			return fmt.Errorf("%w: a deferred fill not in flight, or in a v%d request", ErrProtocol, m.V)
		}
		return m.validInline()
	case opDrop, opKeep, opWait, opFill:
		if m.Payload == "" || len(m.Payload) > maxPayloadIDLen {
			return fmt.Errorf("%w: payload id of %d bytes", ErrProtocol, len(m.Payload))
		}
		if len(m.Data) > 0 || m.Early || len(m.Fallback) > 0 || len(m.Issued) > 0 || m.Deferred {
			return fmt.Errorf("%w: a %s with data, chain fields or a ticket", ErrProtocol, m.Op)
		}
		if m.V < m.version() {
			return fmt.Errorf("%w: a %s in a v%d request", ErrProtocol, m.Op, m.V)
		}
		return nil
	}
	return fmt.Errorf("%w: op %q", ErrProtocol, m.Op)
}

// validChain bounds a stage request's chain fields: a version that has
// them, at most maxFallback fallbacks, each a valid ref of Src's size, and
// no inline Data beside them (a small object goes to every holder inline).
func (m *request) validChain() error {
	if !m.Early && len(m.Fallback) == 0 {
		return nil
	}
	switch {
	case m.V < chainVersion:
		return fmt.Errorf("%w: chain fields in a v%d request", ErrProtocol, m.V)
	case len(m.Fallback) > maxFallback:
		return fmt.Errorf("%w: %d fallbacks, at most %d", ErrProtocol, len(m.Fallback), maxFallback)
	case len(m.Data) > 0:
		return fmt.Errorf("%w: a chained stage with inline data", ErrProtocol)
	}
	for _, r := range m.Fallback {
		if err := validRef(r); err != nil {
			return err
		}
		if r.Meta.Bytes() != m.Src.Meta.Bytes() || r.Meta.Chunks() != m.Src.Meta.Chunks() {
			return fmt.Errorf("%w: a fallback of another size than its source", ErrProtocol)
		}
	}
	return nil
}

// validIssued bounds a stage request's Issued: a version that has it, at
// most maxIssued bytes, and no inline Data beside it (nothing to pull).
func (m *request) validIssued() error {
	switch n := len(m.Issued); {
	case n == 0:
		return nil
	case m.V < issuedVersion:
		return fmt.Errorf("%w: an issued ticket in a v%d request", ErrProtocol, m.V)
	case n > maxIssued:
		return fmt.Errorf("%w: an issued ticket of %d bytes, at most %d", ErrProtocol, n, maxIssued)
	case len(m.Data) > 0:
		return fmt.Errorf("%w: an issued ticket with inline data", ErrProtocol)
	}
	return nil
}

// validInline bounds a stage request's Data: a version that has it, at
// most maxInline bytes, exactly Src's size, and a checksum to match.
func (m *request) validInline() error {
	n := len(m.Data)
	switch {
	case n == 0:
		return nil
	case m.V < inlineVersion:
		return fmt.Errorf("%w: data in a v%d request", ErrProtocol, m.V)
	case n > maxInline:
		return fmt.Errorf("%w: %d bytes of data, at most %d", ErrProtocol, n, maxInline)
	case int64(n) != m.Src.Meta.Bytes():
		return fmt.Errorf("%w: %d bytes of data for a %d-byte object", ErrProtocol, n, m.Src.Meta.Bytes())
	case m.Src.Checksum == 0:
		return fmt.Errorf("%w: data without a checksum", ErrProtocol)
	}
	return nil
}

// checkInline verifies a validated request's Data against the XXH3 its Src
// declares, the checksum the copy is published with and the object's record
// will carry. A request without Data passes: its pull checks what it copies.
func (m *request) checkInline() error {
	if len(m.Data) == 0 {
		return nil
	}
	if got := xxh3.Hash(m.Data); got != m.Src.Checksum {
		return fmt.Errorf("%w: inline copy of %s has xxh3 %x, its request says %x", transfer.ErrCorrupt, m.Object, got, m.Src.Checksum)
	}
	return nil
}

// Validate checks the version and bounds of a decoded response.
func (m *response) Validate() error {
	if m.V != baseVersion {
		return fmt.Errorf("%w: response v%d", transfer.ErrVersion, m.V)
	}
	if len(m.ErrCode) > maxErrLen || len(m.ErrMsg) > maxErrLen {
		return fmt.Errorf("%w: error text too long", ErrProtocol)
	}
	if m.ErrCode != "" || m.Holder.Node == "" {
		return nil // a drop's answer carries no holder
	}
	if len(m.Holder.Node) > maxNodeLen || (m.Holder.Tier != Memory && m.Holder.Tier != Disk) {
		return fmt.Errorf("%w: holder %q tier %q", ErrProtocol, m.Holder.Node, m.Holder.Tier)
	}
	return validRef(m.Holder.Ref)
}

// validRef bounds a transfer reference from the wire.
func validRef(r transfer.Ref) error {
	if r.ID == "" || len(r.ID) > maxPayloadIDLen {
		return fmt.Errorf("%w: payload id of %d bytes", ErrProtocol, len(r.ID))
	}
	p := r.Producer
	if len(p.PeerID) == 0 || len(p.PeerID) > maxAddrLen || len(p.DataAddr) > maxAddrLen ||
		len(p.Host) > maxAddrLen || len(p.ShmSocket) > maxAddrLen || len(p.P2PAddrs) > maxAddrs {
		return fmt.Errorf("%w: producer fields too long", ErrProtocol)
	}
	for _, a := range p.P2PAddrs {
		if len(a) > maxAddrLen {
			return fmt.Errorf("%w: address of %d bytes", ErrProtocol, len(a))
		}
	}
	if len(r.Meta.Shape) > maxRank {
		return fmt.Errorf("%w: rank %d", ErrProtocol, len(r.Meta.Shape))
	}
	return r.Meta.Validate(math.MaxInt64)
}
