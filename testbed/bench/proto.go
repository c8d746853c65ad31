package bench

import (
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// protoVersion is the version of the consumer-producer pipe protocol. Both
// ends are the same binary in practice; the check catches a stale
// --producer command.
const protoVersion = 2

// maxLine bounds one protocol line; refs and requests are far smaller.
const maxLine = 1 << 20

// Producer requests, the values of request.Op.
const (
	opStart   = "start"   // first request: start the service (ArenaBytes)
	opPublish = "publish" // publish Size bytes in Chunks chunks, all ready
	opLatent  = "latent"  // Begin a video latent and write a frame every Interval
	opRelease = "release" // forget payload ID (and its raw-TCP copy)
	opQuit    = "quit"    // exit
)

// hello answers opStart: where to reach the producer.
type hello struct {
	V        int      `json:"v"`
	PeerID   string   `json:"peer_id"`
	P2PAddrs []string `json:"p2p_addrs"`
	DataAddr string   `json:"data_addr"`
	RawAddr  string   `json:"raw_addr"` // the raw-TCP baseline server
	// RawTunedAddr serves the same bytes with the start request's
	// congestion control; empty when that is the system default.
	RawTunedAddr string `json:"raw_tuned_addr,omitempty"`
}

// request is one consumer command, one JSON line on the producer's stdin.
type request struct {
	Op     string `json:"op"`
	Size   int64  `json:"size,omitempty"`
	Chunks int    `json:"chunks,omitempty"`
	// Frames, Width, Height and Interval describe a latent (opLatent).
	Frames   int           `json:"frames,omitempty"`
	Width    int           `json:"width,omitempty"`
	Height   int           `json:"height,omitempty"`
	Interval time.Duration `json:"interval,omitempty"`
	ID       string        `json:"id,omitempty"`
	// ArenaBytes sizes the producer's arena (opStart); 0 keeps payloads on
	// the heap, which rules out shm.
	ArenaBytes int64 `json:"arena_bytes,omitempty"`
	// TCPCongestion is the producer's transfer.Config.TCPCongestion
	// (opStart), and that of the tuned raw-TCP baseline; empty keeps the
	// system default for both.
	TCPCongestion string `json:"tcp_congestion"`
}

// response answers one request, one JSON line on the producer's stdout.
type response struct {
	Ref transfer.Ref `json:"ref"`
	// RawKey names the same bytes on the raw-TCP baseline server (opPublish
	// of an unchunked payload only).
	RawKey uint64 `json:"raw_key,omitempty"`
	Err    string `json:"error,omitempty"`
}
