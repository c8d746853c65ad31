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
	nf, nc, h, w := s.Frames, e.cfg.LatentChannels, s.Height/8, s.Width/8
	side := float64(max(h, w))
	ew, eh := float64(w)/side, float64(h)/side

	n, d := e.cfg.MaxTokens, e.cfg.EmbedDim
	sceneC := e.newScene(pool(cv[:n*d], n, d), hasContent(cv[:n*d], n, d), ew, eh)
	sceneU := e.newScene(pool(cv[n*d:], n, d), hasContent(cv[n*d:], n, d), ew, eh)

	plane := h * w
	x := make([]float64, nf*nc*plane)
	e.noise(x, s.Seed, nf, nc, plane)
	radius := max(1, int(side)/8)
	// The layout field: the starting noise's two first channels, heavily
	// blurred and normalised, say where the scene is pushed and bent. It is
	// read once, while the latent is pure noise, and held by the sampler.
	warpX := make([]float64, nf*plane)
	warpY := make([]float64, nf*plane)
	coarse := make([]float64, plane)
	scratch := make([]float64, plane) // boxBlur's
	for f := range nf {
		fx := x[f*nc*plane : (f+1)*nc*plane]
		boxBlur(coarse, fx[0:plane], scratch, h, w, radius)
		normalise(warpX[f*plane:(f+1)*plane], coarse)
		boxBlur(coarse, fx[plane:2*plane], scratch, h, w, radius)
		normalise(warpY[f*plane:(f+1)*plane], coarse)
	}
	field := func(fx, fy float64) (float64, float64) {
		xi := min(max(int(fx*side), 0), w-1)
		yi := min(max(int(fy*side), 0), h-1)
		return warpX[yi*w+xi], warpY[yi*w+xi]
	}
	blobsC, blobsU := sceneC.place(field), sceneU.place(field)
	blur := make([]float64, nc*plane) // one frame: a step reads no other frame
	tc := make([]float64, nc)
	tu := make([]float64, nc)
	g := s.GuidanceScale

	for i := range s.Steps {
		if err := ctx.Err(); err != nil {
			return transfer.TensorMeta{}, err
		}
		t := 1 - float64(i)/float64(s.Steps)
		tn := 1 - float64(i+1)/float64(s.Steps)
		a, sg := schedule(t)
		an, sn := schedule(tn)
		keep := float64(keepStructure * t)
		last := i == s.Steps-1
		// Frames are independent within a step, so the step runs frame by
		// frame and the last one can hand each frame on as it completes.
		for f := range nf {
			fx := x[f*nc*plane : (f+1)*nc*plane]
			for c := range nc {
				boxBlur(blur[c*plane:(c+1)*plane], fx[c*plane:(c+1)*plane], scratch, h, w, radius)
			}
			for y := range h {
				for xx := range w {
					pos := y*w + xx
					px := float64(float64(xx)+0.5) / side
					py := float64(float64(y)+0.5) / side
					wx := mad(warpAmount, warpX[f*plane+pos], px)
					wy := mad(warpAmount, warpY[f*plane+pos], py)
					sceneC.eval(blobsC, f, wx, wy, tc)
					sceneU.eval(blobsU, f, wx, wy, tu)
					for c := range nc {
						k := c*plane + pos
						content := mad(g, tc[c]-tu[c], tu[c]) / guidanceRef
						x0 := mad(keep, blur[k], content)
						x0 = float64(latentLimit * squash(x0/latentLimit))
						eps := (fx[k] - float64(a*x0)) / sg
						fx[k] = mad(an, x0, float64(sn*eps))
					}
				}
			}
			if err := Spend(ctx, frameShare(e.cfg.StepCost, f, nf)); err != nil {
				return transfer.TensorMeta{}, err
			}
			if last {
				off, size := meta.ChunkRange(f)
				putFloat32s(dst[off:off+size], fx)
				if chunkDone != nil {
					chunkDone(f)
				}
			}
		}
		if progress != nil {
			progress(i+1, s.Steps)
		}
	}
	return meta, nil
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
