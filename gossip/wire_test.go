package gossip

import (
	"bytes"
	"compress/lzw"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"
)

// memberlist's wire format, written out by hand so each hostile frame in
// hostile_test.go reads byte for byte. From memberlist v0.7.0 net.go and
// label.go:
//
//	stream (TCP): [label header] msgType msgpack...
//	packet (UDP): [label header] ([encryption] | msgType msgpack...)
//	label header: 244, len(label), label   (only when a label is set)
//
// A pushPullMsg stream carries a pushPullHeader {Nodes, UserStateLen, Join},
// then Nodes pushNodeState maps, then UserStateLen raw bytes. A userMsg
// stream carries a userMsgHeader {UserMsgLen}, then that many bytes. A
// compressMsg carries a compress {Algo, Buf}; Buf is LZW (LSB order, 8-bit
// literals) of another message, type byte first. Structs are msgpack maps
// keyed by field name.
const (
	wireAlive    = 4
	wireDead     = 5
	wirePushPull = 6
	wireCompound = 7
	wireUser     = 8
	wireCompress = 9
	wireHasCRC   = 12
	wireLabel    = 244
)

// mp appends msgpack values.
type mp []byte

func (b mp) fixmap(n int) mp { return append(b, 0x80|byte(n)) }

func (b mp) str(s string) mp {
	if len(s) < 32 {
		b = append(b, 0xa0|byte(len(s)))
	} else {
		b = append(b, 0xd9, byte(len(s)))
	}
	return append(b, s...)
}

// int writes v in the shortest form for small values and as int64 otherwise.
func (b mp) int(v int64) mp {
	if v >= -32 && v < 128 {
		return append(b, byte(v)) // positive or negative fixint
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func (b mp) uint32(v uint32) mp { return binary.BigEndian.AppendUint32(append(b, 0xce), v) }

func (b mp) uint16(v uint16) mp { return binary.BigEndian.AppendUint16(append(b, 0xcd), v) }

func (b mp) bool(v bool) mp {
	if v {
		return append(b, 0xc3)
	}
	return append(b, 0xc2)
}

func (b mp) bin(p []byte) mp {
	b = binary.BigEndian.AppendUint32(append(b, 0xc6), uint32(len(p)))
	return append(b, p...)
}

// labeled prefixes msg with memberlist's label header when label is set.
func labeled(label string, msg []byte) []byte {
	if label == "" {
		return msg
	}
	return append(append([]byte{wireLabel, byte(len(label))}, label...), msg...)
}

// pushPullHeader is the 29-byte (unlabeled) frame that declares nodes node
// states and no user state.
func pushPullHeader(nodes int64) []byte {
	return mp{wirePushPull}.fixmap(3).
		str("Nodes").int(nodes).
		str("UserStateLen").int(0).
		str("Join").bool(false)
}

// userMsgHeader is the 22-byte frame that declares a user message of n bytes.
func userMsgHeader(n int64) []byte {
	return mp{wireUser}.fixmap(1).str("UserMsgLen").int(n)
}

// aliveMsg claims that node is alive at addr with meta and incarnation.
func aliveMsg(node string, addr *net.UDPAddr, incarnation uint32, meta []byte) []byte {
	return mp{wireAlive}.fixmap(6).
		str("Incarnation").uint32(incarnation).
		str("Node").str(node).
		str("Addr").bin(addr.IP.To4()).
		str("Port").uint16(uint16(addr.Port)).
		str("Meta").bin(meta).
		str("Vsn").bin([]byte{1, 5, 2, 0, 0, 0})
}

// deadMsg claims that from saw node die at incarnation.
func deadMsg(node, from string, incarnation uint32) []byte {
	return mp{wireDead}.fixmap(3).
		str("Incarnation").uint32(incarnation).
		str("Node").str(node).
		str("From").str(from)
}

// compressed wraps an LZW stream as a compressMsg.
func compressed(lzw []byte) []byte {
	return mp{wireCompress}.fixmap(2).str("Algo").int(0).str("Buf").bin(lzw)
}

// lzwZeros is an LZW stream (LSB, 8-bit literals, as memberlist decodes it)
// of about 1340 zero bytes per byte of stream, cycles times over: after each
// clear code it sends literal 0, then codes 258, 259, ... 4095, each the
// previous string plus one more zero, which is how the decoder grows its
// table. It is built directly rather than by compressing gigabytes.
func lzwZeros(cycles int) []byte {
	const clear, eof, maxWidth = 256, 257, 12
	var out []byte
	var acc uint64
	var nbits uint
	put := func(code, width uint) {
		acc |= uint64(code) << nbits
		nbits += width
		for nbits >= 8 {
			out = append(out, byte(acc))
			acc >>= 8
			nbits -= 8
		}
	}
	width := uint(9)
	for range cycles {
		put(clear, width)
		width = 9
		hi := uint(eof)
		// Mirror the decoder: after each code hi grows by one, and the
		// width grows when hi reaches 1<<width, up to 12 bits.
		for code := uint(0); ; {
			put(code, width)
			hi++
			if hi >= 1<<width {
				if width == maxWidth {
					break // table full: the next code must be a clear
				}
				width++
			}
			if code == 0 {
				code = eof + 1
			} else {
				code++
			}
		}
	}
	put(eof, width)
	if nbits > 0 {
		out = append(out, byte(acc))
	}
	return out
}

// sendStream writes frame to a fresh TCP connection to addr and closes it.
func sendStream(t *testing.T, addr string, frame []byte) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write(frame); err != nil {
		t.Logf("write to %s: %v", addr, err) // the node may hang up early
	}
}

// sendPacket sends frame as one UDP datagram to addr.
func sendPacket(t *testing.T, addr string, frame []byte) {
	t.Helper()
	c, err := net.Dial("udp", addr)
	if err != nil {
		t.Fatalf("dial udp %s: %v", addr, err)
	}
	defer c.Close()
	if _, err := c.Write(frame); err != nil {
		t.Fatalf("send udp to %s: %v", addr, err)
	}
}

func TestWireFramesAsFiled(t *testing.T) {
	// The sizes the issue reports, unlabeled.
	if n := len(pushPullHeader(-1)); n != 29 {
		t.Errorf("push/pull header is %d bytes, want 29", n)
	}
	if n := len(userMsgHeader(1 << 40)); n != 22 {
		t.Errorf("user message header is %d bytes, want 22", n)
	}
}

func TestLZWZerosDecodes(t *testing.T) {
	r := lzw.NewReader(bytes.NewReader(lzwZeros(2)), lzw.LSB, 8)
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	const perCycle = 7370880 // 1 + 2 + 3 + ... + 3839
	if len(b) != 2*perCycle || bytes.IndexFunc(b, func(r rune) bool { return r != 0 }) >= 0 {
		t.Fatalf("decoded %d bytes, want %d zeros", len(b), 2*perCycle)
	}
	t.Logf("%d cycles: %d bytes of stream", 2, len(lzwZeros(2)))
}
