package engine

import (
	"context"
	"fmt"
	"math"
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
// checked between steps.
func (e *Engine) Denoise(ctx context.Context, s Spec, cond Tensor, progress func(step, total int)) (Tensor, error) {
	if err := e.checkSpec(s); err != nil {
		return Tensor{}, err
	}
	cv, err := checkTensor("cond", cond, e.CondMeta().Shape)
	if err != nil {
		return Tensor{}, err
	}
	meta := e.LatentMeta(s)
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
	for f := range nf {
		fx := x[f*nc*plane : (f+1)*nc*plane]
		boxBlur(coarse, fx[0:plane], h, w, radius)
		normalise(warpX[f*plane:(f+1)*plane], coarse)
		boxBlur(coarse, fx[plane:2*plane], h, w, radius)
		normalise(warpY[f*plane:(f+1)*plane], coarse)
	}
	field := func(fx, fy float64) (float64, float64) {
		xi := min(max(int(fx*side), 0), w-1)
		yi := min(max(int(fy*side), 0), h-1)
		return warpX[yi*w+xi], warpY[yi*w+xi]
	}
	blobsC, blobsU := sceneC.place(field), sceneU.place(field)
	blur := make([]float64, len(x))
	tc := make([]float64, nc)
	tu := make([]float64, nc)
	g := s.GuidanceScale

	for i := range s.Steps {
		if err := ctx.Err(); err != nil {
			return Tensor{}, err
		}
		t := 1 - float64(i)/float64(s.Steps)
		tn := 1 - float64(i+1)/float64(s.Steps)
		a, sg := schedule(t)
		an, sn := schedule(tn)
		keep := float64(keepStructure * t)
		for p := range nf * nc {
			boxBlur(blur[p*plane:(p+1)*plane], x[p*plane:(p+1)*plane], h, w, radius)
		}
		for f := range nf {
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
						k := (f*nc+c)*plane + pos
						content := mad(g, tc[c]-tu[c], tu[c]) / guidanceRef
						x0 := mad(keep, blur[k], content)
						x0 = float64(latentLimit * squash(x0/latentLimit))
						eps := (x[k] - float64(a*x0)) / sg
						x[k] = mad(an, x0, float64(sn*eps))
					}
				}
			}
		}
		if err := spend(ctx, e.cfg.StepCost); err != nil {
			return Tensor{}, err
		}
		if progress != nil {
			progress(i+1, s.Steps)
		}
	}
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = float32(v)
	}
	return newTensor(meta.Shape, meta.NumChunks, out), nil
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
// each direction (close to a Gaussian) into dst. Edges repeat.
func boxBlur(dst, src []float64, h, w, r int) {
	tmp := make([]float64, len(src))
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
