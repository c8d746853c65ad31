package engine

import "math"

// The "model" of the built-in engine predicts a clean latent from a noisy one.
// Its prompt-dependent part is a scene: a two-tone background split at a
// horizon, a stripe or ring pattern, and a few soft shaded blobs, all in a
// latent colour space (channel 0 luma, 1 red-green, 2 yellow-blue, 3 texture;
// further channels carry faint pattern detail). Every parameter is read off
// the random part of the pooled prompt embedding through a fixed random
// projection, so prompts sharing words share some of the picture; then the
// words the model knows, read off the embedding's semantic part
// (semantic.go), pull the scene towards what they mean: "a red fox in the
// snow" is a red shape on white, "ocean waves" blue level bands, "city at
// night, neon" bright shapes on dark. In videos blobs drift and bounce and
// the pattern travels, one step per frame.

const (
	maxBlobs      = 5
	sceneFeatures = 20 + 8*maxBlobs // see newScene for the layout
)

// newProjection draws the fixed sceneFeatures x n projection that turns the
// random part (the first n dimensions) of a pooled embedding into roughly
// standard-normal scene features.
func newProjection(cfg Config, n int) [][]float64 {
	inv := 1 / math.Sqrt(float64(n))
	p := make([][]float64, sceneFeatures)
	for k := range p {
		p[k] = make([]float64, n)
		for j := range p[k] {
			p[k][j] = float64(gauss(hash4(cfg.TableSeed, saltProj, uint64(k), uint64(j))) * inv)
		}
	}
	return p
}

type colour [3]float64 // luma, red-green, yellow-blue

type blob struct {
	cx, cy, r float64 // centre and radius at frame 0, in units of the longer side
	rx, ry    float64 // half-width and half-height: r stretched by the aspect
	square    float64 // 0 a disc (ellipse), 1 a rounded box
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
// extents in units of the longer side (one of them is 1). The random part of
// p draws a seeded-looking scene; the words it knows (readSense) then pull
// colours, shapes and pattern towards what they mean.
func (e *Engine) newScene(p []float64, on bool, w, h float64) *scene {
	f := make([]float64, sceneFeatures)
	for k := range f {
		var s float64
		for j, v := range p[:len(e.proj[k])] {
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
	for i := range sc.blobs {
		sc.blobs[i].rx, sc.blobs[i].ry = sc.blobs[i].r, sc.blobs[i].r
	}
	if r := len(e.proj[0]); r < len(p) {
		sc.apply(readSense(p[r:]), f)
	}
	return sc
}

// apply pulls the scene towards what the prompt's known words mean, each as
// far as its strength: the sky above the horizon and the ground below it,
// the object's colour, the number, size, shape and row of the blobs, water's
// horizontal bands, and a washed-out look. f are the scene features, for
// the small seeded variations that remain.
func (sc *scene) apply(m sense, f []float64) {
	u := func(k int) float64 { return unit(f[k]) }
	bg := max(m.skyS, m.groundS)
	for i := range sc.top {
		sc.top[i] = lerp(sc.top[i], m.sky[i], m.skyS)
		sc.bottom[i] = lerp(sc.bottom[i], m.ground[i], m.groundS)
	}
	if m.skyS > 0 && m.groundS > 0 {
		sc.soft = lerp(sc.soft, 0.12, bg)
	}
	// A known scene is calm: little of the seeded pattern remains, except
	// water's bands, which run level across the picture.
	calm := max(bg, m.objS, m.bands)
	sc.amp = lerp(sc.amp, lerp(0.05, 0.4, m.bands), calm)
	if m.bands > 0.5 {
		sc.rings = false
	}
	sc.dirX = lerp(sc.dirX, 0, m.bands)
	sc.dirY = lerp(sc.dirY, 1, m.bands)
	sc.freq = lerp(sc.freq, 7, m.bands)
	sc.bgTex = lerp(sc.bgTex, 0.2, calm)

	if s := m.shape.w; s > 0 {
		n := int(math.Floor(lerp(float64(len(sc.blobs)), m.shape.count, s) + 0.5))
		n = min(max(n, 1), maxBlobs)
		for len(sc.blobs) < n { // more than the seed drew: copies, moved on
			b := sc.blobs[len(sc.blobs)-1]
			b.cx = sc.w - b.cx
			sc.blobs = append(sc.blobs, b)
		}
		sc.blobs = sc.blobs[:n]
		asp := math.Sqrt(lerp(1, clamp(m.shape.aspect, 0.1, 10), s))
		for i := range sc.blobs {
			b := &sc.blobs[i]
			// In a row across the picture at the shape's height, a little
			// uneven as the seed says.
			cx := float64(sc.w * (float64(float64(i)+0.5) / float64(n)))
			if n > 1 {
				cx = float64(sc.w * (0.1 + float64(0.8*(float64(float64(i)+0.5)/float64(n)))))
			}
			cy := float64(sc.h * (m.shape.low + float64(0.08*(u(20+8*i+1)-0.5))))
			b.cx, b.cy = lerp(b.cx, cx, s), lerp(b.cy, cy, s)
			r := float64(m.shape.radius * (0.9 + float64(0.2*u(20+8*i+2))))
			b.r = lerp(b.r, r, s)
			b.rx, b.ry = b.r/asp, float64(b.r*asp)
			b.square = float64(m.shape.square * s)
			b.vx, b.vy = float64(b.vx*(1-float64(0.5*s))), float64(b.vy*(1-float64(0.5*s)))
		}
	}
	if s := float64(bg * (1 - m.objS)); s > 0 {
		// A place and no thing: what blobs remain are of the place, a
		// lighter tone of its ground (foam on water, drifts on snow).
		for i := range sc.blobs {
			want := m.ground
			if m.groundS < m.skyS {
				want = m.sky
			}
			want[0] += 0.7
			for k := range want {
				sc.blobs[i].col[k] = lerp(sc.blobs[i].col[k], want[k], s)
			}
		}
	}
	if m.objS > 0 {
		// The object's colour, its chroma turned a little further for each
		// further blob as far as the prompt asks for variety.
		for i := range sc.blobs {
			ang := float64(twoPi * float64(float64(0.3*m.variety)*float64(i)))
			c, s := dcos(ang), dsin(ang)
			want := colour{m.obj[0], float64(m.obj[1]*c) - float64(m.obj[2]*s), mad(m.obj[1], s, float64(m.obj[2]*c))}
			if m.variety > 0 {
				want[0] = mad(0.15, float64(m.variety*float64(i%2)), want[0])
			}
			for k := range want {
				sc.blobs[i].col[k] = lerp(sc.blobs[i].col[k], want[k], m.objS)
			}
			sc.blobs[i].tex = lerp(sc.blobs[i].tex, 0.3, m.objS)
		}
	}
	if m.flat > 0 {
		keep := 1 - float64(0.85*m.flat)
		fade := func(c *colour) {
			c[0] = float64(c[0] * (1 - float64(0.75*m.flat)))
			c[1], c[2] = float64(c[1]*keep), float64(c[2]*keep)
		}
		fade(&sc.top)
		fade(&sc.bottom)
		for i := range sc.blobs {
			fade(&sc.blobs[i].col)
		}
		sc.amp = float64(sc.amp * keep)
	}
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
		dx, dy := (x-cx)/b.rx, (y-cy)/b.ry
		qx, qy := float64(dx*dx), float64(dy*dy)
		q := qx + qy      // squared distance in radii: a disc
		if b.square > 0 { // towards the squared L8 norm: a rounded box
			qx2, qy2 := float64(qx*qx), float64(qy*qy)
			box := math.Sqrt(math.Sqrt(mad(qx2, qx2, float64(qy2*qy2))))
			q = lerp(q, box, b.square)
		}
		a := 1 / (1 + float64(float64(q*q)*q)) // ~1 inside, falling off at the rim
		hx, hy := dx+0.35, dy+0.35
		hq := mad(hx, hx, float64(hy*hy))
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
