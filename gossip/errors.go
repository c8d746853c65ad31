package gossip

import "errors"

var (
	// ErrInvalidConfig reports a Config that fails validation in New.
	ErrInvalidConfig = errors.New("gossip: invalid config")
	// ErrInvalidKeyring reports a keyring file that cannot be read or is not
	// a non-empty JSON list of base64 AES keys.
	ErrInvalidKeyring = errors.New("gossip: invalid keyring")
	// ErrInvalidRecord reports a NodeRecord that cannot be registered.
	ErrInvalidRecord = errors.New("gossip: invalid node record")
	// ErrMetaTooLarge reports a NodeMeta whose encoding exceeds MetaMaxSize,
	// or meta bytes from the wire that are longer than that.
	ErrMetaTooLarge = errors.New("gossip: node meta too large")
	// ErrInvalidMeta reports node meta bytes that are not a valid NodeMeta.
	ErrInvalidMeta = errors.New("gossip: invalid node meta")
	// ErrDuplicateID reports that another live lease holds this node's record.
	ErrDuplicateID = errors.New("gossip: node id registered by another lease")
	// ErrNotStarted reports a call that needs Start to have succeeded.
	ErrNotStarted = errors.New("gossip: membership not started")
	// ErrStarted reports a second call to Start.
	ErrStarted = errors.New("gossip: membership already started")
	// ErrClosed reports a call on a closed Membership.
	ErrClosed = errors.New("gossip: membership closed")
)
