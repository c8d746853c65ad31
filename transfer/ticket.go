package transfer

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
)

// ticketVersion is the first byte of every ticket, so the layout can change
// without a verifier misreading an old one.
const ticketVersion = 1

// A ticket is opaque to consumers. Layout:
//
//	version(1) | expiry unix ns (8, big endian) | len(1) payload id | len(1) consumer peer id | HMAC-SHA256(32)
//
// The MAC covers everything before it and uses a per-process secret, so only
// the issuing producer can mint or verify tickets, and a restart voids them.
type ticket struct {
	payloadID string
	consumer  peer.ID
	expiry    time.Time
}

// ticketKey MACs and verifies tickets.
type ticketKey struct {
	secret [32]byte
}

func (k *ticketKey) mint(t ticket) []byte {
	b := make([]byte, 0, 1+8+1+len(t.payloadID)+1+len(t.consumer)+sha256.Size)
	b = append(b, ticketVersion)
	b = binary.BigEndian.AppendUint64(b, uint64(t.expiry.UnixNano()))
	b = append(b, byte(len(t.payloadID)))
	b = append(b, t.payloadID...)
	b = append(b, byte(len(t.consumer)))
	b = append(b, t.consumer...)
	m := hmac.New(sha256.New, k.secret[:])
	m.Write(b)
	return m.Sum(b)
}

// verify checks raw's MAC and returns its contents; the caller checks the
// payload, peer and expiry. A wire code is returned with every error.
func (k *ticketKey) verify(raw []byte) (ticket, string, error) {
	bad := func(why string) (ticket, string, error) {
		return ticket{}, CodeBadTicket, fmt.Errorf("%w: %s", ErrTicket, why)
	}
	if len(raw) < 1+8+1+1+sha256.Size || len(raw) > maxTicketLen {
		return bad("bad length")
	}
	body, mac := raw[:len(raw)-sha256.Size], raw[len(raw)-sha256.Size:]
	m := hmac.New(sha256.New, k.secret[:])
	m.Write(body)
	var sum [sha256.Size]byte
	if !hmac.Equal(m.Sum(sum[:0]), mac) {
		return bad("bad mac")
	}
	if body[0] != ticketVersion {
		return bad("unknown version")
	}
	exp := int64(binary.BigEndian.Uint64(body[1:9]))
	rest := body[9:]
	idLen := int(rest[0])
	rest = rest[1:]
	if len(rest) < idLen+1 {
		return bad("truncated")
	}
	id := string(rest[:idLen])
	rest = rest[idLen:]
	pLen := int(rest[0])
	rest = rest[1:]
	if len(rest) != pLen {
		return bad("truncated")
	}
	return ticket{payloadID: id, consumer: peer.ID(rest), expiry: time.Unix(0, exp)}, "", nil
}
