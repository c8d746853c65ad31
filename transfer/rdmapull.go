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

// rdmaState is an open RDMA device with the arena registered on it, and the
// queue pairs connected through it.
type rdmaState struct {
	dev *rdma.Device
	mr  *rdma.MR

	mu sync.Mutex
	// mu guards the fields below.
	pulls  map[peer.ID]*rdma.QP // consumer side, one per producer
	served map[peer.ID]*rdma.QP // producer side, one per consumer
	closed bool
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
	mr, err := dev.RegisterMemory(s.arena.Bytes())
	if err != nil {
		dev.Close()
		return unavailable("register arena: "+err.Error(), err)
	}
	s.rdma = &rdmaState{
		dev:    dev,
		mr:     mr,
		pulls:  make(map[peer.ID]*rdma.QP),
		served: make(map[peer.ID]*rdma.QP),
	}
	s.log.Info("rdma enabled", zap.String("device", dev.Name()), zap.Int64("registered_bytes", mr.Len()))
	return nil
}

// region is where the payload at arena offset off lies for a remote reader.
func (r *rdmaState) region(off int64) *RDMARegion {
	mi := r.mr.MemInfo()
	return &RDMARegion{Addr: mi.Addr, RKey: mi.RKey, Len: mi.Len, Off: uint64(off)}
}

func (r *rdmaState) close() {
	r.mu.Lock()
	r.closed = true
	pulls, served := r.pulls, r.served
	r.pulls, r.served = nil, nil
	r.mu.Unlock()
	for _, q := range pulls {
		q.Close()
	}
	for _, q := range served {
		q.Close()
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

// handleRDMAStream connects a queue pair for the consumer at the other end;
// it stays until the consumer connects another or the service closes. The
// consumer can then read this service's registered arena, but only payloads
// a ticket told it about are ones it can find.
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
// RDMAProtocolID first when there is none.
func (s *Service) qpTo(ctx context.Context, pid peer.ID) (*rdma.QP, error) {
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
	q, err := s.qpTo(ctx, pid)
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
