package extengine

// The checks of the lifecycle features (lifecycle.go) for `engine check`:
// a decode stream carries its state from chunk to chunk (its chunks give
// the whole decode's bytes) and refuses a chunk it holds no state of; a
// denoise's chunk reported ready is not written again; and any frame the
// agent refused (a malformed chunk_ready, an adapter frame out of bounds)
// is a failure naming it, whichever check was running.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
)

// lifecycleChecks runs the lifecycle checks the session's features call for.
func (c *checker) lifecycleChecks(ctx context.Context, reg *Registration) []CheckResult {
	var out []CheckResult
	if reg.Supports(FeatureDecodeState) {
		if m, ok := firstServing(reg, StageDecode); ok {
			out = append(out, c.decodeStream(ctx, m))
		}
	}
	if reg.Supports(FeatureChunkReady) {
		if m, ok := firstServing(reg, StageDenoise); ok {
			out = append(out, c.chunkReadyCheck(ctx, m))
		}
	}
	return out
}

// firstServing is the first model serving st, one with a temporal latent first.
func firstServing(reg *Registration, st string) (Model, bool) {
	var found *Model
	for i, m := range reg.Models {
		if slices.Contains(m.Stages, st) && (found == nil || m.Latent.Temporal > 1 && found.Latent.Temporal <= 1) {
			found = &reg.Models[i]
		}
	}
	if found == nil {
		return Model{}, false
	}
	return *found, true
}

// goneWhy is why the agent side closed the engine's connection, if it did
// for a frame of the engine's ("" otherwise).
func (c *checker) goneWhy() string {
	c.goneMu.Lock()
	defer c.goneMu.Unlock()
	if c.gone == nil || !errors.Is(c.gone, ErrBadFrame) && !errors.Is(c.gone, ErrTooLarge) {
		return ""
	}
	return c.gone.Error()
}

// onGone records why the connection ended (Config.OnGone).
func (c *checker) onGone(err error) {
	c.goneMu.Lock()
	defer c.goneMu.Unlock()
	if c.gone == nil || !errors.Is(c.gone, ErrBadFrame) && !errors.Is(c.gone, ErrTooLarge) {
		c.gone = err // the first refused frame is kept: later ends follow from it
	}
}

// ranOrGone is why a task failed, with the agent's reason when it closed
// the connection for a frame (the task was running then, or came after
// and found no engine).
func (c *checker) ranOrGone(err error) string {
	if why := c.goneWhy(); why != "" && (errors.Is(err, ErrEngineLost) || errors.Is(err, ErrNoEngine)) {
		return fmt.Sprintf("the agent closed the connection for a frame of the engine's: %s", why)
	}
	return fmt.Sprintf("failed: %v", err)
}

// decodeLatent is k latent frames of m for spec s, finite, different.
func decodeLatent(m Model, frameBytes, k int) []byte {
	b := make([]byte, k*frameBytes)
	switch m.Latent.DType {
	case "float32":
		for i := 0; i+4 <= len(b); i += 4 {
			binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(i%97)/97-0.5))
		}
	default:
		for i := range b {
			b[i] = byte(i % 7)
		}
	}
	return b
}

// decodeStream: three latent frames decoded as the chunks of one stream
// give the bytes of the three decoded whole (the state carried); two
// streams interleaved chunk by chunk each give their own; a chunk of a
// stream whose chunk 0 never came, and one after stream_end, are answered
// failed lost_state (the engine does not decode without its state).
func (c *checker) decodeStream(ctx context.Context, m Model) CheckResult {
	const name, frames = "decode stream", 3
	one, err := c.request(m, StageDecode, taskSteps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	fb := len(one.Inputs[0].Data)
	latent := decodeLatent(m, fb, frames)
	spec := one.Spec
	if t := int(m.Latent.Temporal); t > 1 {
		spec.Frames = t*(frames-1) + 1
	} else {
		spec.Frames = frames
	}
	run := func(st *Stream, first, k int, last bool, src []byte) ([]byte, error) {
		r, err := c.request(m, StageDecode, taskSteps, 0)
		if err != nil {
			return nil, err
		}
		r.Spec = spec
		in, err := c.alloc(int64(k*fb), 0)
		if err != nil {
			return nil, err
		}
		copy(in, src[first*fb:])
		shape := slices.Clone(r.Inputs[0].Shape)
		shape[0] = int64(k)
		r.Inputs[0] = Tensor{DType: r.Inputs[0].DType, Shape: shape, Data: in}
		_, n := m.VideoFrames(first, k)
		pix := int64(len(r.Output.Data))
		out, err := c.alloc(int64(n)*pix, 0)
		if err != nil {
			return nil, err
		}
		canary(out, false)
		r.Output = Tensor{DType: "uint8", Shape: []int64{int64(n), r.Output.Shape[1], r.Output.Shape[2], 4}, Data: out}
		r.FirstFrame, r.Frames, r.Stream, r.LastChunk = first, k, st, last
		tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
		defer cancel()
		return out, c.srv.Run(tctx, r)
	}
	whole, err := run(NewStream("check-whole"), 0, frames, true, latent)
	if err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a decode of latent frames [0,%d) as one chunk: %s", frames, c.ranOrGone(err))}
	}
	// Two streams, interleaved: a over latent, b over its reverse.
	other := slices.Clone(latent)
	slices.Reverse(other)
	a, b := NewStream("check-a"), NewStream("check-b")
	var got []byte
	for k := range frames {
		outA, err := run(a, k, 1, k == frames-1, latent)
		if err != nil {
			return CheckResult{Name: name, Detail: fmt.Sprintf("chunk %d of a stream: %s", k, c.ranOrGone(err))}
		}
		if _, err := run(b, k, 1, k == frames-1, other); err != nil {
			return CheckResult{Name: name, Detail: fmt.Sprintf("chunk %d of a second stream interleaved with the first: %s", k, c.ranOrGone(err))}
		}
		got = append(got, outA...)
	}
	if d := differ(got, whole); d != "" {
		return CheckResult{Name: name, Detail: fmt.Sprintf("latent frames [0,%d) decoded as the chunks of one stream (another stream's chunks between them) differ from the same frames decoded whole: %s; the engine must carry each stream's state from chunk to chunk, and keep streams apart", frames, d)}
	}
	lost := func(what string, st *Stream) string {
		_, err := run(st, 1, 1, false, latent)
		var te *TaskError
		switch {
		case errors.As(err, &te) && te.Code == CodeLostState:
			return ""
		case err == nil:
			return fmt.Sprintf("chunk 1 of a stream %s: the engine answered done; it must answer failed {code: %s} (it decoded without the state of chunk 0)", what, CodeLostState)
		}
		return fmt.Sprintf("chunk 1 of a stream %s: %s; want failed {code: %s}", what, c.ranOrGone(err), CodeLostState)
	}
	// A stream whose chunk 0 never came: one the agent opened on this
	// connection with another id (as a restarted engine would see it).
	c.srv.mu.Lock()
	cur := c.srv.cur
	c.srv.mu.Unlock()
	if cur == nil {
		return CheckResult{Name: name, Detail: "the engine's connection ended: " + c.ranOrGone(ErrEngineLost)}
	}
	never := NewStream("check-never")
	never.c, never.id, never.next = cur, 1<<40, 1
	if why := lost("whose chunk 0 never came", never); why != "" {
		return CheckResult{Name: name, Detail: why}
	}
	ended := NewStream("check-ended")
	if _, err := run(ended, 0, 1, false, latent); err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("chunk 0 of a stream: %s", c.ranOrGone(err))}
	}
	ended.mu.Lock()
	c2, id := ended.c, ended.id
	ended.mu.Unlock()
	if err := c2.write(&Msg{T: TypeStreamEnd, Stream: id}); err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("send stream_end: %v", err)}
	}
	if why := lost("after its stream_end", ended); why != "" {
		return CheckResult{Name: name, Detail: why}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("%d latent frames as a stream's chunks, interleaved with another stream, give the whole decode's bytes; a chunk without its state (chunk 0 never sent, or after stream_end) is answered %s", frames, CodeLostState)}
}

// chunkReadyCheck: a denoise of several latent frames; each chunk the
// engine reports ready before done must hold, at done, the bytes it held
// when reported (a consumer may have read them).
func (c *checker) chunkReadyCheck(ctx context.Context, m Model) CheckResult {
	const name = "chunk ready"
	r, err := c.request(m, StageDenoise, taskSteps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	frames := 2
	r.Spec.Frames = 2
	if t := int(m.Latent.Temporal); t > 1 {
		r.Spec.Frames = t + 1
	}
	fb := len(r.Output.Data)
	out, err := c.alloc(int64(frames*fb), 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	canary(out, false)
	shape := slices.Clone(r.Output.Shape)
	shape[0] = int64(frames)
	r.Output = Tensor{DType: r.Output.DType, Shape: shape, Data: out}
	var (
		mu    sync.Mutex
		step  int
		early = map[int]int{} // chunk -> the step reported when it was said ready
		snap  = map[int][]byte{}
	)
	r.Progress = func(s, _ int) { mu.Lock(); step = s; mu.Unlock() }
	r.ChunkReady = func(k int) {
		mu.Lock()
		defer mu.Unlock()
		if step < r.Spec.Steps {
			early[k] = step
			snap[k] = slices.Clone(out[k*fb : (k+1)*fb])
		}
	}
	tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
	err = c.srv.Run(tctx, r)
	cancel()
	if err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a %d-frame denoise: %s", frames, c.ranOrGone(err))}
	}
	mu.Lock()
	defer mu.Unlock()
	var ks []int
	for k, before := range snap {
		if d := differ(out[k*fb:(k+1)*fb], before); d != "" {
			return CheckResult{Name: name, Detail: fmt.Sprintf("chunk %d was reported ready after step %d, but changed afterwards: %s; a chunk reported ready must not be written again", k, early[k], d)}
		}
		ks = append(ks, k)
	}
	slices.Sort(ks)
	if len(ks) == 0 {
		return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("no chunk of %d reported ready before the last step (the agent takes them at done)", frames)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("chunks %v of %d reported ready before the last step, unchanged after", ks, frames)}
}

// protocolFrames fails an engine whose connection the agent side closed
// for a frame of the engine's at any time during the check.
func (c *checker) protocolFrames() CheckResult {
	if why := c.goneWhy(); why != "" {
		return CheckResult{Name: "protocol frames", Detail: fmt.Sprintf("the agent closed the connection for a frame of the engine's: %s", why)}
	}
	return CheckResult{Name: "protocol frames", Pass: true, Detail: "every frame the engine sent was well-formed"}
}
