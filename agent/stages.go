package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
	"github.com/latentmesh/latentmesh/transfer"
)

// The stages' own work: denoise (with its early commit for video, so
// decode overlaps the tail), decode (chunk by chunk, with previews), and
// handing a finished output on, peer to peer or through the Store.

// relayOutput hands a finished payload on through the Store. When the
// Store has no room and the job did not insist on a relay, the payload goes
// peer to peer instead; otherwise the task retries later.
func (a *Agent) relayOutput(ctx context.Context, c *jobs.Claim, ref transfer.Ref, hint string, staged *[]*cache.Staged) (jobs.Output, []string, bool, error) {
	out, st, err := a.relay(ctx, c, ref, hint)
	if err == nil {
		*staged = append(*staged, st)
		return out, nil, false, nil
	}
	if ctx.Err() != nil {
		a.release(ref.ID)
		return out, nil, false, ctx.Err()
	}
	if a.transferMode(c.Task) == jobs.StoreRelay {
		a.release(ref.ID)
		return out, nil, false, fmt.Errorf("%w: relay through the Store: %v", errTransient, err)
	}
	a.log.Debug("store relay failed; handing off peer to peer", zap.String("job", c.Task.JobID), zap.Error(err))
	out, err = a.output(c, ref, hint)
	return out, []string{ref.ID}, false, err
}

// begin publishes a payload for c to write, noting it as in flight until
// c's task ends (it has no record before its commit; see resyncHeld).
func (a *Agent) begin(c *jobs.Claim, meta transfer.TensorMeta) (*transfer.Pending, transfer.Ref, error) {
	a.inflightMu.Lock()
	defer a.inflightMu.Unlock()
	p, ref, err := a.xfer.Begin(meta)
	if err == nil {
		a.inflight[ref.ID] = c.Task.ID
	}
	return p, ref, err
}

// untrack forgets the in-flight payloads of c's task.
func (a *Agent) untrack(c *jobs.Claim) {
	a.inflightMu.Lock()
	defer a.inflightMu.Unlock()
	for id, task := range a.inflight {
		if task == c.Task.ID {
			delete(a.inflight, id)
		}
	}
}

// output is the commit record of a stage that produced payload ref, handed
// on peer to peer, with hint the next stage's preferred worker.
func (a *Agent) output(c *jobs.Claim, ref transfer.Ref, hint string) (jobs.Output, error) {
	raw, err := json.Marshal(ref)
	if err != nil {
		return jobs.Output{}, err
	}
	a.markStageOutput(ref.ID) // from now on only the claim holder of its consumer gets a ticket
	return jobs.Output{Payloads: []jobs.Input{{Payload: ref.ID, Node: a.id, Ref: raw}}, Hint: hint}, nil
}

// denoise runs the sampler with the latent written straight into a
// published, chunked payload. With early handoff (a video with more than
// one chunk) the stage commits as soon as frame chunk 0 is final, so the
// decode stage starts pulling and decoding while the denoiser finishes the
// remaining frames; if the denoiser then fails, it releases the payload and
// the consumer's pull fails with "not found", which rewinds the job.
func (a *Agent) denoise(ctx context.Context, c *jobs.Claim, handedOff *handoffFlag, staged *[]*cache.Staged) (out jobs.Output, published []string, committed bool, err error) {
	spec := c.Task.Spec
	if err := a.runAdapter(spec); err != nil {
		return out, nil, false, err
	}
	pull := a.pull
	if len(c.Task.Inputs) > 1 { // a prompt's and a negative prompt's cache entries
		pull = func(ctx context.Context, ins []jobs.Input) (engine.Tensor, func(), error) {
			return a.pullCond(ctx, spec, ins)
		}
	}
	cond, releaseCond, err := pull(ctx, c.Task.Inputs)
	if err != nil {
		return out, nil, false, err
	}
	defer releaseCond()
	meta, err := a.runner.LatentMeta(spec)
	if err != nil {
		return out, nil, false, err
	}
	// Decided before the sampler runs: a relay copies the whole latent into
	// the Store, so it hands off after the last step, never early.
	hint := a.pickHint(jobs.Decode, spec)
	relay := a.handoff(c.Task, hint, meta.Bytes()) == routing.HandoffStore
	p, ref, err := a.begin(c, meta)
	if err != nil {
		return out, nil, false, fmt.Errorf("%w: publish: %v", errTransient, err)
	}
	// Until Done the region stays ours even if the payload is released
	// under us (a cancel after an early handoff), so the sampler's last
	// writes never land in memory handed to another payload.
	defer p.Done()
	report, endProgress := a.board.Start(c.Task.JobID, string(jobs.Denoise), spec.Steps)
	defer endProgress()
	call, ckp, err := a.denoiseCall(ctx, c, cond, p.Buf())
	if err != nil {
		a.release(ref.ID)
		return out, nil, false, err
	}
	if call.Resume != nil {
		out.ResumedFrom = call.Resume.Step
		report(call.Resume.Step, spec.Steps)
	}
	finish := func(err error) error { // what the sampler's end leaves to do for its checkpoints
		if ckp == nil {
			return err
		}
		if !errors.Is(err, engine.ErrStopped) {
			// A checkpoint still being written is waited for, so the stage
			// record counts it, and never outlives the commit that releases
			// it (a late write would be refused: the commit ends the claim).
			fctx, cancel := context.WithTimeout(a.ctx, 4*a.cfg.EtcdTimeout)
			defer cancel()
			ckp.flush(fctx)
			out.Checkpoints = ckp.count()
			return err
		}
		// Stopped at a checkpoint for a preemption or a drain: the task is
		// requeued once the checkpoint is recorded, so the next worker
		// starts from it.
		fctx, cancel := context.WithTimeout(a.ctx, 4*a.cfg.EtcdTimeout)
		defer cancel()
		step, ferr := ckp.flush(fctx)
		out.Checkpoints = ckp.count()
		a.log.Info("denoise stopped at a checkpoint", zap.String("job", c.Task.JobID), zap.Int("step", step), zap.NamedError("write", ferr))
		return err
	}
	if relay {
		call.Progress = report
		call.ChunkDone = func(k int) {
			if err := p.ChunkReady(k); err != nil {
				a.log.Error("chunk ready", zap.Int("chunk", k), zap.Error(err))
			}
		}
		err := finish(a.runner.Denoise(ctx, call))
		if call.Resume != nil && errors.Is(err, engine.ErrBadCheckpoint) {
			err = a.unusableCheckpoint(c, err)
		}
		if err != nil {
			a.release(ref.ID)
			return out, nil, false, err
		}
		o, pub, committed, err := a.relayOutput(ctx, c, ref, hint, staged)
		o.ResumedFrom, o.Checkpoints = out.ResumedFrom, out.Checkpoints
		return o, pub, committed, err
	}
	published = []string{ref.ID}
	resumed := out.ResumedFrom
	if out, err = a.output(c, ref, hint); err != nil {
		return out, published, false, err
	}
	out.ResumedFrom = resumed
	early := a.cfg.EarlyHandoff && meta.Chunks() > 1
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var commitErr chan error // set once the early commit is under way
	chunkDone := func(k int) {
		if err := p.ChunkReady(k); err != nil {
			a.log.Error("chunk ready", zap.Int("chunk", k), zap.Error(err))
			cancel()
			return
		}
		if k == 0 && early {
			commitErr = make(chan error, 1)
			start := time.Now()
			o := out // copied here: finish writes out once the sampler returns
			go func() {
				o.Work = time.Since(c.StartedAt)
				if ckp != nil {
					o.Checkpoints = ckp.count()
				}
				err := a.earlyCommit(ctx, c, o, ref.ID)
				if err == nil {
					handedOff.Store(true)
				} else {
					cancel() // nobody will consume the rest
				}
				a.log.Debug("early handoff", zap.String("job", c.Task.JobID), zap.Duration("commit", time.Since(start)), zap.Error(err))
				commitErr <- err
			}()
		}
	}
	call.Progress = func(step, total int) {
		if commitErr == nil { // after the handoff the job's progress is the decoder's
			report(step, total)
		}
	}
	call.ChunkDone = chunkDone
	if call.Checkpoint != nil {
		offer := call.Checkpoint
		call.Checkpoint = func(ck engine.Checkpoint) {
			if commitErr == nil { // handed off: the stage is committed, nothing resumes it
				offer(ck)
			}
		}
	}
	err = finish(a.runner.Denoise(dctx, call))
	if call.Resume != nil && errors.Is(err, engine.ErrBadCheckpoint) {
		err = a.unusableCheckpoint(c, err)
	}
	if commitErr == nil {
		return out, published, false, err
	}
	// The stage was handed off early: the commit's outcome decides.
	if cerr := <-commitErr; cerr != nil {
		if errors.Is(cerr, jobs.ErrFenced) || errors.Is(cerr, jobs.ErrFinished) {
			return out, published, true, cerr
		}
		// Not committed (refused, or stopped retrying by a cancel or a
		// lost lease): the task is retried or dropped, in a write fenced
		// by the claim, which a commit that did take effect deleted.
		return out, published, false, fmt.Errorf("%w: early commit: %v", errTransient, cerr)
	}
	if err != nil {
		// Committed, but the tail never came: drop the payload so its
		// consumer fails fast and rewinds the job.
		a.release(ref.ID)
		return out, nil, true, err
	}
	return out, nil, true, nil
}

// earlyCommit commits a denoise stage handed off early, as commit does a
// finished stage: while etcd does not answer it keeps the payload (the
// sampler goes on writing its tail meanwhile) and retries. When a retry is
// refused after an attempt got no answer, the payload's record says whether
// that attempt took effect: the commit writes it, and only the consumer's
// commit (which needs the tail) or a cancel deletes it. An error that
// leaves this undecided wraps errMaybeCommitted.
func (a *Agent) earlyCommit(ctx context.Context, c *jobs.Claim, out jobs.Output, payload string) error {
	log := a.log.With(zap.String("job", c.Task.JobID), zap.String("stage", string(c.Task.Stage)), zap.Int("attempt", c.Task.Attempt), zap.Bool("early", true))
	uncertain, err := a.commit(ctx, c, out, false, nil, log)
	if err == nil || !uncertain || !(errors.Is(err, jobs.ErrFenced) || errors.Is(err, jobs.ErrFinished)) {
		return err
	}
	rctx, cancel := context.WithTimeout(a.ctx, a.cfg.EtcdTimeout)
	defer cancel()
	recorded, rerr := a.store.PayloadRecorded(rctx, a.id, payload)
	switch {
	case rerr != nil:
		return fmt.Errorf("%w: %w (and reading the payload record: %v)", errMaybeCommitted, err, rerr)
	case recorded:
		log.Info("an early commit attempt that got no answer had committed")
		return nil
	case errors.Is(err, jobs.ErrFinished):
		// The payload's consumer may have committed, deleting its record,
		// before this retry was refused: the job's record says whose
		// stage it kept.
		j, gerr := a.store.Get(rctx, c.Task.JobID)
		if gerr != nil {
			return fmt.Errorf("%w: %w (and reading the job: %v)", errMaybeCommitted, err, gerr)
		}
		if r := j.Stages[c.Task.Stage]; j.State == jobs.Succeeded && r != nil && r.Node == a.id && r.Attempt == c.Task.Attempt {
			log.Info("an early commit attempt that got no answer had committed; the job has finished since")
			return nil
		}
	}
	return err
}

// decode pulls the latent chunk by chunk and decodes each chunk's frames as
// it lands, so a video's first frames are decoded while the rest is in
// flight; each decoded video frame is published as a preview for clients
// streaming the job.
func (a *Agent) decode(ctx context.Context, c *jobs.Claim) ([]byte, string, error) {
	start := time.Now()
	spec := c.Task.Spec
	in, refs, err := a.inputRefs(ctx, c.Task.Inputs)
	if err != nil {
		return nil, "", err
	}
	fd, closeFd, err := a.newDecoder(spec, c.Task.JobID)
	if err != nil {
		return nil, "", err
	}
	defer closeFd()
	meta := refs[0].Meta
	if err := meta.Validate(a.cfg.Transfer.MaxPayloadBytes); err != nil {
		return nil, "", fmt.Errorf("%w: latent meta: %v", errInputLost, err)
	}
	_, chunkBytes := meta.ChunkRange(0)
	if chunkBytes%int64(fd.FrameBytes()) != 0 {
		return nil, "", fmt.Errorf("agent: latent chunks of %d bytes are not whole %d-byte frames", chunkBytes, fd.FrameBytes())
	}
	framesPerChunk := int(chunkBytes) / fd.FrameBytes()

	dst, release := a.buffer(meta.Bytes())
	defer release()
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A Store object's replicas are tried nearest first until one starts
	// answering; a pull that fails once chunks arrived retries the task.
	var pull *transfer.ChunkPull
	for _, ref := range refs {
		if pull, err = a.xfer.PullChunks(pctx, ref, dst); err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return nil, "", a.pullFailed(ctx, in, err)
	}
	var decodeErr error
	for ch := range decodeOrder(fd, pull.Chunks()) {
		if ch.Index == 0 {
			addPullTime(ctx, start) // to the first chunk: decoding overlaps the rest
		}
		if decodeErr == nil {
			first := ch.Index * framesPerChunk
			if decodeErr = fd.DecodeFrames(ctx, first, ch.Data); decodeErr != nil {
				cancel() // stop the pull; the loop drains what already landed
			} else if spec.Frames > 1 {
				vfirst, n := first, framesPerChunk
				if tv, ok := fd.(videoFrames); ok { // a temporal latent: more video frames than latent ones
					vfirst, n = tv.VideoFrames(first, framesPerChunk)
				}
				a.previewFrames(ctx, c, fd, vfirst, n)
			}
		}
	}
	if decodeErr != nil {
		return nil, "", decodeErr
	}
	if err := pull.Wait(); err != nil {
		return nil, "", a.pullFailed(ctx, in, err)
	}
	return fd.Finish()
}

// videoFrames is a FrameDecoder whose latent frames decode to more video
// frames (a temporal latent, externalDecoder): latent frames [first,
// first+k) to video frames [vfirst, vfirst+n).
type videoFrames interface {
	VideoFrames(first, k int) (vfirst, n int)
}

// previewFrames publishes decoded frames [first, first+n) as previews. They
// are advisory: a failure is logged, never fails the task.
func (a *Agent) previewFrames(ctx context.Context, c *jobs.Claim, fd FrameDecoder, first, n int) {
	for f := first; f < first+n; f++ {
		png, err := fd.FramePreview(f)
		if err == nil {
			if err = a.putPreview(ctx, c, f, png); err == nil {
				markFirstFrame(ctx)
			}
		}
		if err != nil && ctx.Err() == nil {
			a.log.Debug("frame preview", zap.String("job", c.Task.JobID), zap.Int("frame", f), zap.Error(err))
		}
	}
}
