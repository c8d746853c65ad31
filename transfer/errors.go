package transfer

import (
	"errors"
	"fmt"
)

var (
	// ErrBadMeta is returned (wrapped) for a TensorMeta that cannot describe a payload.
	ErrBadMeta = errors.New("transfer: bad tensor meta")
	// ErrNotFound means the producer does not hold the payload (never
	// published, released, or the producer restarted). Retrying the same
	// producer will not help; look for another copy.
	ErrNotFound = errors.New("transfer: payload not found")
	// ErrUnreachable wraps dial and stream failures towards a producer; they
	// may be transient.
	ErrUnreachable = errors.New("transfer: producer unreachable")
	// ErrCorrupt means the received bytes failed their checksum, or the
	// connection closed or reset before they had all arrived.
	ErrCorrupt = errors.New("transfer: payload corrupt")
	// ErrTicket means the producer rejected a ticket: forged, tampered, or
	// presented by a peer it was not issued to.
	ErrTicket = errors.New("transfer: ticket rejected")
	// ErrTicketExpired means the ticket was valid but is past its expiry.
	ErrTicketExpired = errors.New("transfer: ticket expired")
	// ErrRange means a requested byte range lies outside the payload.
	ErrRange = errors.New("transfer: range out of bounds")
	// ErrFrameTooLarge means a frame's length prefix exceeds the reader's bound.
	ErrFrameTooLarge = errors.New("transfer: frame too large")
	// ErrVersion means a message carries a version this build does not speak.
	ErrVersion = errors.New("transfer: unsupported version")
	// ErrProtocol means the peer sent something malformed.
	ErrProtocol = errors.New("transfer: protocol violation")
	// ErrClosed is returned by calls on a closed Service.
	ErrClosed = errors.New("transfer: service closed")
	// ErrTransport means the configured transport cannot reach the
	// producer (a forced shm towards another host, a forced rdma without a
	// device, a payload the producer holds outside its arena).
	ErrTransport = errors.New("transfer: transport unavailable")
	// ErrDenied means the producer refused this peer: it is not admitted
	// (not a registered member of the mesh), or not authorized for the
	// payload it asked for. Retrying will not help until that changes.
	ErrDenied = errors.New("transfer: peer denied")
	// ErrBusy means the producer refused a data-plane connection because
	// it serves as many as it allows (in all, or from this peer); it may be
	// transient.
	ErrBusy = errors.New("transfer: producer busy")
	// ErrBufferSize means a destination slice does not match the payload size.
	ErrBufferSize = errors.New("transfer: destination size mismatch")
)

// Wire error codes. They cross the network, so they are stable strings: add
// new ones, never rename.
const (
	CodeNotFound      = "not_found"
	CodeBadTicket     = "bad_ticket"
	CodeExpired       = "expired"
	CodeWrongPeer     = "wrong_peer"
	CodeRange         = "range"
	CodeBadRequest    = "bad_request"
	CodeVersion       = "version"
	CodeShuttingDown  = "shutting_down"
	CodeUnauthorized  = "unauthenticated"
	CodeInternalError = "internal"
	CodeDenied        = "denied"
	CodeBusy          = "busy"
)

// codeErrs maps a wire code to the sentinel a caller tests with errors.Is.
var codeErrs = map[string]error{
	CodeNotFound:     ErrNotFound,
	CodeBadTicket:    ErrTicket,
	CodeWrongPeer:    ErrTicket,
	CodeUnauthorized: ErrTicket,
	CodeExpired:      ErrTicketExpired,
	CodeRange:        ErrRange,
	CodeBadRequest:   ErrProtocol,
	CodeVersion:      ErrVersion,
	CodeShuttingDown: ErrUnreachable,
	CodeDenied:       ErrDenied,
	CodeBusy:         ErrBusy,
}

// RemoteError is an error reported by the other end of a transfer, carrying
// its stable wire code. errors.Is matches it against the sentinel for the code.
type RemoteError struct {
	Code string
	Msg  string
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("transfer: remote error %s: %s", e.Code, e.Msg)
}

// Unwrap returns the sentinel error for the code, or nil for unknown codes.
func (e *RemoteError) Unwrap() error { return codeErrs[e.Code] }
