package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// Pulling a task's inputs: from their producer peer to peer, from a
// Store holder or a conditioning cache entry, into an arena buffer, and
// telling a lost input (the job rewinds) from a transient failure.

// input decodes a task's single input reference.
func input(ins []jobs.Input) (jobs.Input, transfer.Ref, error) {
	var ref transfer.Ref
	if len(ins) != 1 {
		return jobs.Input{}, ref, fmt.Errorf("%w: task has %d inputs, want 1", errInputLost, len(ins))
	}
	if err := json.Unmarshal(ins[0].Ref, &ref); err != nil {
		return ins[0], ref, fmt.Errorf("%w: undecodable payload ref %s: %v", errInputLost, ins[0].Payload, err)
	}
	return ins[0], ref, nil
}

// pull fetches a task's input payload from its producer into a buffer of
// this agent's arena; call release when done with the tensor.
func (a *Agent) pull(ctx context.Context, ins []jobs.Input) (t engine.Tensor, release func(), err error) {
	defer addPullTime(ctx, time.Now())
	in, refs, err := a.inputRefs(ctx, ins)
	if err != nil {
		return engine.Tensor{}, nil, err
	}
	meta := refs[0].Meta
	if err := meta.Validate(a.cfg.Transfer.MaxPayloadBytes); err != nil {
		return engine.Tensor{}, nil, fmt.Errorf("%w: payload meta: %v", errInputLost, err)
	}
	dst, release := a.buffer(meta.Bytes())
	if err := a.pullFrom(ctx, in, refs, dst); err != nil {
		release()
		return engine.Tensor{}, nil, err
	}
	return engine.Tensor{Meta: meta, Data: dst}, release, nil
}

// pullFrom pulls input in into dst from the first of refs that answers (a
// Store object's replicas, nearest first).
func (a *Agent) pullFrom(ctx context.Context, in jobs.Input, refs []transfer.Ref, dst []byte) error {
	var err error
	for _, ref := range refs {
		if err = a.xfer.PullInto(ctx, ref, dst); err == nil {
			return nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	return a.pullFailed(ctx, in, err)
}

// buffer returns n bytes for a pull to land in: arena memory when the arena
// has room (transfers write straight into it), else the heap, which every
// transport also accepts.
func (a *Agent) buffer(n int64) ([]byte, func()) {
	b, err := a.xfer.Alloc(n)
	if err != nil {
		a.heapPulls.Add(1)
		a.log.Debug("pull into heap", zap.Int64("bytes", n), zap.Error(err))
		return make([]byte, n), func() {}
	}
	return b.Bytes(), b.Release
}

// pullFailed classifies a failed pull: a payload its producer no longer has,
// or whose producer left the mesh, is lost (the job restarts); anything else
// is transient (the task retries).
func (a *Agent) pullFailed(ctx context.Context, in jobs.Input, err error) error {
	switch {
	case errors.Is(err, transfer.ErrNotFound):
		err = fmt.Errorf("%w: %s on %s: %w", errInputLost, in.Payload, in.Node, err)
	case ctx.Err() != nil:
		return ctx.Err()
	default:
		if p, ok := a.member.Peer(in.Node); !ok || !p.Registered {
			err = fmt.Errorf("%w: producer %s left the mesh: %v", errInputLost, in.Node, err)
		} else {
			return fmt.Errorf("%w: pull %s from %s: %v", errTransient, in.Payload, in.Node, err)
		}
	}
	if in.Cached {
		// A cache entry no holder serves goes, so that the job's rewind
		// encodes its text again rather than find it.
		a.dropEntry(in.Payload)
	}
	return err
}

// pullVia collects the transports that carried a task's input, for its
// stage record (jobs.StageRecord.Transport).
type pullVia struct {
	mu  sync.Mutex
	got []string // in first-seen order, each once
}

func (v *pullVia) add(transport string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !slices.Contains(v.got, transport) {
		v.got = append(v.got, transport)
	}
}

// String names the transports, "store " first for an input read from the
// Store; "" when nothing was pulled.
func (v *pullVia) String(ins []jobs.Input) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.got) == 0 {
		return ""
	}
	s := strings.Join(v.got, "+")
	if len(ins) > 0 && ins[0].Store {
		s = "store " + s
	}
	return s
}

// pullTime sums the time a task spent pulling its inputs, for its stage
// record (jobs.StageRecord.PullMillis).
type pullTime = atomic.Int64

type pullTimeKey struct{}

func withPullTime(ctx context.Context, p *pullTime) context.Context {
	return context.WithValue(ctx, pullTimeKey{}, p)
}

// addPullTime adds the time since start to ctx's pull time, if it has one.
func addPullTime(ctx context.Context, start time.Time) {
	if p, ok := ctx.Value(pullTimeKey{}).(*pullTime); ok {
		p.Add(int64(time.Since(start)))
	}
}
