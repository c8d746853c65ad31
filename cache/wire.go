package cache

import (
	"fmt"
	"math"

	"github.com/libp2p/go-libp2p/core/protocol"

	"github.com/latentmesh/latentmesh/transfer"
)

// ProtocolID is the libp2p protocol of store requests between agents.
const ProtocolID protocol.ID = "/latentmesh/store/1"

// WireVersion is the version of the store messages this build speaks.
const WireVersion = 1

// Request operations.
const (
	opStage = "stage" // copy Src onto this node as a staged copy of Object
	opDrop  = "drop"  // drop the copy Payload of Object (an aborted put)
)

// Bounds of variable-length fields, checked after decode.
const (
	maxPayloadIDLen = 64
	maxAddrs        = 32
	maxAddrLen      = 256
	maxNodeLen      = 128
	maxErrLen       = 1024
	maxRank         = 8 // transfer.MaxDims is smaller; any tensor rank fits
)

// request is one store control message: a length-prefixed msgpack frame on
// a fresh stream, answered by one response.
type request struct {
	V       int          `msgpack:"v"`
	Op      string       `msgpack:"op"`
	Object  string       `msgpack:"object"`
	Mode    Mode         `msgpack:"mode,omitempty"`
	Src     transfer.Ref `msgpack:"src"`
	Payload string       `msgpack:"payload,omitempty"`
}

// response answers a request: the new holder on success, else a code.
type response struct {
	V       int    `msgpack:"v"`
	Holder  Holder `msgpack:"holder"`
	ErrCode string `msgpack:"err_code,omitempty"`
	ErrMsg  string `msgpack:"err_msg,omitempty"`
}

// Validate checks the version and every bound of a decoded request.
func (m *request) Validate() error {
	if m.V != WireVersion {
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
		return validRef(m.Src)
	case opDrop:
		if m.Payload == "" || len(m.Payload) > maxPayloadIDLen {
			return fmt.Errorf("%w: payload id of %d bytes", ErrProtocol, len(m.Payload))
		}
		return nil
	}
	return fmt.Errorf("%w: op %q", ErrProtocol, m.Op)
}

// Validate checks the version and bounds of a decoded response.
func (m *response) Validate() error {
	if m.V != WireVersion {
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
