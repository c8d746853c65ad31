package extengine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// The checks of protocol v2's features (`engine check`), for an engine
// that negotiated them: checkpoints at the steps asked for, a resume from
// each giving an uninterrupted run's bytes, a stop ending at a checkpoint,
// and the tensor cache's round trip.

const (
	// ckSteps and ckEvery are the checkpoint check's denoise: checkpoints
	// after steps 3 and 6 of 8.
	ckSteps, ckEvery = 8, 3
)

// protocolV2 runs the v2 checks the session's features call for.
func (c *checker) protocolV2(ctx context.Context, reg *Registration) []CheckResult {
	if reg.Version < Version2 {
		return []CheckResult{{Name: "protocol v2", Skip: true, Detail: fmt.Sprintf("the engine negotiated protocol v%d: checkpoints and the tensor cache are not checked", reg.Version)}}
	}
	m, ok := denoiser(reg)
	if !ok {
		return []CheckResult{{Name: "protocol v2", Skip: true, Detail: "the engine serves no denoise, the stage the v2 features are for"}}
	}
	var out []CheckResult
	if _, ok := reg.Checkpoints(m.Name); ok {
		ck, cks := c.checkpoints(ctx, m)
		out = append(out, ck)
		if ck.Pass {
			out = append(out, c.resume(ctx, m, cks))
		} else {
			out = append(out, CheckResult{Name: "resume", Skip: true, Detail: "the checkpoint check failed, so there is nothing to resume"})
		}
		out = append(out, c.stopCheck(ctx, m))
	} else {
		why := fmt.Sprintf("model %s declares no checkpoint", m.Name)
		if !reg.Supports(FeatureCheckpoint) {
			why = fmt.Sprintf("the engine did not ask for the %q feature", FeatureCheckpoint)
		}
		for _, n := range []string{"checkpoint", "resume", "stop"} {
			out = append(out, CheckResult{Name: n, Skip: true, Detail: why})
		}
	}
	if m.TensorCache {
		out = append(out, c.tensorCache(ctx, reg.Engine, m))
	} else {
		why := fmt.Sprintf("model %s does not declare tensor_cache", m.Name)
		if !reg.Supports(FeatureTensorCache) {
			why = fmt.Sprintf("the engine did not ask for the %q feature", FeatureTensorCache)
		}
		out = append(out, CheckResult{Name: "tensor cache", Skip: true, Detail: why})
	}
	return out
}

// runDenoise runs r to its end: the output, the checkpoints taken, and the
// last step reported.
type denoiseRun struct {
	out      []byte
	cks      []Checkpoint
	lastStep int
	err      error
}

func (c *checker) runDenoise(ctx context.Context, r Request) denoiseRun {
	var run denoiseRun
	var mu sync.Mutex // OnCheckpoint and Progress run on the reader goroutine
	r.OnCheckpoint = func(ck Checkpoint) {
		mu.Lock()
		defer mu.Unlock()
		if len(run.cks) < maxCheckSteps {
			run.cks = append(run.cks, ck.clone())
		}
	}
	r.Progress = func(step, _ int) {
		mu.Lock()
		defer mu.Unlock()
		run.lastStep = max(run.lastStep, step)
	}
	tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
	defer cancel()
	err := c.srv.Run(tctx, r)
	mu.Lock()
	defer mu.Unlock()
	run.err, run.out = err, r.Output.Data
	return run
}

// differ describes how got differs from want ("" when equal).
func differ(got, want []byte) string {
	if bytes.Equal(got, want) {
		return ""
	}
	n, first := 0, -1
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	return fmt.Sprintf("%d of %d bytes differ (first at byte %d)", n, len(want), first)
}

// steps lists the checkpoints' steps.
func steps(cks []Checkpoint) []int {
	var s []int
	for _, ck := range cks {
		s = append(s, ck.Step)
	}
	return s
}

// checkpoints runs an 8-step denoise without checkpoints, then twice
// asking for one every 3 steps, over complementary canaries in the
// checkpoint buffer: checkpoints must come after steps 3 and 6 exactly,
// their latents written whole and the same in both runs, and the output
// be the uninterrupted run's.
func (c *checker) checkpoints(ctx context.Context, m Model) (CheckResult, []Checkpoint) {
	const name = "checkpoint"
	want := []int{}
	for s := ckEvery; s < ckSteps; s += ckEvery {
		want = append(want, s)
	}
	plain, err := c.request(m, StageDenoise, ckSteps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}, nil
	}
	base := c.runDenoise(ctx, plain)
	if base.err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("an %d-step denoise without checkpoints failed: %v", ckSteps, base.err)}, nil
	}
	if len(base.cks) > 0 {
		return CheckResult{Name: name, Detail: fmt.Sprintf("an %d-step denoise asking for no checkpoint got checkpoints after steps %v: checkpoint only when checkpoint_every asks, or at a stop", ckSteps, steps(base.cks))}, nil
	}
	var runs [2]denoiseRun
	for i, flip := range []bool{false, true} {
		r, err := c.request(m, StageDenoise, ckSteps, 0)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}, nil
		}
		r.CheckpointEvery = ckEvery
		c.flip = flip
		runs[i] = c.runDenoise(ctx, r)
		c.flip = false
		run := runs[i]
		switch {
		case run.err != nil:
			return CheckResult{Name: name, Detail: fmt.Sprintf("an %d-step denoise with checkpoint_every %d failed: %v", ckSteps, ckEvery, run.err)}, nil
		case !slices.Equal(steps(run.cks), want):
			return CheckResult{Name: name, Detail: fmt.Sprintf("asked for a checkpoint every %d steps of %d, got checkpoints after steps %v, want %v (after every step k with k %% %d == 0, but the last)", ckEvery, ckSteps, steps(run.cks), want, ckEvery)}, nil
		}
		if d := differ(run.out, base.out); d != "" {
			return CheckResult{Name: name, Detail: fmt.Sprintf("with checkpoints every %d steps the output differs from the same denoise without: %s; taking a checkpoint must not change the run", ckEvery, d)}, nil
		}
	}
	a, b := runs[0].cks[0], runs[1].cks[0]
	switch unwritten, diff, first := compareRuns(a.Latent, b.Latent); {
	case unwritten > 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("the checkpoint after step %d left %d of its latent's %d bytes unwritten (first at byte %d): they kept the check's fill in two runs over different fills; write the whole checkpoint_buf", a.Step, unwritten, len(a.Latent), first)}, nil
	case diff > 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("the checkpoint after step %d differs between two runs of the same task in %d of its latent's %d bytes (first at byte %d): a checkpoint must be deterministic", a.Step, diff, len(a.Latent), first)}, nil
	}
	c.saved, c.savedWant = &runs[0].cks[len(runs[0].cks)-1], base.out
	c.savedReq = func() (Request, error) { return c.request(m, StageDenoise, ckSteps, 0) }
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("checkpoints after steps %v of %d (state %d bytes, latent %d bytes written whole), the output unchanged", want, ckSteps, len(a.State), len(a.Latent))}, runs[0].cks
}

// resumeOnto runs r resumed from ck, and says how it went wrong ("" if not).
func (c *checker) resumeOnto(ctx context.Context, r Request, ck Checkpoint, want []byte) string {
	canary(r.Output.Data, ck.Step%2 == 1)
	r.Resume = &ck
	run := c.runDenoise(ctx, r)
	switch {
	case run.err != nil:
		return fmt.Sprintf("a resume from the checkpoint after step %d of %d failed: %v", ck.Step, ck.Total, run.err)
	case run.lastStep != r.Spec.Steps:
		return fmt.Sprintf("resumed from the checkpoint after step %d, done, but progress reached step %d of %d", ck.Step, run.lastStep, r.Spec.Steps)
	}
	if d := differ(run.out, want); d != "" {
		return fmt.Sprintf("resumed from the checkpoint after step %d of %d, the output differs from an uninterrupted run's: %s; a resume must give the same bytes, from the state and latent alone", ck.Step, ck.Total, d)
	}
	return ""
}

// resume resumes from each checkpoint of the checkpoint check: the output
// must be the uninterrupted run's, byte for byte.
func (c *checker) resume(ctx context.Context, m Model, cks []Checkpoint) CheckResult {
	const name = "resume"
	for _, ck := range cks {
		r, err := c.request(m, StageDenoise, ckSteps, 0)
		if err != nil {
			return CheckResult{Name: name, Detail: err.Error()}
		}
		if why := c.resumeOnto(ctx, r, ck, c.savedWant); why != "" {
			return CheckResult{Name: name, Detail: why}
		}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("from the checkpoints after steps %v of %d: each output byte-identical to the uninterrupted run's", steps(cks), ckSteps)}
}

// stopCheck runs a long denoise and closes its Stop after step CancelAt:
// the engine must finish within one step, checkpoint the last step it
// did and end the task stopped; a resume from that checkpoint must give an
// uninterrupted run's bytes. Steps are sized as the cancel check's.
func (c *checker) stopCheck(ctx context.Context, m Model) CheckResult {
	const name = "stop"
	stopAt, lands := c.cfg.CancelAt, c.cfg.CancelLands
	steps := c.cfg.Steps
	if d := c.stepTime[m.Name]; d > 0 {
		steps = max(steps, stopAt+1+int(3*lands/max(d, time.Microsecond))+1)
	}
	steps = min(steps, stepLimit(m))
	if steps < stopAt+2 {
		return CheckResult{Name: name, Inconclusive: true, Detail: fmt.Sprintf("the model allows %d steps, which leaves no step after a stop at step %d; run with a smaller --cancel-at", steps, stopAt)}
	}
	r, err := c.request(m, StageDenoise, steps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	stop := make(chan struct{})
	var (
		mu sync.Mutex
		// mu guards the fields below (the reader goroutine's callbacks).
		maxStep, stopStep = 0, -1
		sentAt, lateAt    time.Time
		late              = -1
		cks               []Checkpoint
	)
	r.Stop = stop
	r.Progress = func(step, _ int) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		maxStep = max(maxStep, step)
		if stopStep >= 0 && step > stopStep+1 && now.Sub(sentAt) > lands && late < 0 {
			late, lateAt = step, now
		}
		if step >= stopAt && stopStep < 0 {
			stopStep, sentAt = step, now
			close(stop)
		}
	}
	r.OnCheckpoint = func(ck Checkpoint) {
		mu.Lock()
		defer mu.Unlock()
		if len(cks) < maxCheckSteps {
			cks = append(cks, ck.clone())
		}
	}
	tctx, cancel := context.WithTimeout(ctx, c.cfg.TaskTimeout)
	err = c.srv.Run(tctx, r)
	cancel()
	mu.Lock()
	defer mu.Unlock()
	ms := time.Millisecond
	switch {
	case stopStep < 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("the engine reported no step %d of %d (last %d; %v)", stopAt, steps, maxStep, err)}
	case late >= 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped after step %d of %d, but the engine went on to step %d (it must stop within one step); step %d came %v after the stop was sent", stopStep, steps, maxStep, late, lateAt.Sub(sentAt).Round(ms))}
	case err == nil && maxStep > stopStep+1:
		return CheckResult{Name: name, Inconclusive: true, Detail: fmt.Sprintf("stopped after step %d of %d, but the engine finished within %v of the stop, sooner than a stop can be counted on to reach it (%v): the check cannot tell whether it stops; run with more --steps", stopStep, steps, lands, lands)}
	case err == nil:
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped after step %d of %d, the engine finished the task instead of ending it stopped (failed, code %q) at a checkpoint", stopStep, steps, CodeStopped)}
	case !errors.Is(err, ErrStopped):
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped after step %d of %d, the task ended with %v, want failed with code %q after a checkpoint", stopStep, steps, err, CodeStopped)}
	case len(cks) == 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped after step %d of %d at step %d, but sent no checkpoint: a stop must checkpoint the last step done, or the agent redoes every step", stopStep, steps, maxStep)}
	}
	last := cks[len(cks)-1]
	if last.Step != maxStep {
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped at step %d (its last progress), but its last checkpoint is after step %d: a stop must checkpoint the last step done", maxStep, last.Step)}
	}
	full, err := c.request(m, StageDenoise, steps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	base := c.runDenoise(ctx, full)
	if base.err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("stopped and checkpointed, but an uninterrupted %d-step run to compare with failed: %v", steps, base.err)}
	}
	again, err := c.request(m, StageDenoise, steps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	if why := c.resumeOnto(ctx, again, last, base.out); why != "" {
		return CheckResult{Name: name, Detail: "stopped and checkpointed; " + why}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("stopped after step %d of %d, ended at step %d with its checkpoint; resumed from it, the output equals an uninterrupted run's", stopStep, steps, last.Step)}
}

// recordingCache is the tensor cache check's TensorCache: an in-memory
// map that records what the engine asked for and put.
type recordingCache struct {
	mu sync.Mutex
	// mu guards the fields below.
	m          map[string][]byte
	gets, hits []string
	puts       []string
}

func (rc *recordingCache) Get(key string) ([]byte, bool) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	v, ok := rc.m[key]
	if len(rc.gets) < maxCheckSteps {
		rc.gets = append(rc.gets, key)
		if ok {
			rc.hits = append(rc.hits, key)
		}
	}
	return v, ok
}

func (rc *recordingCache) Put(key string, v []byte) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.m) < maxCheckSteps {
		rc.m[key] = v
	}
	if len(rc.puts) < maxCheckSteps {
		rc.puts = append(rc.puts, key)
	}
}

// take returns and forgets what was recorded, the engine's and model's
// prefix cut.
func (rc *recordingCache) take(engine, model string) (gets, hits, puts []string) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	cut := func(ks []string) []string {
		var out []string
		for _, k := range ks {
			out = append(out, strings.TrimPrefix(k, cacheKey(engine, model, "")))
		}
		return out
	}
	gets, hits, puts = cut(rc.gets), cut(rc.hits), cut(rc.puts)
	rc.gets, rc.hits, rc.puts = nil, nil, nil
	return gets, hits, puts
}

// tensorCache runs a denoise without a cache, then twice with one cache
// (the same negative prompt): the first must put what it computed, the
// second get those back, and every output be the uncached one.
func (c *checker) tensorCache(ctx context.Context, engine string, m Model) CheckResult {
	const name = "tensor cache"
	plain, err := c.request(m, StageDenoise, taskSteps, 0)
	if err != nil {
		return CheckResult{Name: name, Detail: err.Error()}
	}
	base := c.runDenoise(ctx, plain)
	if base.err != nil {
		return CheckResult{Name: name, Detail: fmt.Sprintf("a denoise without a tensor cache failed: %v", base.err)}
	}
	rc := &recordingCache{m: map[string][]byte{}}
	// cached runs a denoise with rc and says how it went wrong ("" if not).
	cached := func(what string) (gets, hits, puts []string, why string) {
		r, err := c.request(m, StageDenoise, taskSteps, 0)
		if err != nil {
			return nil, nil, nil, err.Error()
		}
		r.Tensors = rc
		got := c.runDenoise(ctx, r)
		gets, hits, puts = rc.take(engine, m.Name)
		if got.err != nil {
			return gets, hits, puts, fmt.Sprintf("a denoise with %s failed: %v", what, got.err)
		}
		if d := differ(got.out, base.out); d != "" {
			return gets, hits, puts, fmt.Sprintf("with %s the output differs from a run without a cache: %s; a cached tensor must be exactly what the engine computes", what, d)
		}
		return gets, hits, puts, ""
	}
	gets, _, puts, why := cached("an empty tensor cache")
	switch {
	case why != "":
		return CheckResult{Name: name, Detail: why}
	case len(puts) == 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("model %s declares tensor_cache, but a denoise with an empty cache put no tensor (it asked for %v)", m.Name, gets)}
	}
	gets, hits, _, why := cached("the tensors the first run put")
	switch {
	case why != "":
		return CheckResult{Name: name, Detail: why}
	case len(hits) == 0:
		return CheckResult{Name: name, Detail: fmt.Sprintf("a second denoise with the same conditioning asked for %v and got none of the tensors the first put (%v): nothing was reused", gets, puts)}
	}
	return CheckResult{Name: name, Pass: true, Detail: fmt.Sprintf("put %v with an empty cache, got %v back in the next denoise; the output the same bytes as without a cache", shortKeys(puts), shortKeys(hits))}
}

// shortKeys cuts long keys (a hash in each, typically) for a check line.
func shortKeys(ks []string) []string {
	const keep = 32
	out := make([]string, len(ks))
	for i, k := range ks {
		if len(k) > keep {
			k = k[:keep] + "..."
		}
		out[i] = k
	}
	return out
}
