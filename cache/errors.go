package cache

import "errors"

// Sentinel errors of the Store.
var (
	// ErrNotFound means no record names the object (never put, consumed,
	// expired or collected), or no holder still has it.
	ErrNotFound = errors.New("cache: object not found")
	// ErrFull means no member has room for the object, in memory or on disk.
	ErrFull = errors.New("cache: store full")
	// ErrClosed is returned by calls on a closed Store.
	ErrClosed = errors.New("cache: store closed")
	// ErrProtocol means a peer sent a malformed control message, or
	// refused ours as one (code bad_request).
	ErrProtocol = errors.New("cache: protocol violation")
	// ErrDenied means a control request came from a peer that is not a
	// registered member of the mesh.
	ErrDenied = errors.New("cache: request from a non-member")
)

// Wire error codes of the store protocol: stable strings.
const (
	codeFull     = "full"
	codeBad      = "bad_request"
	codeDenied   = "denied"
	codeFailed   = "failed"
	codeClosed   = "closed"
	codeNotFound = "not_found"
	codeCorrupt  = "corrupt" // inline data that does not match its checksum
)
