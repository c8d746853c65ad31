package engine

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// Sampler and model constants. They are part of the algorithm: changing any
// of them changes output bytes and needs a new version.
const (
	// guidanceRef is the guidance scale at which the model's content reaches
	// full strength; the model scales its prompt content by 1/guidanceRef so
	// that the default scale gives a fully saturated picture, scale 1 a
	// washed-out one and scale 0 only the unconditional structure.
	guidanceRef = 5.0
	// keepStructure is how much of the blurred noisy latent the model keeps
	// at t=1, falling linearly to none at t=0: the low frequencies of the
	// trajectory tint the picture without leaving noise in it.
	keepStructure = 0.6
	// warpAmount is how far (in units of the longer side) the blurred noisy
	// latent displaces the scene, which is how the seed moves the composition.
	warpAmount = 0.06
	// latentLimit soft-clips predictions (dynamic thresholding) so guidance
	// scales up to 30 saturate instead of overflowing.
	latentLimit = 2.5
	// frameCoherence is the share of each video frame's noise common to all
	// frames, so the composition does not jump from frame to frame.
	frameCoherence = 0.95
)

// Denoise runs s.Steps deterministic DDIM steps with classifier-free guidance
// from seeded noise, conditioned on cond (Encode's output). The result has
// LatentMeta(s). progress, if not nil, is called after every step; ctx is
// checked between steps and between the frames of a step.
func (e *Engine) Denoise(ctx context.Context, s Spec, cond Tensor, progress func(step, total int)) (Tensor, error) {
	if err := e.checkSpec(s); err != nil { // before sizing dst from s
		return Tensor{}, err
	}
	dst := make([]byte, e.LatentMeta(s).Bytes())
	meta, err := e.DenoiseInto(ctx, s, cond, dst, progress, nil)
	if err != nil {
		return Tensor{}, err
	}
	return Tensor{Meta: meta, Data: dst}, nil
}

// DenoiseInto is Denoise writing the latent into dst, which must be exactly
// LatentMeta(s).Bytes() long (an arena slot, say), instead of a new buffer.
// It returns the meta of what it wrote.
//
// The sampler works in private buffers and writes dst only during its last
// step, frame by frame in order. chunkDone(k), if not nil, is called as soon
// as chunk k (frame k of the frame-major latent, bytes
// LatentMeta(s).ChunkRange(k)) holds its final bytes, while later frames are
// still being computed, so a consumer may start sending or decoding chunk k
// at once; it is never written again. Both callbacks run on the calling
// goroutine and delay the sampler while they run: hand work off rather than
// doing it inline. progress(Steps, Steps) comes after the last chunkDone.
//
// On error dst holds unspecified bytes, chunks already reported included, and
// whatever was started on them must be abandoned.
func (e *Engine) DenoiseInto(ctx context.Context, s Spec, cond Tensor, dst []byte,
	progress func(step, total int), chunkDone func(k int)) (transfer.TensorMeta, error) {
	return e.DenoiseWith(ctx, s, cond, dst, DenoiseOptions{Progress: progress, ChunkDone: chunkDone})
}

// DenoiseOptions are DenoiseWith's optional hooks. The zero value is
// DenoiseInto without callbacks.
type DenoiseOptions struct {
	Progress  func(step, total int) // as DenoiseInto's progress
	ChunkDone func(k int)           // as DenoiseInto's chunkDone
	// Resume, if not nil, continues from this checkpoint instead of
	// starting from noise; progress then starts at Resume.Step+1. The spec's
	// seed, size and frames must be the checkpoint's. Its conditioning and
	// guidance may differ (a fork: the latent continues under the new
	// prompt), and so may Steps, which must exceed Resume.Step: with
	// Steps == Resume.Total the run is byte-identical to one never stopped;
	// otherwise it goes from the checkpoint's time to 0 in the steps left.
	Resume *Checkpoint
	// CheckpointEvery > 0: Checkpoint is called after every
	// CheckpointEvery-th step (counted from the start of the whole run,
	// resumed steps included), never after the last.
	CheckpointEvery int
	// Checkpoint receives checkpoints on the sampler goroutine; State is
	// freshly allocated for each call (the callee may keep it) and the
	// callee must return quickly (hand the write off).
	Checkpoint func(Checkpoint)
	// Stop, when closed, makes the sampler finish the step it is in, call
	// Checkpoint for that step (if at least one step is done and it is not
	// the last) and return ErrStopped. The sampler looks between steps: a
	// run whose last step is done finishes normally.
	Stop <-chan struct{}
	// KV, if not nil, caches the unconditional branch's attention keys and
	// values across requests: they depend only on the engine and the
	// negative prompt's half of cond. The output bytes are the same with
	// and without it.
	KV KVCache
}

// DenoiseWith is DenoiseInto with options: resuming from a checkpoint,
// taking checkpoints, stopping at one, and a cache. See DenoiseInto for dst,
// the callbacks and errors. A checkpoint that cannot be resumed for s is an
// ErrBadCheckpoint.
func (e *Engine) DenoiseWith(ctx context.Context, s Spec, cond Tensor, dst []byte, o DenoiseOptions) (transfer.TensorMeta, error) {
	if err := e.checkSpec(s); err != nil {
		return transfer.TensorMeta{}, err
	}
	meta := e.LatentMeta(s)
	if n := meta.Bytes(); int64(len(dst)) != n {
		return transfer.TensorMeta{}, fmt.Errorf("%w: denoise into %d bytes, latent needs %d", ErrBadTensor, len(dst), n)
	}
	cv, err := checkTensor("cond", cond, e.CondMeta().Shape)
	if err != nil {
		return transfer.TensorMeta{}, err
	}
	sm := e.newSampler(s, cv)
	// The layout field comes from the seed's noise even when resuming, as
	// the sampler held it; the checkpoint then supplies the latent.
	sm.noise()
	start := 0
	if o.Resume != nil {
		if start, err = sm.resume(o.Resume); err != nil {
			return transfer.TensorMeta{}, err
		}
	}
	sm.layout()
	sm.projectUncond(o.KV, cond.Data[len(cond.Data)/2:])
	checkpointed := -1 // the step last handed to o.Checkpoint
	emit := func(step int) {
		if o.Checkpoint != nil && step != checkpointed {
			o.Checkpoint(sm.checkpoint(step))
			checkpointed = step
		}
	}
	for i := start; i < s.Steps; i++ {
		if err := ctx.Err(); err != nil {
			return transfer.TensorMeta{}, err
		}
		select {
		case <-o.Stop:
			if i > 0 {
				emit(i)
			}
			return transfer.TensorMeta{}, ErrStopped
		default:
		}
		t, tn := sm.seg.at(i, s.Steps), sm.seg.at(i+1, s.Steps)
		last := i == s.Steps-1
		var out []byte
		var chunkDone func(int)
		if last {
			out, chunkDone = dst, o.ChunkDone
		}
		if err := sm.step(ctx, t, tn, out, chunkDone); err != nil {
			return transfer.TensorMeta{}, err
		}
		if o.Progress != nil {
			o.Progress(i+1, s.Steps)
		}
		if o.CheckpointEvery > 0 && (i+1)%o.CheckpointEvery == 0 && !last {
			emit(i + 1)
		}
	}
	return meta, nil
}

// sampler is one Denoise run's state. Only x changes from step to step;
// everything else derives from the spec, the conditioning and the seed (and
// seg, for a resumed run, from its checkpoint).
type sampler struct {
	e              *Engine
	s              Spec
	meta           transfer.TensorMeta
	nf, nc, h, w   int
	plane, radius  int
	side           float64
	x              []float64 // the latent, frame-major [nf][nc][h][w]
	seg            segment   // the part of the schedule the run follows
	warpX, warpY   []float64 // the layout field, [nf][h][w]
	condC, condU   []float32 // the two halves of cond, MaxTokens x EmbedDim each
	sceneC, sceneU *scene
	blobsC, blobsU []blob
	tokC, tokU     []int     // the attention masks
	kvC, kvU       []float64 // the branches' attention keys and values
	uncondFixed    bool      // kvU came from the cache or was computed once for the run
	grid           *attnGrid
	blur, scratch  []float64
	hid, tc, tu    []float64
}

func (e *Engine) newSampler(s Spec, cv []float32) *sampler {
	nf, nc, h, w := s.Frames, e.cfg.LatentChannels, s.Height/8, s.Width/8
	side := float64(max(h, w))
	n, d := e.cfg.MaxTokens, e.cfg.EmbedDim
	sm := &sampler{
		e: e, s: s, meta: e.LatentMeta(s),
		nf: nf, nc: nc, h: h, w: w, plane: h * w, radius: max(1, int(side)/8), side: side,
		condC: cv[:n*d], condU: cv[n*d:],
		seg: segment{start: 0, t: 1},
	}
	ew, eh := float64(w)/side, float64(h)/side
	sm.sceneC = e.newScene(pool(sm.condC, n, d), hasContent(sm.condC, n, d), ew, eh)
	sm.sceneU = e.newScene(pool(sm.condU, n, d), hasContent(sm.condU, n, d), ew, eh)
	sm.tokC, sm.tokU = tokensOf(sm.condC, n, d), tokensOf(sm.condU, n, d)
	sm.kvC = make([]float64, e.attn.kvLen())
	sm.kvU = make([]float64, e.attn.kvLen())
	sm.grid = e.attn.newGrid(h, w, max(len(sm.tokC), len(sm.tokU)))
	sm.x = make([]float64, nf*nc*sm.plane)
	sm.warpX = make([]float64, nf*sm.plane)
	sm.warpY = make([]float64, nf*sm.plane)
	sm.blur = make([]float64, nc*sm.plane) // one frame: a step reads no other frame
	sm.scratch = make([]float64, sm.plane) // boxBlur's
	sm.hid = make([]float64, attnHidden)
	sm.tc = make([]float64, nc)
	sm.tu = make([]float64, nc)
	return sm
}

// noise fills x with the seed's starting noise and reads the layout field
// off it: the noise's two first channels, heavily blurred and normalised,
// say where the scene is pushed and bent. The field is read once, while the
// latent is pure noise, and held by the sampler.
func (sm *sampler) noise() {
	sm.e.noise(sm.x, sm.s.Seed, sm.nf, sm.nc, sm.plane)
	coarse := make([]float64, sm.plane)
	for f := range sm.nf {
		fx := sm.x[f*sm.nc*sm.plane : (f+1)*sm.nc*sm.plane]
		boxBlur(coarse, fx[0:sm.plane], sm.scratch, sm.h, sm.w, sm.radius)
		normalise(sm.warpX[f*sm.plane:(f+1)*sm.plane], coarse)
		boxBlur(coarse, fx[sm.plane:2*sm.plane], sm.scratch, sm.h, sm.w, sm.radius)
		normalise(sm.warpY[f*sm.plane:(f+1)*sm.plane], coarse)
	}
}

// layout places the scenes' blobs by the layout field: the seed decides
// where things go, the prompt what they are.
func (sm *sampler) layout() {
	field := func(fx, fy float64) (float64, float64) {
		xi := min(max(int(fx*sm.side), 0), sm.w-1)
		yi := min(max(int(fy*sm.side), 0), sm.h-1)
		return sm.warpX[yi*sm.w+xi], sm.warpY[yi*sm.w+xi]
	}
	sm.blobsC, sm.blobsU = sm.sceneC.place(field), sm.sceneU.place(field)
}

// projectUncond takes the unconditional branch's keys and values from kv,
// or computes them and puts them there, when kv is set; then the steps use
// them as they are. Without kv every step recomputes them, as a DiT does.
// half is the negative prompt's half of cond, as bytes.
func (sm *sampler) projectUncond(kv KVCache, half []byte) {
	if kv == nil {
		return
	}
	sm.uncondFixed = true
	key := sm.e.kvKey(half)
	if b, ok := kv.Get(key); ok && decodeKV(sm.kvU, b) {
		return
	}
	sm.e.attn.project(sm.kvU, sm.condU, sm.hid)
	kv.Put(key, encodeKV(sm.kvU))
}

// step runs one DDIM step from time t to tn. When out is not nil it is the
// last step: each frame's final latent is written into out as float32 and
// chunkDone, if not nil, told.
func (sm *sampler) step(ctx context.Context, t, tn float64, out []byte, chunkDone func(int)) error {
	e, nc, plane, h, w := sm.e, sm.nc, sm.plane, sm.h, sm.w
	// The conditioning's keys and values, recomputed every step as a DiT
	// does, unless the unconditional branch's are held for the run.
	e.attn.project(sm.kvC, sm.condC, sm.hid)
	if !sm.uncondFixed {
		e.attn.project(sm.kvU, sm.condU, sm.hid)
	}
	a, sg := schedule(t)
	an, sn := schedule(tn)
	keep := float64(keepStructure * t)
	g := sm.s.GuidanceScale
	tc, tu := sm.tc, sm.tu
	// Frames are independent within a step, so the step runs frame by
	// frame and the last one can hand each frame on as it completes.
	for f := range sm.nf {
		fx := sm.x[f*nc*plane : (f+1)*nc*plane]
		for c := range nc {
			boxBlur(sm.blur[c*plane:(c+1)*plane], fx[c*plane:(c+1)*plane], sm.scratch, h, w, sm.radius)
		}
		e.attn.attend(sm.grid, sm.blur, sm.kvC, sm.kvU, sm.tokC, sm.tokU)
		for y := range h {
			for xx := range w {
				pos := y*w + xx
				px := float64(float64(xx)+0.5) / sm.side
				py := float64(float64(y)+0.5) / sm.side
				wx := mad(warpAmount, sm.warpX[f*plane+pos], px)
				wy := mad(warpAmount, sm.warpY[f*plane+pos], py)
				sm.sceneC.eval(sm.blobsC, f, wx, wy, tc)
				sm.sceneU.eval(sm.blobsU, f, wx, wy, tu)
				sm.grid.sample(y, xx, tc, tu)
				for c := range nc {
					k := c*plane + pos
					content := mad(g, tc[c]-tu[c], tu[c]) / guidanceRef
					x0 := mad(keep, sm.blur[k], content)
					x0 = float64(latentLimit * squash(x0/latentLimit))
					eps := (fx[k] - float64(a*x0)) / sg
					fx[k] = mad(an, x0, float64(sn*eps))
				}
			}
		}
		if err := Spend(ctx, frameShare(e.cfg.StepCost, f, sm.nf)); err != nil {
			return err
		}
		if out != nil {
			off, size := sm.meta.ChunkRange(f)
			putFloat32s(out[off:off+size], fx)
			if chunkDone != nil {
				chunkDone(f)
			}
		}
	}
	return nil
}

// frameShare is frame f's part of a step's simulated cost d, split over nf
// frames so that the parts sum to d exactly.
func frameShare(d time.Duration, f, nf int) time.Duration {
	share := d / time.Duration(nf)
	if f < int(d%time.Duration(nf)) {
		share++
	}
	return share
}

// schedule is the cosine variance-preserving schedule: at t=1 pure noise
// (alpha 0, sigma 1), at t=0 the clean latent.
func schedule(t float64) (alpha, sigma float64) {
	if t <= 0 {
		return 1, 0
	}
	if t >= 1 {
		return 0, 1
	}
	return dcos(float64(pi / 2 * t)), dsin(float64(pi / 2 * t))
}

// noise fills x with the starting latent for seed: unit Gaussian values, a
// pure function of (seed, frame, channel, position). Video frames share most
// of their noise so that the composition holds still across frames.
func (e *Engine) noise(x []float64, seed int64, nf, nc, plane int) {
	own := math.Sqrt(1 - frameCoherence*frameCoherence)
	s := uint64(seed)
	for f := range nf {
		for c := range nc {
			for p := range plane {
				v := gauss(hash4(s, math.MaxUint64, uint64(c), uint64(p)))
				if nf > 1 {
					v = mad(own, gauss(hash4(s, uint64(f), uint64(c), uint64(p))), float64(frameCoherence*v))
				}
				x[(f*nc+c)*plane+p] = v
			}
		}
	}
}

// hasContent reports whether an encoding holds more than the start token,
// i.e. whether it came from a non-empty prompt.
func hasContent(rows []float32, n, d int) bool {
	if n < 2 {
		return false
	}
	for _, v := range rows[d : 2*d] {
		if v != 0 {
			return true
		}
	}
	return false
}

// normalise writes src scaled to zero mean and unit deviation, clipped to
// [-3, 3], into dst. A flat src gives zeros.
func normalise(dst, src []float64) {
	var mean float64
	for _, v := range src {
		mean += v
	}
	mean /= float64(len(src))
	var ss float64
	for _, v := range src {
		ss = mad(v-mean, v-mean, ss)
	}
	sd := math.Sqrt(ss / float64(len(src)))
	if !(sd > 1e-9) {
		clear(dst)
		return
	}
	for i, v := range src {
		dst[i] = clamp((v-mean)/sd, -3, 3)
	}
}

// boxBlur writes src blurred by two passes of a (2r+1)-wide box filter in
// each direction (close to a Gaussian) into dst. Edges repeat. tmp is
// scratch space of len(src).
func boxBlur(dst, src, tmp []float64, h, w, r int) {
	copy(dst, src)
	for range 2 {
		for y := range h {
			blur1D(tmp[y*w:], dst[y*w:], w, 1, r)
		}
		for x := range w {
			blur1D(dst[x:], tmp[x:], h, w, r)
		}
	}
}

// blur1D box-filters n samples of src taken every stride into dst.
func blur1D(dst, src []float64, n, stride, r int) {
	at := func(i int) float64 { return src[min(max(i, 0), n-1)*stride] }
	var sum float64
	for i := -r; i <= r; i++ {
		sum += at(i)
	}
	inv := 1 / float64(2*r+1)
	for i := range n {
		dst[i*stride] = float64(sum * inv)
		sum += at(i+r+1) - at(i-r)
	}
}

// checkLatent validates a latent for s and returns its values.
func (e *Engine) checkLatent(s Spec, latent Tensor) ([]float32, error) {
	v, err := checkTensor("latent", latent, e.LatentMeta(s).Shape)
	if err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	return v, nil
}
