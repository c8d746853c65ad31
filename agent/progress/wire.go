package progress

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
)

// ProtocolID is the libp2p protocol of progress questions between agents.
const ProtocolID = "/latentmesh/progress/1"

// wireVersion is the version of the messages below; a reader refuses any
// other (transfer.ErrVersion), and a new field means a new version.
const wireVersion = 1

// Bounds of the protocol, checked before anything waits or is allocated.
const (
	maxFrame    = 512 // a request is a job id and two integers
	maxJobLen   = 128
	maxStageLen = 32
	// MaxWait bounds how long one question may be held open; a follower
	// asks again.
	MaxWait = 2 * time.Second
	// maxWaiters bounds the questions held open at once on one node,
	// whoever asks: past it a question is answered at once, as if its
	// wait had run out.
	maxWaiters = 1024
	// ioTimeout bounds the reads and writes around a question's wait.
	ioTimeout = 2 * time.Second
)

// request asks for the job's step once it passes After, waiting at most
// WaitMs for that.
type request struct {
	V      int    `msgpack:"v"`
	Job    string `msgpack:"job"`
	Run    int64  `msgpack:"run,omitempty"` // the run After counts in (Cursor)
	After  int    `msgpack:"after"`
	WaitMs int    `msgpack:"wait_ms,omitempty"`
}

// Validate implements transfer's message check.
func (r *request) Validate() error {
	switch {
	case r.V != wireVersion:
		return fmt.Errorf("%w: progress request version %d", transfer.ErrVersion, r.V)
	case r.Job == "" || len(r.Job) > maxJobLen:
		return fmt.Errorf("%w: job id of %d bytes", transfer.ErrProtocol, len(r.Job))
	case r.After < -1 || r.Run < 0:
		return fmt.Errorf("%w: after step %d of run %d", transfer.ErrProtocol, r.After, r.Run)
	case r.WaitMs < 0 || time.Duration(r.WaitMs)*time.Millisecond > MaxWait:
		return fmt.Errorf("%w: wait of %d ms (at most %v)", transfer.ErrProtocol, r.WaitMs, MaxWait)
	}
	return nil
}

// response is the step as the node has it; Running false when nothing past
// the request's After will come from there: no stage of the job runs there
// (it never did, or it ended at or before After).
type response struct {
	V       int    `msgpack:"v"`
	Running bool   `msgpack:"running,omitempty"`
	Stage   string `msgpack:"stage,omitempty"`
	Step    int    `msgpack:"step,omitempty"`
	Total   int    `msgpack:"total,omitempty"`
	AtNanos int64  `msgpack:"at,omitempty"` // Unix nanoseconds; 0 before the first step
	Run     int64  `msgpack:"run,omitempty"`
	Denied  bool   `msgpack:"denied,omitempty"`
}

// Validate implements transfer's message check.
func (r *response) Validate() error {
	switch {
	case r.V != wireVersion:
		return fmt.Errorf("%w: progress response version %d", transfer.ErrVersion, r.V)
	case len(r.Stage) > maxStageLen:
		return fmt.Errorf("%w: stage of %d bytes", transfer.ErrProtocol, len(r.Stage))
	case r.Step < 0 || r.Total < 0 || r.Run < 0:
		return fmt.Errorf("%w: step %d of %d", transfer.ErrProtocol, r.Step, r.Total)
	}
	return nil
}

// ErrDenied is the answer of a node that does not take the asker for a
// member of its mesh.
var ErrDenied = errors.New("progress: not a registered member of this mesh")

// Server answers progress questions about one Board.
type Server struct {
	h       host.Host
	board   *Board
	allow   func(peer.ID) bool
	log     *zap.Logger
	waiters chan struct{} // a slot per question held open
	ctx     context.Context
	cancel  context.CancelFunc
}

// Serve answers, on h, questions from the peers allow admits about board's
// stages, until Close.
func Serve(h host.Host, board *Board, allow func(peer.ID) bool, log *zap.Logger) *Server {
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{h: h, board: board, allow: allow, log: log.Named("progress"),
		waiters: make(chan struct{}, maxWaiters), ctx: ctx, cancel: cancel}
	h.SetStreamHandler(ProtocolID, s.handle)
	return s
}

// Close stops serving and answers the questions held open.
func (s *Server) Close() {
	s.h.RemoveStreamHandler(ProtocolID)
	s.cancel()
}

func (s *Server) handle(str network.Stream) {
	defer str.Close()
	str.SetDeadline(time.Now().Add(ioTimeout))
	remote := str.Conn().RemotePeer()
	if !s.allow(remote) {
		s.log.Debug("progress question from a non-member", zap.Stringer("peer", remote))
		transfer.WriteFrame(str, &response{V: wireVersion, Denied: true})
		return
	}
	var req request
	if err := transfer.ReadFrame(str, maxFrame, &req); err != nil {
		s.log.Debug("bad progress question", zap.Stringer("peer", remote), zap.Error(err))
		str.Reset()
		return
	}
	wait := time.Duration(req.WaitMs) * time.Millisecond
	select {
	case s.waiters <- struct{}{}:
		defer func() { <-s.waiters }()
	default:
		wait = 0 // too many held open: answer as things stand
	}
	ctx, cancel := context.WithTimeout(s.ctx, wait)
	defer cancel()
	st, ok := s.board.Next(ctx, req.Job, Cursor{Run: req.Run, Step: req.After})
	resp := response{V: wireVersion, Running: ok}
	if ok {
		resp.Stage, resp.Step, resp.Total, resp.Run = st.Stage, st.Step, st.Total, st.Run
		if !st.At.IsZero() {
			resp.AtNanos = st.At.UnixNano()
		}
	}
	str.SetDeadline(time.Now().Add(ioTimeout))
	transfer.WriteFrame(str, &resp)
}

// Peer is where to ask: a node's libp2p identity and addresses.
type Peer struct {
	ID    peer.ID
	Addrs []string
}

// Ask asks p for job's step once it passes after (the zero Cursor: as it
// stands), waiting at most wait (capped at MaxWait) for that. ok is false when
// nothing past after will come from p (Board.Next). ctx bounds the whole
// exchange.
func Ask(ctx context.Context, h host.Host, p Peer, job string, after Cursor, wait time.Duration) (st Step, ok bool, err error) {
	wait = min(max(wait, 0), MaxWait)
	str, stop, err := transfer.OpenStream(ctx, h, p.ID, p.Addrs, ProtocolID)
	if err != nil {
		return Step{}, false, fmt.Errorf("%w: progress of %s: %v", transfer.ErrUnreachable, job, err)
	}
	defer str.Close()
	defer stop()
	str.SetDeadline(time.Now().Add(wait + 2*ioTimeout))
	if err := transfer.WriteFrame(str, &request{V: wireVersion, Job: job, Run: after.Run, After: after.Step, WaitMs: int(wait / time.Millisecond)}); err != nil {
		return Step{}, false, fmt.Errorf("%w: progress of %s: %v", transfer.ErrUnreachable, job, err)
	}
	var resp response
	if err := transfer.ReadFrame(str, maxFrame, &resp); err != nil {
		return Step{}, false, fmt.Errorf("%w: progress of %s: %v", transfer.ErrUnreachable, job, err)
	}
	if resp.Denied {
		return Step{}, false, ErrDenied
	}
	if !resp.Running {
		return Step{}, false, nil
	}
	st = Step{Stage: resp.Stage, Step: resp.Step, Total: resp.Total, Run: resp.Run}
	if resp.AtNanos != 0 {
		st.At = time.Unix(0, resp.AtNanos)
	}
	return st, true, nil
}
