package cache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// Chained puts.
//
// A put of an object pulled over the data plane copies it along a chain:
// the first holder pulls the putter's payload, and holder i pulls holder
// i-1's copy, so the source is sent once whatever R is. A holder whose
// copy is staged in flight (Early: a memory copy published with
// transfer.Begin before its bytes land, each chunk marked ready as it
// lands) is pulled from chunk by chunk while it fills, the way a consumer
// pulls a producer's payload that is still being written; a copy staged
// whole (a disk copy, the first copy of a one-chunk object) is pulled once
// it is complete. Every holder is given the chain's earlier sources
// (Fallback: the holders before its upstream, then the putter's payload)
// and falls back on them, in order, when its upstream fails.
//
// With PutSpec.FirstCopy every copy is staged in flight, the first one
// too: Stage returns as soon as each holder has published the payload
// readers will pull, before the first copy's bytes land, so the caller
// commits the record (written once, naming every copy) while they do, and
// then waits for the first copy (Staged.FirstCopied): the put is done
// when that copy is whole. The later copies start only then, and only
// once the putter knows it: their holders publish them at once but defer
// their fills (Deferred) until the putter, having seen the first copy
// complete, asks them to fill (the fill op), a reader asks for one (a
// ticket for it: the reader waits on it), or half the fill's time has
// passed (the putter is gone: the copy is still made). So the second copy
// never shares the cores and memory bandwidth with the first (a chunked
// object's would pipeline behind it), nor with the putter learning that
// the first is whole; a third pulls the second chunk by chunk as it
// lands. A reader
// that finds the record meanwhile reaches a copy still in flight and
// waits for its chunks (the transfer service answers "wait" until each
// is ready); every pull checks what lands as a pull of a copy staged
// whole does (over tcp, against the block checksums the source was
// published with, which a copy in flight serves on as its pull verified
// them). A copy whose fill fails is dropped by its holder, which ends
// those waits with ErrNotFound, so the reader goes on to the next holder,
// and the holder then unlists itself from the record, for repair to
// restore R. When the failed copy is the first, the put fails:
// FirstCopied deletes the record while it still names this put's copies
// and drops them, so no record is left naming a copy that never was.
// Staged.Replicated says when every copy is complete. Without FirstCopy
// the put returns once every copy is complete, as before the chain.

// chainOpts are the chain fields of one stage request.
type chainOpts struct {
	early    bool
	deferred bool // with early: fill when asked (opFill)
	fallback []transfer.Ref
}

// chained is one copy a chained stage made: its holder, whether it was
// staged in flight (its fill may still be running), and whether its fill
// waits to be asked for.
type chained struct {
	Holder
	inFlight, deferred bool
}

// earlyCopy reports whether the copy at chain position i (of want) is
// staged in flight: every copy of a FirstCopy put (the put waits for the
// first only after its record is committed, and for no other), and, for a
// non-durable object of several chunks, every copy that a next one pulls
// from, so the next pulls its chunks as they land. A durable mode's
// copies are otherwise staged whole: they are written through to disk
// before the holder answers.
func earlyCopy(spec PutSpec, meta transfer.TensorMeta, i, want int) bool {
	if spec.FirstCopy {
		return true
	}
	return meta.Chunks() > 1 && i < want-1 && !durable(spec.Mode)
}

// stageChain stages want copies of src (a payload to be pulled) along a
// chain over the candidates, trying the next candidate when one refuses.
// It returns the copies in chain order; those in flight may still be
// filling.
func (s *Store) stageChain(ctx context.Context, spec PutSpec, src source, cands []Member, want int) ([]chained, error) {
	var out []chained
	var errs []error
	upstream := src.ref
	var fallback []transfer.Ref // newest first: the holders before upstream, then the source
	for len(out) < want && len(cands) > 0 {
		m := cands[0]
		cands = cands[1:]
		i := len(out)
		// The later copies of a FirstCopy put fill once the putter has
		// seen the first complete (followChain asks them).
		opts := chainOpts{early: earlyCopy(spec, src.ref.Meta, i, want), deferred: spec.FirstCopy && i > 0, fallback: fitFallback(spec.ID, upstream, fallback)}
		h, err := s.stageOn(ctx, m, spec.ID, spec.Mode, source{ref: upstream}, &opts)
		if err != nil && opts.early && i == 0 && errIsFull(err) && ctx.Err() == nil {
			// In flight only so the next copy could pipeline, or the
			// record be committed while it lands: whole will do (a disk
			// copy, or memory the arena could not give Begin).
			opts.early = false
			h, err = s.stageOn(ctx, m, spec.ID, spec.Mode, source{ref: upstream}, &opts)
		}
		if err != nil {
			s.log.Debug("stage refused", zap.String("object", spec.ID), zap.String("on", m.Node), zap.Bool("early", opts.early), zap.Error(err))
			errs = append(errs, fmt.Errorf("%s: %w", m.Node, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		out = append(out, chained{Holder: h, inFlight: opts.early, deferred: opts.early && opts.deferred})
		fallback = append([]transfer.Ref{upstream}, fallback...)
		upstream = h.Ref
	}
	if len(out) == 0 {
		return nil, noCopyErr(errs)
	}
	return out, nil
}

// noCopyErr is the error of a stage that made no copy: ErrFull when every
// candidate was full (or there was none).
func noCopyErr(errs []error) error {
	if len(errs) == 0 {
		return fmt.Errorf("%w: no member has room", ErrFull)
	}
	full := true
	for _, e := range errs {
		full = full && errIsFull(e)
	}
	if full {
		return fmt.Errorf("%w: %w", ErrFull, errors.Join(errs...))
	}
	return errors.Join(errs...)
}

// fitFallback is as much of fallback (newest first) as a stage request of
// id from src carries within requestRoom, so any holder's MaxFrame takes
// it: refs of a real mesh are a few hundred bytes, and the source, the
// last fallback, is dropped only when they are not.
func fitFallback(id string, src transfer.Ref, fallback []transfer.Ref) []transfer.Ref {
	fallback = fallback[:min(len(fallback), maxFallback)]
	for len(fallback) > 0 {
		r := request{V: chainVersion, Op: opStage, Object: id, Mode: Consume, Src: src, Early: true, Fallback: fallback}
		var b bytes.Buffer
		if transfer.WriteFrame(&b, &r) == nil && b.Len() <= requestRoom {
			return fallback
		}
		fallback = fallback[:len(fallback)-1]
	}
	return nil
}

// stageEarly takes a copy of the first of srcs in flight on this node: a
// memory copy published at once (transfer.Begin), filled in the
// background from srcs in order, each chunk readable as it lands; issued,
// when not nil, is a ticket for the first that its producer issued to
// this node. A deferred fill starts when asked (filling.start, by the
// fill op) or after half of RequestTimeout, whichever is first. The fill
// is bounded by RequestTimeout; a fill that fails drops the copy.
func (s *Store) stageEarly(ctx context.Context, id string, mode Mode, srcs []transfer.Ref, issued []byte, deferred bool) (Holder, error) {
	if !s.enter() {
		return Holder{}, ErrClosed
	}
	handedOff := false
	defer func() {
		if !handedOff {
			s.wg.Done()
		}
	}()
	meta := srcs[0].Meta
	size := meta.Bytes()
	evicted, err := s.hold.reserveMemory(size, mode)
	s.hold.release(evicted...)
	if len(evicted) > 0 {
		s.deleteEvicted(ctx, evicted)
	}
	if err != nil {
		return Holder{}, err
	}
	p, ref, err := s.xfer.Begin(meta)
	if err == nil {
		if _, _, hasArena := s.xfer.ArenaFd(); hasArena {
			if _, in := s.xfer.ArenaOffset(p.Buf()); !in {
				// Begin fell back to the heap: a Store copy lives in the
				// arena (shm and rdma readers need it there).
				s.xfer.Release(ref.ID)
				p.Done()
				err = fmt.Errorf("cache: a copy in flight: %w", arena.ErrNoSpace)
			}
		}
	}
	if err != nil {
		s.hold.unreserveMode(Memory, size, mode)
		return Holder{}, err
	}
	ref.Checksum = srcs[0].Checksum // what the copy is, once whole: pulls of it check against it
	fctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
	if len(issued) > 0 {
		fctx = transfer.WithIssued(fctx, srcs[0].ID, issued)
	}
	f := &filling{done: make(chan struct{}), cancel: cancel, start: make(chan struct{})}
	if !deferred {
		f.begin()
	}
	c := &copyOf{object: id, ref: ref, tier: Memory, size: size, mode: mode, stagedAt: s.cfg.Now(), fill: f}
	s.hold.add(c)
	handedOff = true
	go func() {
		defer s.wg.Done()
		defer cancel()
		err := f.waitStart(fctx, s.cfg.RequestTimeout/2)
		start := time.Now()
		if err == nil {
			err = s.fillEarly(fctx, p, srcs)
		}
		p.Done()
		if err != nil {
			if s.hold.dropIf(ref.ID, func(x *copyOf) bool { return x == c }) {
				s.Kick() // a record may name it: unlist it, and repair
			}
			s.log.Info("a copy in flight failed; dropped", zap.String("object", id), zap.Error(err))
		} else {
			s.log.Debug("copy in flight complete", zap.String("object", id), zap.Duration("took", time.Since(start)))
		}
		f.err = err
		close(f.done)
	}()
	s.log.Debug("staged in flight", zap.String("object", id), zap.Int64("bytes", size))
	return Holder{Node: s.cfg.Node, Tier: Memory, Ref: ref}, nil
}

// fillEarly fills p from srcs in order, marking each chunk ready as it
// lands with the block checksums its pull verified it against, so the
// copy is not hashed again (as a copy staged whole is published with
// transfer.PublishCopy). A source that fails after some chunks landed is
// followed by the next one into a scratch buffer, from which only the
// missing chunks are copied: a chunk once ready may be being read, and is
// never written again.
func (s *Store) fillEarly(ctx context.Context, p *transfer.Pending, srcs []transfer.Ref) error {
	meta := srcs[0].Meta
	ready := make([]bool, meta.Chunks())
	left := len(ready)
	var errs []error
	for _, src := range srcs {
		if ctx.Err() != nil {
			break
		}
		dst, scratch := p.Buf(), left < len(ready)
		if scratch {
			dst = make([]byte, meta.Bytes())
		}
		pull, err := s.xfer.PullChunks(transfer.ForStore(ctx), src, dst)
		if err != nil {
			errs = append(errs, fmt.Errorf("from %s: %w", src.Producer.PeerID, err))
			continue
		}
		for ch := range pull.Chunks() {
			if ready[ch.Index] {
				continue
			}
			if scratch {
				off, n := meta.ChunkRange(ch.Index)
				copy(p.Buf()[off:off+n], ch.Data)
			}
			// The pull verified the chunk against the checksums it came
			// with (tcp): served on as they are, not hashed again.
			if err := p.ChunkCopied(ch.Index, ch.Sums); err != nil {
				return err // our own bookkeeping is wrong: do not serve the copy
			}
			ready[ch.Index] = true
			left--
		}
		err = pull.Wait()
		if err == nil && left == 0 {
			return nil
		}
		errs = append(errs, fmt.Errorf("from %s: %w", src.Producer.PeerID, err))
	}
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	return fmt.Errorf("cache: fill a copy in flight (%d of %d chunks): %w", len(ready)-left, len(ready), errors.Join(errs...))
}

// waitLocal waits until this node's copy payload of object is complete,
// first starting its fill if it is deferred and start is set. ErrNotFound:
// the copy is not held (its fill failed, or it was dropped).
func (s *Store) waitLocal(ctx context.Context, object, payload string, start bool) error {
	f, held := s.hold.filling(object, payload)
	if !held {
		return fmt.Errorf("%w: no copy %s of %s", transfer.ErrNotFound, payload, object)
	}
	if f == nil {
		return nil
	}
	if start {
		f.begin()
	}
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	case <-s.ctx.Done():
		return ErrClosed
	}
}

// waitOn waits until h's copy of id is complete, asking its node; with
// start, it first starts the copy's fill if that is deferred.
func (s *Store) waitOn(ctx context.Context, h Holder, id string, start bool) error {
	if h.Node == s.cfg.Node {
		return s.waitLocal(ctx, id, h.Ref.ID, start)
	}
	m, ok := s.member(h.Node)
	if !ok {
		return fmt.Errorf("%w: %s is not a live member", transfer.ErrUnreachable, h.Node)
	}
	req := &request{Op: opWait, Object: id, Payload: h.Ref.ID}
	if start {
		req.Op = opFill
	}
	req.V = req.version()
	_, err := s.call(ctx, m, req)
	return err
}

// Replication is how the copies of a put went: when the first was
// complete and when the last ended, measured from the start of Stage.
type Replication struct {
	Wanted   int // R
	Complete int // copies known complete
	// FirstCopy is when the first copy was complete; AllCopies when the
	// last copy ended (complete, or failed).
	FirstCopy, AllCopies time.Duration
	// Err joins the failures of copies that did not complete (each such
	// copy is gone: its holder unlists it, and repair restores R); nil
	// when every copy is complete.
	Err error
}

// replication tracks the copies of a Staged put still filling.
type replication struct {
	first chan struct{} // closed when the first copy (in chain order) ended; firstErr is final then
	done  chan struct{} // closed when every copy ended; res is final then
	mu    sync.Mutex
	// mu guards the fields below until their channel is closed.
	firstErr error
	res      Replication
}

func newReplication(res Replication) *replication {
	return &replication{first: make(chan struct{}), done: make(chan struct{}), res: res}
}

// closedReplication is the replication of a put with nothing in flight.
func closedReplication(res Replication) *replication {
	r := newReplication(res)
	close(r.first)
	close(r.done)
	return r
}

// settle waits for every copy of cs in flight, in chain order (a copy
// staged whole is complete already). It returns the copies not known
// failed. A failed copy is gone (its holder dropped it, and is asked
// again to, in case it only could not answer).
func (s *Store) settle(ctx context.Context, id string, cs []chained) (kept []chained, errs []error) {
	for _, c := range cs {
		if c.inFlight {
			if err := s.waitOn(ctx, c.Holder, id, true); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", c.Node, err))
				s.dropOn(context.WithoutCancel(ctx), c.Holder, id)
				continue
			}
			c.inFlight = false
		}
		kept = append(kept, c)
	}
	return kept, errs
}

// followChain waits, in the background, for the copies of st still in
// flight (cs, in chain order, at least one in flight): it ends st's wait
// for the first copy once that one ended, then calls release (the put's
// source is pulled by the first holder only; each later one pulls the
// copy before it) and asks a deferred copy to fill, and closes st's
// replication once every copy ended. A copy whose holder cannot be asked
// counts as failed: the put cannot tell that it landed.
func (s *Store) followChain(st *Staged, cs []chained, start time.Time, release func()) {
	r := st.repl
	firstEnded := func(err error) {
		r.mu.Lock()
		r.firstErr = err
		if err == nil {
			r.res.FirstCopy = time.Since(start)
		}
		r.mu.Unlock()
		close(r.first)
		release()
	}
	finish := func(errs []error) {
		r.mu.Lock()
		r.res.AllCopies = time.Since(start)
		r.res.Err = errors.Join(errs...)
		r.mu.Unlock()
		close(r.done)
	}
	if !s.enter() {
		if cs[0].inFlight {
			firstEnded(ErrClosed)
		} else {
			firstEnded(nil)
		}
		finish([]error{ErrClosed})
		return
	}
	go func() {
		defer s.wg.Done()
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		defer cancel()
		var mu sync.Mutex
		var errs []error
		follow := func(c chained) error {
			err := s.waitOn(ctx, c.Holder, st.Record.ID, c.deferred)
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("%s: %w", c.Node, err))
				mu.Unlock()
				return err
			}
			r.mu.Lock()
			r.res.Complete++
			r.mu.Unlock()
			return nil
		}
		var wg sync.WaitGroup
		var deferred []chained
		for _, c := range cs[1:] {
			switch {
			case c.deferred:
				deferred = append(deferred, c)
			case c.inFlight:
				wg.Go(func() { follow(c) })
			}
		}
		var err error
		if cs[0].inFlight {
			err = follow(cs[0])
		}
		firstEnded(err)
		for _, c := range deferred {
			if err != nil {
				// Left to the put's withdrawal (FirstCopied), or to fill
				// from what is left once its deferral runs out.
				mu.Lock()
				errs = append(errs, fmt.Errorf("%s: not filled: the first copy failed", c.Node))
				mu.Unlock()
				continue
			}
			wg.Go(func() { follow(c) })
		}
		wg.Wait()
		if len(errs) > 0 {
			s.log.Info("a put's chain ended short of copies", zap.String("object", st.Record.ID), zap.Errors("failed", errs))
		}
		finish(errs)
	}()
}

// FirstCopied waits until the put's first copy is complete, and is how a
// FirstCopy put ends: Stage returned as soon as that copy was published
// in flight, the caller committed the record (Commit, or Op in its own
// transaction) while its bytes landed, and the put is done when
// FirstCopied returns nil. On an error (the copy failed, its holder
// could not be asked, or ctx ended first) the put failed, and
// FirstCopied takes it back: it deletes the record while the record still
// names this put's copies (it may have been committed, and must not name
// a copy that never was) and drops the copies. A reader that found the
// record meanwhile waits on the copy: it gets the bytes only if they land
// whole, else not found. Without FirstCopy the copies are complete at
// Stage's return, and FirstCopied returns nil at once.
func (st *Staged) FirstCopied(ctx context.Context) error {
	if st.repl == nil {
		return nil
	}
	var err error
	select {
	case <-st.repl.first:
		st.repl.mu.Lock()
		err = st.repl.firstErr
		st.repl.mu.Unlock()
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err == nil {
		return nil
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), st.s.cfg.RequestTimeout)
	defer cancel()
	if werr := st.withdraw(wctx); werr != nil {
		st.s.log.Warn("a failed put's record not taken back; its holders unlist themselves", zap.String("object", st.Record.ID), zap.Error(werr))
		err = fmt.Errorf("%w (record not taken back: %v)", err, werr)
	}
	return fmt.Errorf("cache: put %s: first copy: %w", st.Record.ID, err)
}

// withdraw deletes the object's record if it names one of this put's
// copies (a record of another put of the same id is left alone), then
// drops the copies: those the record named are freed by their holders'
// watch of the delete, the others by Abort. Each delete is conditional on
// the record read, so a holder unlisting itself meanwhile costs a retry.
func (st *Staged) withdraw(ctx context.Context) error {
	defer st.Abort(ctx)
	key := ObjectKey(st.s.cfg.Prefix, st.Record.ID)
	for try := 0; try < 3; try++ {
		resp, err := st.s.cli.Get(ctx, key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return nil
		}
		rec, err := decodeRecord(resp.Kvs[0].Value)
		if err != nil || !st.namesOurs(rec) {
			return nil
		}
		t, err := st.s.writeIf(ctx, &listed{Record: rec, modRev: resp.Kvs[0].ModRevision}, nil)
		if err != nil {
			return err
		}
		if t.Succeeded {
			st.s.log.Info("a put whose first copy failed taken back", zap.String("object", st.Record.ID))
			return nil
		}
	}
	return fmt.Errorf("cache: the record of %s kept changing", st.Record.ID)
}

// namesOurs reports whether rec names one of this put's copies.
func (st *Staged) namesOurs(rec Record) bool {
	for _, h := range st.Record.Holders {
		if ref, ok := rec.Holds(h.Node); ok && ref.ID == h.Ref.ID {
			return true
		}
	}
	return false
}

// Replicated is closed once every copy of the put has ended: at once
// unless the put was staged with FirstCopy, then when the last copy in
// flight is complete or failed. Replication says how they went.
func (st *Staged) Replicated() <-chan struct{} {
	if st.repl == nil {
		return closedReplication(Replication{}).done
	}
	return st.repl.done
}

// Replication reports the put's copies: final once Replicated is closed,
// a snapshot before (Complete counts the copies complete so far).
func (st *Staged) Replication() Replication {
	if st.repl == nil {
		return Replication{}
	}
	st.repl.mu.Lock()
	defer st.repl.mu.Unlock()
	return st.repl.res
}

// WaitReplicated waits until every copy of the put ended and returns how
// they went; the error is Replication.Err, or ctx's. A result put with
// FirstCopy would call it before its job says succeeded.
func (st *Staged) WaitReplicated(ctx context.Context) (Replication, error) {
	select {
	case <-st.Replicated():
		r := st.Replication()
		return r, r.Err
	case <-ctx.Done():
		return st.Replication(), ctx.Err()
	}
}
