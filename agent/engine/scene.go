package engine

import "math"

// The "model" of the built-in engine predicts a clean latent from a noisy one.
// Its prompt-dependent part is a scene: a two-tone background split at a
// horizon, a stripe or ring pattern, and a few soft shaded blobs, all in a
// latent colour space (channel 0 luma, 1 red-green, 2 yellow-blue, 3 texture;
// further channels carry faint pattern detail). Every parameter is read off
// the pooled prompt embedding through a fixed random projection, so prompts
// sharing words share some of the picture. In videos blobs drift and bounce
// and the pattern travels, one step per frame.

const (
	maxBlobs      = 5
	sceneFeatures = 20 + 8*maxBlobs // see newScene for the layout
)

// newProjection draws the fixed sceneFeatures x EmbedDim projection that
// turns a pooled embedding into roughly standard-normal scene features.
func newProjection(cfg Config) [][]float64 {
	inv := 1 / math.Sqrt(float64(cfg.EmbedDim))
	p := make([][]float64, sceneFeatures)
	for k := range p {
		p[k] = make([]float64, cfg.EmbedDim)
		for j := range p[k] {
			p[k][j] = float64(gauss(hash4(cfg.TableSeed, saltProj, uint64(k), uint64(j))) * inv)
		}
	}
	return p
}

type colour [3]float64 // luma, red-green, yellow-blue

type blob struct {
	cx, cy, r float64 // centre and radius at frame 0, in units of the longer side
	vx, vy    float64 // drift per frame
	col       colour
	tex       float64
}

type scene struct {
	on               bool // false for the empty prompt: the model adds no content
	w, h             float64
	top, bottom      colour
	horizon, soft    float64
	bgTex            float64
	rings            bool
	freq, phaseSpeed float64
	dirX, dirY       float64 // stripe direction
	pcx, pcy         float64 // ring centre
	amp              float64
	blobs            []blob
}

// hueColour is a colour of the given luma, hue (turns) and saturation.
func hueColour(luma, hue, sat float64) colour {
	return colour{luma, float64(sat * dcos(float64(twoPi*hue))), float64(sat * dsin(float64(twoPi*hue)))}
}

// newScene reads a scene off pooled embedding p. w and h are the latent
// extents in units of the longer side (one of them is 1).
func (e *Engine) newScene(p []float64, on bool, w, h float64) *scene {
	f := make([]float64, sceneFeatures)
	for k := range f {
		var s float64
		for j, v := range p {
			s = mad(e.proj[k][j], v, s)
		}
		f[k] = s
	}
	u := func(k int) float64 { return unit(f[k]) }
	sc := &scene{on: on, w: w, h: h}
	hue := u(0) * 3 // spread the base hue over several turns: unit() bunches near 0.5
	spread := 0.08 + float64(0.3*u(16))
	sat := 0.8 + float64(0.7*u(1))
	sc.top = hueColour(-0.6+float64(1.4*u(2)), hue+float64(0.5*u(6)), float64(0.7*sat))
	sc.bottom = hueColour(-0.8+float64(1.2*u(3)), hue+0.5+float64(0.3*u(6)), sat)
	sc.horizon = (0.3 + float64(0.45*u(4))) * h
	sc.soft = 0.04 + float64(0.25*u(5))
	sc.bgTex = u(15)
	sc.rings = u(8) > 0.5
	sc.freq = 1.5 + float64(5*u(9))
	ang := float64(pi * u(10) * 2)
	sc.dirX, sc.dirY = dcos(ang), dsin(ang)
	sc.amp = 0.15 + float64(0.4*u(11))
	sc.phaseSpeed = float64(0.12 * squash(f[12]))
	sc.pcx, sc.pcy = float64(w*u(13)), float64(h*u(14))
	n := 2 + int(u(7)*float64(maxBlobs-1)) // 2..5
	for i := range n {
		b := 20 + 8*i
		sc.blobs = append(sc.blobs, blob{
			cx:  float64(w * (0.12 + float64(0.76*u(b)))),
			cy:  float64(h * (0.12 + float64(0.76*u(b+1)))),
			r:   0.1 + float64(0.2*u(b+2)),
			col: hueColour(-0.7+float64(1.6*u(b+4)), hue+float64(spread*float64(i+1))+float64(0.25*squash(f[b+3])), 0.9+float64(0.8*u(b+3))),
			vx:  float64(0.04 * squash(f[b+5])),
			vy:  float64(0.04 * squash(f[b+6])),
			tex: u(b + 7),
		})
	}
	return sc
}

// bounce folds x into [lo, hi] as a ball bouncing between two walls.
func bounce(x, lo, hi float64) float64 {
	span := hi - lo
	if span <= 0 {
		return lo
	}
	y := (x - lo) / float64(2*span)
	y -= math.Floor(y)
	y = float64(y * 2 * span)
	if y > span {
		y = float64(2*span) - y
	}
	return lo + y
}

// place returns the blob centres of frame 0 shifted by the layout field
// (field(x, y) gives the two field values near a point): the seed decides
// where things go, the prompt what they are.
func (sc *scene) place(field func(x, y float64) (float64, float64)) []blob {
	out := append([]blob(nil), sc.blobs...)
	for i := range out {
		dx, dy := field(out[i].cx, out[i].cy)
		out[i].cx = clamp(mad(blobShift, dx, out[i].cx), 0.05, sc.w-0.05)
		out[i].cy = clamp(mad(blobShift, dy, out[i].cy), 0.05, sc.h-0.05)
	}
	return out
}

// blobShift is how far (in units of the longer side) one standard
// deviation of the layout field moves a blob.
const blobShift = 0.18

// eval writes the scene's latent at (x, y) of frame into out (one value per
// latent channel), with the blobs placed as given.
func (sc *scene) eval(blobs []blob, frame int, x, y float64, out []float64) {
	clear(out)
	if !sc.on {
		return
	}
	fr := float64(frame)
	// Background: two tones across a soft horizon.
	m := smoothstep(float64((y-sc.horizon)/sc.soft) + 0.5)
	var col colour
	for i := range col {
		col[i] = lerp(sc.top[i], sc.bottom[i], m)
	}
	// Pattern: travelling stripes or rings, modulating luma and a little hue.
	var ph float64
	if sc.rings {
		dx, dy := x-sc.pcx, y-sc.pcy
		ph = math.Sqrt(mad(dx, dx, float64(dy*dy)))
	} else {
		ph = mad(x, sc.dirX, float64(y*sc.dirY))
	}
	pat := dsin(float64(twoPi * (mad(ph, sc.freq, float64(fr*sc.phaseSpeed)))))
	col[0] = mad(sc.amp, pat, col[0])
	col[1] = mad(float64(0.3*sc.amp), pat, col[1])
	tex := sc.bgTex
	// Blobs: soft discs with a highlight, painted back to front.
	for _, b := range blobs {
		cx := bounce(mad(b.vx, fr, b.cx), 0.05, sc.w-0.05)
		cy := bounce(mad(b.vy, fr, b.cy), 0.05, sc.h-0.05)
		dx, dy := x-cx, y-cy
		r2 := float64(b.r * b.r)
		q := mad(dx, dx, float64(dy*dy)) / r2
		a := 1 / (1 + float64(float64(q*q)*q)) // ~1 inside, falling off at the rim
		hx, hy := dx+float64(0.35*b.r), dy+float64(0.35*b.r)
		hq := mad(hx, hx, float64(hy*hy)) / r2
		shade := 0.5/(1+float64(4*hq)) - 0.25
		for i := range col {
			col[i] = lerp(col[i], b.col[i], a)
		}
		col[0] = mad(a, shade, col[0])
		tex = lerp(tex, b.tex, a)
	}
	out[0], out[1], out[2] = col[0], col[1], col[2]
	if len(out) > 3 {
		out[3] = float64(2*tex) - 1
	}
	for c := 4; c < len(out); c++ {
		out[c] = float64(0.5 * dsin(mad(float64(c), ph, float64(0.7*float64(c)))))
	}
}
