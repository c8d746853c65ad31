package transfer

import (
	"encoding/binary"
	"fmt"
	"io"
)

// The data plane speaks a small fixed binary protocol over raw TCP so payload
// bytes go from the producer's buffer to the consumer's destination slice
// with no encoding in between. Every variable field has a length prefix that
// is checked against a fixed bound before it is read.
//
//	producer -> consumer  hello:    "LMTD" | version(1) | nonce(32),
//	                      or, at its connection cap, statusErr (below) and close

//	consumer -> producer  auth:     version(1) | len(1) peer id | len(2) public key | len(2) signature
//	producer -> consumer  status:   statusOK, or an error (below) and close: the
//	                      peer is not admitted (denied) or holds too many
//	                      connections (busy)
//	then, repeatedly:
//	consumer -> producer  request:  version(1) | offset(8) | length(8) | len(2) ticket
//	producer -> consumer  statusWait (heartbeat while chunks are not yet written), any number
//	                      then statusOK | block(4) | count(4) | count x checksum(8) | length bytes of payload,
//	                      or statusErr | len(1) code | len(2) message, then close.
//
// The checksums are the XXH3-64 of each block-sized piece of the range (the
// last may be shorter), so the consumer verifies each as it lands; count is 0
// when the range does not line up with the producer's blocks.
const (
	dataVersion = 2

	// Bounds on the checksum block size a consumer accepts.
	minSumBlock = 4 << 10
	maxSumBlock = 64 << 20

	statusOK   = 0
	statusErr  = 1
	statusWait = 2

	nonceLen  = 32
	maxPubKey = 1024
	maxSig    = 1024

	// authDomain separates data-plane handshake signatures from any other
	// use of the peer's key.
	authDomain = "latentmesh/transfer/data/1\x00"
)

var helloMagic = [4]byte{'L', 'M', 'T', 'D'}

// authMsg is the consumer's proof of identity for one connection.
type authMsg struct {
	PeerID []byte
	PubKey []byte
	Sig    []byte
}

func writeHello(w io.Writer, nonce *[nonceLen]byte) error {
	var b [4 + 1 + nonceLen]byte
	copy(b[:4], helloMagic[:])
	b[4] = dataVersion
	copy(b[5:], nonce[:])
	_, err := w.Write(b[:])
	return err
}

func readHello(r io.Reader, nonce *[nonceLen]byte) error {
	var b [4 + 1 + nonceLen]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return err
	}
	if [4]byte(b[:4]) != helloMagic {
		return fmt.Errorf("%w: bad hello magic", ErrProtocol)
	}
	if b[4] != dataVersion {
		return fmt.Errorf("%w: data plane v%d", ErrVersion, b[4])
	}
	copy(nonce[:], b[5:])
	return nil
}

// authPayload is what the consumer signs: the nonce binds the signature to one
// connection, the producer id stops a producer relaying it to another.
func authPayload(nonce *[nonceLen]byte, producer, consumer []byte) []byte {
	b := make([]byte, 0, len(authDomain)+nonceLen+2+len(producer)+len(consumer))
	b = append(b, authDomain...)
	b = append(b, nonce[:]...)
	b = append(b, byte(len(producer)))
	b = append(b, producer...)
	b = append(b, byte(len(consumer)))
	return append(b, consumer...)
}

func writeAuth(w io.Writer, m authMsg) error {
	if len(m.PeerID) > maxPeerIDLen || len(m.PubKey) > maxPubKey || len(m.Sig) > maxSig {
		return fmt.Errorf("%w: auth field too long", ErrProtocol)
	}
	b := make([]byte, 0, 6+len(m.PeerID)+len(m.PubKey)+len(m.Sig))
	b = append(b, dataVersion, byte(len(m.PeerID)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(m.PubKey)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(m.Sig)))
	b = append(b, m.PeerID...)
	b = append(b, m.PubKey...)
	b = append(b, m.Sig...)
	_, err := w.Write(b)
	return err
}

func readAuth(r io.Reader) (authMsg, error) {
	var h [6]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return authMsg{}, err
	}
	if h[0] != dataVersion {
		return authMsg{}, fmt.Errorf("%w: auth v%d", ErrVersion, h[0])
	}
	pl, kl, sl := int(h[1]), int(binary.BigEndian.Uint16(h[2:])), int(binary.BigEndian.Uint16(h[4:]))
	if pl == 0 || pl > maxPeerIDLen || kl == 0 || kl > maxPubKey || sl == 0 || sl > maxSig {
		return authMsg{}, fmt.Errorf("%w: auth lengths %d/%d/%d", ErrProtocol, pl, kl, sl)
	}
	b := make([]byte, pl+kl+sl)
	if _, err := io.ReadFull(r, b); err != nil {
		return authMsg{}, unexpected(err)
	}
	return authMsg{PeerID: b[:pl], PubKey: b[pl : pl+kl], Sig: b[pl+kl:]}, nil
}

// request asks for length bytes at offset of the payload named in ticket.
type request struct {
	Offset uint64
	Length uint64
	Ticket []byte
}

const requestHeaderLen = 1 + 8 + 8 + 2

func appendRequest(b []byte, q request) []byte {
	b = append(b, dataVersion)
	b = binary.BigEndian.AppendUint64(b, q.Offset)
	b = binary.BigEndian.AppendUint64(b, q.Length)
	b = binary.BigEndian.AppendUint16(b, uint16(len(q.Ticket)))
	return append(b, q.Ticket...)
}

// reqBuf is a connection's reusable space for reading requests, so a request
// costs no allocation on the producer.
type reqBuf struct {
	hdr    [requestHeaderLen]byte
	ticket [maxTicketLen]byte
}

// readRequest reads one request; q.Ticket aliases rb and is valid until the
// next call.
func readRequest(r io.Reader, rb *reqBuf) (request, error) {
	if _, err := io.ReadFull(r, rb.hdr[:]); err != nil {
		return request{}, err
	}
	if rb.hdr[0] != dataVersion {
		return request{}, fmt.Errorf("%w: request v%d", ErrVersion, rb.hdr[0])
	}
	q := request{
		Offset: binary.BigEndian.Uint64(rb.hdr[1:9]),
		Length: binary.BigEndian.Uint64(rb.hdr[9:17]),
	}
	tl := int(binary.BigEndian.Uint16(rb.hdr[17:19]))
	if tl == 0 || tl > maxTicketLen {
		return request{}, fmt.Errorf("%w: ticket of %d bytes", ErrProtocol, tl)
	}
	if _, err := io.ReadFull(r, rb.ticket[:tl]); err != nil {
		return request{}, unexpected(err)
	}
	q.Ticket = rb.ticket[:tl]
	return q, nil
}

func writeErrStatus(w io.Writer, code, msg string) error {
	if len(code) > 255 {
		code = code[:255]
	}
	if len(msg) > maxErrMsgLen {
		msg = msg[:maxErrMsgLen]
	}
	b := make([]byte, 0, 4+len(code)+len(msg))
	b = append(b, statusErr, byte(len(code)))
	b = append(b, code...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(msg)))
	b = append(b, msg...)
	_, err := w.Write(b)
	return err
}

// readErrStatus reads the rest of an error status whose statusErr byte has
// been consumed.
func readErrStatus(r io.Reader) error {
	var cl [1]byte
	if _, err := io.ReadFull(r, cl[:]); err != nil {
		return unexpected(err)
	}
	var buf [255 + 2 + maxErrMsgLen]byte
	code := buf[:cl[0]]
	if _, err := io.ReadFull(r, code); err != nil {
		return unexpected(err)
	}
	var ml [2]byte
	if _, err := io.ReadFull(r, ml[:]); err != nil {
		return unexpected(err)
	}
	n := int(binary.BigEndian.Uint16(ml[:]))
	if n > maxErrMsgLen {
		return fmt.Errorf("%w: error message of %d bytes", ErrProtocol, n)
	}
	msg := buf[255+2 : 255+2+n]
	if _, err := io.ReadFull(r, msg); err != nil {
		return unexpected(err)
	}
	return &RemoteError{Code: string(code), Msg: string(msg)}
}

// unexpected turns a clean EOF in the middle of a message into ErrUnexpectedEOF.
func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
