package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer/rdma"
)

// RDMAProtocolID is the libp2p protocol on which two services exchange queue
// pair addresses (rdma.QPInfo) to connect an RC queue pair; the consumer
// opens it, and the stream's authenticated peer ids say who is connecting.
const RDMAProtocolID protocol.ID = "/latentmesh/rdma/1"

// rdmaState is an open RDMA device with the arena registered on it for
// local writes (the destination of this service's READs), each payload a
// peer may read registered as a region of its own, and the queue pairs
// connected through it.
type rdmaState struct {
	dev *rdma.Device
	mr  *rdma.MR // the arena, local write only: no peer reads through it

	mu sync.Mutex
	// mu guards the fields below.
	pulls    map[peer.ID]*rdma.QP // consumer side, one per producer
	served   map[peer.ID]*rdma.QP // producer side, one per consumer
	payloads map[string]*rdma.MR  // producer side: payload id -> its region
	closed   bool
}

// rdmaFallbackMsg is the one line an agent logs when it could use RDMA (the
// transport is auto) but cannot.
const rdmaFallbackMsg = "rdma unavailable; using tcp"

// startRDMA opens the RDMA device when the transport mode allows rdma. In
// auto mode a host that cannot use RDMA is logged once and nil returned; in
// rdma mode it is an error.
func (s *Service) startRDMA() error {
	mode := s.cfg.Transport
	if mode != TransportAuto && mode != TransportRDMA {
		return nil
	}
	unavailable := func(reason string, err error) error {
		if mode == TransportRDMA {
			if err == nil {
				err = ErrTransport
			}
			return fmt.Errorf("transfer: transport rdma: %s: %w", reason, err)
		}
		s.log.Info(rdmaFallbackMsg, zap.String("reason", reason))
		return nil
	}
	open := s.cfg.openRDMA
	if open == nil {
		if ok, reason := rdma.Available(); !ok {
			return unavailable(reason, nil)
		}
		open = rdma.Open
	}
	if s.arena == nil {
		return unavailable("no arena to register (Arena.Size is 0)", nil)
	}
	dev, err := open(s.cfg.RDMA, s.log)
	if err != nil {
		return unavailable("open device: "+err.Error(), err)
	}
	mr, err := dev.RegisterLocal(s.arena.Bytes())
	if err != nil {
		dev.Close()
		return unavailable("register arena: "+err.Error(), err)
	}
	s.rdma = &rdmaState{
		dev:      dev,
		mr:       mr,
		pulls:    make(map[peer.ID]*rdma.QP),
		served:   make(map[peer.ID]*rdma.QP),
		payloads: make(map[string]*rdma.MR),
	}
	s.log.Info("rdma enabled", zap.String("device", dev.Name()), zap.Int64("registered_bytes", mr.Len()))
	return nil
}

// rdmaRegion is where payload e lies for a remote reader: a region holding
// its bytes only, registered on the first ticket for it and deregistered
// when it is released, so an rkey reads nothing but the payload its ticket
// named, and nothing once that payload is gone. nil (the consumer then
// pulls by tcp) when the region cannot be registered.
func (s *Service) rdmaRegion(e *entry) *RDMARegion {
	r := s.rdma
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	mr := r.payloads[e.id]
	r.mu.Unlock()
	if mr == nil {
		var err error
		if mr, err = r.dev.RegisterMemory(e.buf); err != nil {
			s.log.Warn("rdma: register payload", zap.String("payload", e.id), zap.Error(err))
			return nil
		}
		r.mu.Lock()
		if old := r.payloads[e.id]; old != nil || r.closed { // another ticket won, or closing
			r.mu.Unlock()
			mr.Close()
			if old == nil {
				return nil
			}
			mr = old
		} else {
			r.payloads[e.id] = mr
			r.mu.Unlock()
		}
		select {
		case <-e.released: // released meanwhile: Release may have missed it
			r.dropPayload(e.id)
			return nil
		default:
		}
	}
	mi := mr.MemInfo()
	return &RDMARegion{Addr: mi.Addr, RKey: mi.RKey, Len: mi.Len, Off: 0}
}

// dropPayload deregisters payload id's region, if it has one.
func (r *rdmaState) dropPayload(id string) {
	r.mu.Lock()
	mr := r.payloads[id]
	delete(r.payloads, id)
	r.mu.Unlock()
	if mr != nil {
		mr.Close()
	}
}

func (r *rdmaState) close() {
	r.mu.Lock()
	r.closed = true
	pulls, served, payloads := r.pulls, r.served, r.payloads
	r.pulls, r.served, r.payloads = nil, nil, nil
	r.mu.Unlock()
	for _, q := range pulls {
		q.Close()
	}
	for _, q := range served {
		q.Close()
	}
	for _, mr := range payloads {
		mr.Close()
	}
	r.mr.Close()
	r.dev.Close()
}

// forget closes the queue pairs to and from peer pid.
func (r *rdmaState) forget(pid peer.ID) {
	r.mu.Lock()
	pull, served := r.pulls[pid], r.served[pid]
	delete(r.pulls, pid)
	delete(r.served, pid)
	r.mu.Unlock()
	for _, q := range []*rdma.QP{pull, served} {
		if q != nil {
			q.Close()
		}
	}
}

// handleRDMAStream connects a queue pair for the consumer at the other end,
// once it shows a valid ticket this service issued to it; the queue pair
// stays until the consumer connects another or the service closes. Through
// it the consumer reads only the payload regions whose rkeys its tickets
// carried.
func (s *Service) handleRDMAStream(str network.Stream) {
	if !s.enter() {
		str.Reset()
		return
	}
	defer s.wg.Done()
	defer str.Close()
	remote := str.Conn().RemotePeer()
	if !s.admit(remote) {
		s.refused.refuse("rdma", remote, "not admitted")
		str.Reset()
		return
	}
	str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	var req QPRequest
	if err := ReadFrame(str, s.cfg.MaxFrame, &req); err != nil {
		s.refused.refuse("rdma", remote, "bad qp request: "+err.Error())
		str.Reset()
		return
	}
	if _, _, err := s.checkTicket(req.Ticket, remote); err != nil {
		s.refused.refuse("rdma", remote, "qp without a valid ticket: "+err.Error())
		str.Reset()
		return
	}
	ctx, cancel := context.WithTimeout(s.life, s.cfg.IOTimeout)
	defer cancel()
	q, err := s.connectQP(ctx, str)
	if err != nil {
		s.log.Debug("rdma connect", zap.Stringer("peer", remote), zap.Error(err))
		str.Reset()
		return
	}
	r := s.rdma
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		q.Close()
		return
	}
	old := r.served[remote]
	r.served[remote] = q
	r.mu.Unlock()
	if old != nil {
		old.Close()
	}
}

// connectQP creates a queue pair, swaps addresses with the peer on str and
// connects it.
func (s *Service) connectQP(ctx context.Context, str network.Stream) (*rdma.QP, error) {
	q, err := s.rdma.dev.NewQP()
	if err != nil {
		return nil, err
	}
	remote, err := rdma.Exchange(ctx, str, q.Info())
	if err == nil {
		err = q.Connect(remote)
	}
	if err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

// qpTo returns the queue pair connected to producer pid, connecting one over
// RDMAProtocolID first when there is none, showing ticket (one pid issued to
// this service) to get it.
func (s *Service) qpTo(ctx context.Context, pid peer.ID, ticket []byte) (*rdma.QP, error) {
	r := s.rdma
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil, ErrClosed
	}
	if q := r.pulls[pid]; q != nil {
		r.mu.Unlock()
		return q, nil
	}
	r.mu.Unlock()
	str, err := s.h.NewStream(ctx, pid, RDMAProtocolID)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: open rdma stream: %w", ErrUnreachable, pid, err)
	}
	defer str.Close()
	str.SetDeadline(time.Now().Add(s.cfg.IOTimeout))
	if err := WriteFrame(str, &QPRequest{V: WireVersion, Ticket: ticket}); err != nil {
		str.Reset()
		return nil, fmt.Errorf("%w: %s: rdma qp request: %w", ErrUnreachable, pid, err)
	}
	q, err := s.connectQP(ctx, str)
	if err != nil {
		str.Reset()
		return nil, fmt.Errorf("%w: %s: rdma connect: %w", ErrUnreachable, pid, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		q.Close()
		return nil, ErrClosed
	}
	if old := r.pulls[pid]; old != nil { // another pull connected meanwhile
		q.Close()
		return old, nil
	}
	r.pulls[pid] = q
	return q, nil
}

// dropQP forgets a failed queue pair so the next pull connects a new one.
func (s *Service) dropQP(pid peer.ID, q *rdma.QP) {
	r := s.rdma
	r.mu.Lock()
	if r.pulls[pid] == q {
		delete(r.pulls, pid)
	}
	r.mu.Unlock()
	q.Close()
}

// errDstNotRegistered means an rdma pull's destination is not in the arena,
// the only memory registered with the device.
var errDstNotRegistered = fmt.Errorf("%w: rdma: destination is not in this service's arena", ErrTransport)

// pullRDMA reads a payload from the producer's registered arena straight into
// dst (which must lie in this service's arena) with one-sided RDMA READs,
// chunk by chunk as the producer reports them ready.
func (s *Service) pullRDMA(ctx context.Context, pid peer.ID, ref Ref, dst []byte, onChunk func(int)) error {
	localOff := s.arenaOffset(dst)
	if localOff < 0 {
		return &fallbackError{errDstNotRegistered}
	}
	w, err := s.openWatch(ctx, pid, ref)
	if err != nil {
		return err
	}
	defer w.done()
	reg := w.resp.RDMA
	if reg == nil {
		return &fallbackError{errNotInArena}
	}
	size := uint64(ref.Meta.Bytes())
	if reg.Off > reg.Len || size > reg.Len-reg.Off {
		return fmt.Errorf("%w: rdma payload at %d+%d outside a region of %d bytes", ErrProtocol, reg.Off, size, reg.Len)
	}
	q, err := s.qpTo(ctx, pid, w.resp.Ticket)
	if err != nil {
		if ctx.Err() != nil || errors.Is(err, ErrClosed) {
			return err
		}
		return &fallbackError{err}
	}
	remote := rdma.MemInfo{Addr: reg.Addr, RKey: reg.RKey, Len: reg.Len}
	for range ref.Meta.Chunks() {
		k, err := w.next()
		if err != nil {
			return err
		}
		off, n := ref.Meta.ChunkRange(k)
		if err := q.Read(ctx, s.rdma.mr, localOff+off, remote, int64(reg.Off)+off, n); err != nil {
			if errors.Is(err, rdma.ErrQPFailed) {
				s.dropQP(pid, q)
			}
			if ctx.Err() != nil {
				return fmt.Errorf("transfer: pull %s: %w", ref.ID, ctx.Err())
			}
			return fmt.Errorf("%w: rdma read of %s chunk %d: %w", ErrUnreachable, ref.ID, k, err)
		}
		if onChunk != nil {
			onChunk(k)
		}
	}
	return nil
}
