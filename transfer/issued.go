package transfer

import (
	"bytes"
	"context"
	"fmt"
	"maps"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
)

// Issued tickets. A producer that knows its consumer before the consumer
// asks (the agent pushes a task with its claim to a chosen worker) mints
// the ticket response itself, Issue, and hands it over with the task; the
// consumer's pull, given it with WithIssued, skips the ticket round trip
// over the control channel (a libp2p stream, and the producer's check of
// the consumer's claim in etcd) and goes straight to the data plane. The
// data plane checks a tcp consumer's identity against the ticket as for
// any ticket; shm and rdma read the handle and region it names. A payload
// still being written (an early handoff) needs the producer's chunk
// events, so its issued ticket is used for tcp only (whose producer waits
// for each range to be ready) and shm and rdma ask as before.

type issuedKey struct{}

// Issue mints, for consumer, the ticket response a ticket request for
// payload id would get, encoded as a frame (at most Config.MaxFrame): the
// caller hands it to that consumer only, as the claim holder of the task
// that reads the payload. Complete is set when every chunk is ready.
func (s *Service) Issue(id string, consumer peer.ID) ([]byte, error) {
	resp := s.issue(id, consumer)
	if resp.ErrCode != "" {
		return nil, &RemoteError{Code: resp.ErrCode, Msg: resp.ErrMsg}
	}
	if e := s.reg.get(id); e != nil {
		resp.Complete = e.complete()
	}
	var buf bytes.Buffer
	if err := WriteFrame(&buf, &resp); err != nil {
		return nil, err
	}
	if buf.Len() > s.cfg.MaxFrame {
		return nil, fmt.Errorf("%w: issued ticket of %d bytes", ErrFrameTooLarge, buf.Len())
	}
	return buf.Bytes(), nil
}

// WithIssued returns ctx carrying raw, a ticket response for payload that
// its producer issued to this service (Issue): a pull of that payload made
// with ctx uses it instead of asking the producer. An undecodable or
// mismatched one is ignored and the pull asks as usual.
func WithIssued(ctx context.Context, payload string, raw []byte) context.Context {
	old, _ := ctx.Value(issuedKey{}).(map[string][]byte)
	m := make(map[string][]byte, len(old)+1)
	maps.Copy(m, old)
	m[payload] = raw
	return context.WithValue(ctx, issuedKey{}, m)
}

// issuedFor decodes the issued ticket ctx carries for ref, if any: nil
// unless it decodes (bounded, as any frame from a peer), answers for a
// payload of ref's size and chunks, and, with complete, was issued once
// every chunk was ready.
func (s *Service) issuedFor(ctx context.Context, ref Ref, complete bool) *TicketResponse {
	m, _ := ctx.Value(issuedKey{}).(map[string][]byte)
	raw := m[ref.ID]
	if len(raw) == 0 {
		return nil
	}
	var resp TicketResponse
	if err := ReadFrame(bytes.NewReader(raw), s.cfg.MaxFrame, &resp); err != nil || resp.ErrCode != "" {
		s.log.Debug("ignoring an undecodable issued ticket", zap.String("payload", ref.ID), zap.Error(err))
		return nil
	}
	if resp.Meta.Bytes() != ref.Meta.Bytes() || resp.Meta.Chunks() != ref.Meta.Chunks() || (complete && !resp.Complete) {
		return nil
	}
	s.issuedPulls.Add(1)
	return &resp
}
