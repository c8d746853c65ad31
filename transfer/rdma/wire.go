package rdma

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"time"
)

// WireVersion is the version of the QPInfo and MemInfo encodings. A decoder
// rejects any other version, so a change to either layout bumps it.
const WireVersion = 1

// Message kinds, the second byte of every encoding, so a MemInfo can never be
// decoded as a QPInfo or the other way round.
const (
	kindQPInfo  = 1
	kindMemInfo = 2
)

// Encoded sizes. Both encodings are fixed-size: version, kind, then the fields
// in declaration order, big-endian.
const (
	QPInfoSize  = 2 + 2 + 4 + 4 + 16 + 1 + 1 // 30
	MemInfoSize = 2 + 8 + 4 + 8              // 22
)

// maxQPN bounds queue pair numbers and packet sequence numbers: both are
// 24-bit on the wire.
const maxQPN = 1<<24 - 1

// QPInfo is what one side of an RC connection tells the other over the control
// channel so that the peer can move its queue pair to RTR: the address of the
// port (LID, and GID for routed or RoCE fabrics), the queue pair number, the
// first packet sequence number it will send, and its port's active MTU.
type QPInfo struct {
	V    uint8    // encoding version; zero means WireVersion when marshalling
	LID  uint16   // port LID; 0 on RoCE
	QPN  uint32   // queue pair number (24-bit)
	PSN  uint32   // initial send packet sequence number (24-bit)
	GID  [16]byte // port GID; all zero when GIDIndex is -1
	MTU  uint8    // active MTU as an ibv_mtu code (1 = 256 ... 5 = 4096)
	Port uint8    // port number, informational
}

// Validate reports whether q can be sent and acted upon.
func (q QPInfo) Validate() error {
	switch {
	case q.V != 0 && q.V != WireVersion:
		return fmt.Errorf("%w: qp info version %d, want %d", ErrBadMessage, q.V, WireVersion)
	case q.QPN == 0 || q.QPN > maxQPN:
		return fmt.Errorf("%w: qpn %#x not a 24-bit non-zero number", ErrBadMessage, q.QPN)
	case q.PSN > maxQPN:
		return fmt.Errorf("%w: psn %#x exceeds 24 bits", ErrBadMessage, q.PSN)
	case mtuBytes(q.MTU) == 0:
		return fmt.Errorf("%w: mtu code %d", ErrBadMessage, q.MTU)
	case q.Port == 0:
		return fmt.Errorf("%w: port 0", ErrBadMessage)
	case q.LID == 0 && q.GID == [16]byte{}:
		return fmt.Errorf("%w: neither lid nor gid set", ErrBadMessage)
	}
	return nil
}

// MarshalBinary encodes q in QPInfoSize bytes.
func (q QPInfo) MarshalBinary() ([]byte, error) {
	if err := q.Validate(); err != nil {
		return nil, err
	}
	b := make([]byte, QPInfoSize)
	b[0], b[1] = WireVersion, kindQPInfo
	binary.BigEndian.PutUint16(b[2:], q.LID)
	binary.BigEndian.PutUint32(b[4:], q.QPN)
	binary.BigEndian.PutUint32(b[8:], q.PSN)
	copy(b[12:28], q.GID[:])
	b[28], b[29] = q.MTU, q.Port
	return b, nil
}

// UnmarshalBinary decodes exactly QPInfoSize bytes into q. It leaves q
// untouched on error.
func (q *QPInfo) UnmarshalBinary(b []byte) error {
	if err := checkHeader(b, QPInfoSize, kindQPInfo); err != nil {
		return err
	}
	v := QPInfo{
		V:    b[0],
		LID:  binary.BigEndian.Uint16(b[2:]),
		QPN:  binary.BigEndian.Uint32(b[4:]),
		PSN:  binary.BigEndian.Uint32(b[8:]),
		MTU:  b[28],
		Port: b[29],
	}
	copy(v.GID[:], b[12:28])
	if err := v.Validate(); err != nil {
		return err
	}
	*q = v
	return nil
}

// MemInfo names a registered region a peer may read: its address in the
// owner's address space, the remote key of its registration and its length.
// It travels inside a transfer ticket.
type MemInfo struct {
	Addr uint64
	RKey uint32
	Len  uint64
}

// Validate reports whether m names a non-empty region that does not wrap.
func (m MemInfo) Validate() error {
	switch {
	case m.Len == 0:
		return fmt.Errorf("%w: empty region", ErrBadMessage)
	case m.Addr+m.Len < m.Addr:
		return fmt.Errorf("%w: region %#x+%d wraps", ErrBadMessage, m.Addr, m.Len)
	}
	return nil
}

// MarshalBinary encodes m in MemInfoSize bytes.
func (m MemInfo) MarshalBinary() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	b := make([]byte, MemInfoSize)
	b[0], b[1] = WireVersion, kindMemInfo
	binary.BigEndian.PutUint64(b[2:], m.Addr)
	binary.BigEndian.PutUint32(b[10:], m.RKey)
	binary.BigEndian.PutUint64(b[14:], m.Len)
	return b, nil
}

// UnmarshalBinary decodes exactly MemInfoSize bytes into m. It leaves m
// untouched on error.
func (m *MemInfo) UnmarshalBinary(b []byte) error {
	if err := checkHeader(b, MemInfoSize, kindMemInfo); err != nil {
		return err
	}
	v := MemInfo{
		Addr: binary.BigEndian.Uint64(b[2:]),
		RKey: binary.BigEndian.Uint32(b[10:]),
		Len:  binary.BigEndian.Uint64(b[14:]),
	}
	if err := v.Validate(); err != nil {
		return err
	}
	*m = v
	return nil
}

func checkHeader(b []byte, size int, kind byte) error {
	switch {
	case len(b) != size:
		return fmt.Errorf("%w: %d bytes, want %d", ErrBadMessage, len(b), size)
	case b[0] != WireVersion:
		return fmt.Errorf("%w: version %d, want %d", ErrBadMessage, b[0], WireVersion)
	case b[1] != kind:
		return fmt.Errorf("%w: kind %d, want %d", ErrBadMessage, b[1], kind)
	}
	return nil
}

// deadliner is implemented by net.Conn and libp2p streams.
type deadliner interface {
	SetDeadline(t time.Time) error
}

// Exchange sends local on rw and returns the QPInfo the peer sends, writing and
// reading concurrently so that two peers calling Exchange at once cannot
// deadlock on an unbuffered stream. When ctx ends, Exchange sets a deadline in
// the past on rw if rw has SetDeadline; otherwise the caller must close rw to
// unblock it.
func Exchange(ctx context.Context, rw io.ReadWriter, local QPInfo) (QPInfo, error) {
	out, err := local.MarshalBinary()
	if err != nil {
		return QPInfo{}, err
	}
	if d, ok := rw.(deadliner); ok {
		stop := context.AfterFunc(ctx, func() { _ = d.SetDeadline(time.Unix(1, 0)) })
		defer stop()
	}
	werr := make(chan error, 1)
	go func() {
		_, err := rw.Write(out)
		werr <- err
	}()
	in := make([]byte, QPInfoSize)
	_, rerr := io.ReadFull(rw, in)
	wrErr := <-werr
	if err := ctx.Err(); err != nil {
		return QPInfo{}, err
	}
	if wrErr != nil {
		return QPInfo{}, fmt.Errorf("rdma: send qp info: %w", wrErr)
	}
	if rerr != nil {
		return QPInfo{}, fmt.Errorf("rdma: receive qp info: %w", rerr)
	}
	var remote QPInfo
	if err := remote.UnmarshalBinary(in); err != nil {
		return QPInfo{}, err
	}
	return remote, nil
}
