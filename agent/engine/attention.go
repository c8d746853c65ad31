package engine

import (
	"encoding/binary"
	"fmt"
	"math"
)

// The denoiser's cross-attention over the conditioning tokens, as a DiT
// (PixArt, SD3's text path) has it. Every layer projects each token of a
// branch's conditioning through a small context MLP into per-head keys and
// values; the latent, taken in patches as a DiT takes it, asks its queries
// from each patch's blurred latent and position; each branch's attention
// output, interpolated back to latent positions, is added to that branch's
// prediction before guidance. It draws a prompt-dependent colour texture
// over the scene, gentle enough to leave the scene's look alone.
//
// The keys and values depend on the conditioning alone, not on the latent or
// the step, yet a DiT recomputes them every step; so does the sampler, unless
// DenoiseOptions.KV caches the unconditional branch's across requests.
const (
	attnLayers = 2 // layers, each with its own projections
	attnHeads  = 2 // heads per layer
	attnKeyDim = 8 // query/key width of a head
	attnHidden = 8 // width of the context embedder that feeds every layer's keys and values
	attnPatch  = 4 // latent positions per side of a query patch
	attnPosDim = 4 // positional query features: sin, cos of x and y
	// attnSharp sharpens the softmax beyond 1/sqrt(keyDim), so a patch
	// favours a few tokens and the texture follows the words.
	attnSharp = 2.0
	// attnGain is the RMS size of the attention output in latent units:
	// a tint and texture, well below the scene's colours.
	attnGain = 0.25
	// attnFloor is the lowest softmax exponent kept; exp(-40) is below
	// anything float32 output shows.
	attnFloor = -40.0
)

// crossAttn holds the attention's weights, generated from TableSeed like the
// other tables. Read-only after newCrossAttn.
type crossAttn struct {
	d, nc, n int // embedding width, latent channels, tokens per branch
	nq       int // query features: nc latent channels + attnPosDim

	w1 []float64 // [hidden][d] the context embedder, shared by the layers
	b1 []float64 // [hidden]
	wk []float64 // [layer][head][keyDim][hidden]
	wv []float64 // [layer][head][nc][hidden]
	wq []float64 // [layer][head][keyDim][nq]
}

// kvWidth is the number of float64 values the keys and values of one token
// take in one head of one layer.
func (a *crossAttn) kvWidth() int { return attnKeyDim + a.nc }

// kvLen is the number of float64 values of one branch's keys and values:
// [layer][head][token][keyDim+nc], the key first.
func (a *crossAttn) kvLen() int { return attnLayers * attnHeads * a.n * a.kvWidth() }

// kvShape names the layout of a branch's keys and values, for cache keys.
func (a *crossAttn) kvShape() string {
	return fmt.Sprintf("L%dH%dk%dv%dT%dD%dh%d", attnLayers, attnHeads, attnKeyDim, a.nc, a.n, a.d, attnHidden)
}

func newCrossAttn(cfg Config) *crossAttn {
	a := &crossAttn{d: cfg.EmbedDim, nc: cfg.LatentChannels, n: cfg.MaxTokens}
	a.nq = a.nc + attnPosDim
	fill := func(salt uint64, n int, scale float64) []float64 {
		w := make([]float64, n)
		for i := range w {
			w[i] = float64(gauss(hash4(cfg.TableSeed, salt, uint64(i), 0)) * scale)
		}
		return w
	}
	a.w1 = fill(saltAttnW1, attnHidden*a.d, 1/math.Sqrt(float64(a.d)))
	a.b1 = fill(saltAttnB1, attnHidden, 0.5)
	// ReLU keeps about half of a unit-variance hidden layer's variance, so
	// twice the usual fan-in scale keeps keys and values near unit size.
	a.wk = fill(saltAttnK, attnLayers*attnHeads*attnKeyDim*attnHidden, math.Sqrt(2/float64(attnHidden)))
	a.wv = fill(saltAttnV, attnLayers*attnHeads*a.nc*attnHidden, math.Sqrt(2/float64(attnHidden)))
	a.wq = fill(saltAttnQ, attnLayers*attnHeads*attnKeyDim*a.nq, 1/math.Sqrt(float64(a.nq)))
	return a
}

// project writes the keys and values of one branch's conditioning rows
// (n x d float32, padding rows included, as a model with an attention mask
// still computes them) into kv, kvLen() long. hid is scratch of attnHidden.
func (a *crossAttn) project(kv []float64, rows []float32, hid []float64) {
	d, w := a.d, a.kvWidth()
	emb := make([]float64, d)
	for t := range a.n {
		for i, v := range rows[t*d : (t+1)*d] {
			emb[i] = float64(v)
		}
		for o := range attnHidden {
			hid[o] = max(0, dot(a.w1[o*d:(o+1)*d], emb, a.b1[o]))
		}
		for lh := range attnLayers * attnHeads {
			out := kv[(lh*a.n+t)*w : (lh*a.n+t+1)*w]
			wk := a.wk[lh*attnKeyDim*attnHidden : (lh+1)*attnKeyDim*attnHidden]
			for j := range attnKeyDim {
				out[j] = dot(wk[j*attnHidden:(j+1)*attnHidden], hid, 0)
			}
			wv := a.wv[lh*a.nc*attnHidden : (lh+1)*a.nc*attnHidden]
			for c := range a.nc {
				out[attnKeyDim+c] = dot(wv[c*attnHidden:(c+1)*attnHidden], hid, 0)
			}
		}
	}
}

// dot is acc + sum a[i]*b[i], every product rounded before it is added (no
// fused multiply-add), in four interleaved partial sums so the additions
// need not wait on each other. len(b) >= len(a).
func dot(a, b []float64, acc float64) float64 {
	b = b[:len(a)]
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(a); i += 4 {
		s0 += float64(a[i] * b[i])
		s1 += float64(a[i+1] * b[i+1])
		s2 += float64(a[i+2] * b[i+2])
		s3 += float64(a[i+3] * b[i+3])
	}
	for ; i < len(a); i++ {
		s0 += float64(a[i] * b[i])
	}
	return acc + ((s0 + s1) + (s2 + s3))
}

// tokensOf lists the non-padding rows of one branch's conditioning: the
// attention mask. The start token is never padding, so the list is never
// empty for Encode's output; an all-zero branch attends to row 0.
func tokensOf(rows []float32, n, d int) []int {
	var ids []int
	for t := range n {
		for _, v := range rows[t*d : (t+1)*d] {
			if v != 0 {
				ids = append(ids, t)
				break
			}
		}
	}
	if len(ids) == 0 {
		ids = []int{0}
	}
	return ids
}

// attnGrid is the patch grid of one latent frame: each patch's positional
// query features, and the scratch the attention of one frame uses.
type attnGrid struct {
	h, w, gh, gw int
	pos          []float64 // [patch][attnPosDim]
	q            []float64 // [layer][head][keyDim] queries of the current patch
	feat         []float64 // nq query features of the current patch
	score        []float64 // tokens
	outC, outU   []float64 // [patch][nc] attention output per branch
	rows, cols   []lerpAt  // where each latent row and column falls between patch centres
}

func (a *crossAttn) newGrid(h, w, tokens int) *attnGrid {
	g := &attnGrid{h: h, w: w, gh: (h + attnPatch - 1) / attnPatch, gw: (w + attnPatch - 1) / attnPatch}
	side := float64(max(h, w))
	np := g.gh * g.gw
	g.pos = make([]float64, np*attnPosDim)
	for py := range g.gh {
		for px := range g.gw {
			cx := float64(float64(px*attnPatch)+float64(attnPatch)/2) / side
			cy := float64(float64(py*attnPatch)+float64(attnPatch)/2) / side
			p := g.pos[(py*g.gw+px)*attnPosDim:]
			p[0], p[1] = dsin(float64(twoPi*cx)), dcos(float64(twoPi*cx))
			p[2], p[3] = dsin(float64(twoPi*cy)), dcos(float64(twoPi*cy))
		}
	}
	g.q = make([]float64, attnLayers*attnHeads*attnKeyDim)
	g.feat = make([]float64, a.nq)
	g.score = make([]float64, tokens)
	g.outC = make([]float64, np*a.nc)
	g.outU = make([]float64, np*a.nc)
	g.rows, g.cols = patchLerp(h, g.gh), patchLerp(w, g.gw)
	return g
}

// attend computes both branches' attention output for every patch of one
// frame, whose blurred latent is blur (nc planes of h x w), into g.outC and
// g.outU. kvC, kvU are the branches' keys and values, tokC, tokU their masks.
func (a *crossAttn) attend(g *attnGrid, blur []float64, kvC, kvU []float64, tokC, tokU []int) {
	plane := g.h * g.w
	for py := range g.gh {
		for px := range g.gw {
			p := py*g.gw + px
			// Queries from the blurred latent at the patch centre and the
			// patch's position.
			yc := min(py*attnPatch+attnPatch/2, g.h-1)
			xc := min(px*attnPatch+attnPatch/2, g.w-1)
			for c := range a.nc {
				g.feat[c] = blur[c*plane+yc*g.w+xc]
			}
			copy(g.feat[a.nc:], g.pos[p*attnPosDim:(p+1)*attnPosDim])
			for j := range g.q {
				g.q[j] = dot(a.wq[j*a.nq:(j+1)*a.nq], g.feat, 0)
			}
			a.attendBranch(g, kvC, tokC, g.outC[p*a.nc:(p+1)*a.nc])
			a.attendBranch(g, kvU, tokU, g.outU[p*a.nc:(p+1)*a.nc])
		}
	}
}

// attendBranch is one branch's multi-head, multi-layer attention output for
// the queries in g.q, written into out (nc values).
func (a *crossAttn) attendBranch(g *attnGrid, kv []float64, tok []int, out []float64) {
	clear(out)
	w := a.kvWidth()
	scale := attnSharp / math.Sqrt(attnKeyDim)
	// Each head's output has about unit RMS; the mean of independent heads
	// shrinks by sqrt(heads*layers), which the gain restores.
	gain := attnGain / math.Sqrt(attnLayers*attnHeads)
	for lh := range attnLayers * attnHeads {
		q := g.q[lh*attnKeyDim : (lh+1)*attnKeyDim]
		head := kv[lh*a.n*w : (lh+1)*a.n*w]
		top := math.Inf(-1)
		for i, t := range tok {
			s := float64(dot(q, head[t*w:t*w+attnKeyDim], 0) * scale)
			g.score[i] = s
			top = max(top, s)
		}
		var sum float64
		for i := range tok {
			e := dexp(g.score[i] - top)
			g.score[i] = e
			sum += e
		}
		inv := gain / sum
		for i, t := range tok {
			wt := float64(g.score[i] * inv)
			v := head[t*w+attnKeyDim : (t+1)*w]
			for c := range out {
				out[c] = mad(wt, v[c], out[c])
			}
		}
	}
}

// sample adds both branches' attention output at latent position (y, x),
// interpolated bilinearly between patch centres, to dc and du (nc values
// each).
func (g *attnGrid) sample(y, x int, dc, du []float64) {
	nc := len(dc)
	ry, rx := g.rows[y], g.cols[x]
	ty, tx := ry.t, rx.t
	i00, i01 := (ry.i0*g.gw+rx.i0)*nc, (ry.i0*g.gw+rx.i1)*nc
	i10, i11 := (ry.i1*g.gw+rx.i0)*nc, (ry.i1*g.gw+rx.i1)*nc
	for _, b := range [2]struct{ out, dst []float64 }{{g.outC, dc}, {g.outU, du}} {
		out, dst := b.out, b.dst
		for c := range dst {
			top := lerp(out[i00+c], out[i01+c], tx)
			bot := lerp(out[i10+c], out[i11+c], tx)
			dst[c] += lerp(top, bot, ty)
		}
	}
}

// lerpAt is where one latent row or column falls between two patch
// centres: patch indices i0, i1 (clamped at the edges) and the weight of i1.
type lerpAt struct {
	i0, i1 int
	t      float64
}

// patchLerp places the n latent positions of one side between the centres
// of its g patches.
func patchLerp(n, g int) []lerpAt {
	at := make([]lerpAt, n)
	for y := range at {
		f := float64(float64(y)+0.5)/attnPatch - 0.5
		i := int(math.Floor(f))
		at[y] = lerpAt{i0: min(max(i, 0), g-1), i1: min(max(i+1, 0), g-1), t: f - float64(i)}
	}
	return at
}

// dexp is a portable e^x for x <= 0 (softmax exponents after subtracting
// the largest): 2^k times a polynomial on the remainder, every operation
// exact IEEE arithmetic, accurate to about 1e-11. Below attnFloor it is 0.
func dexp(x float64) float64 {
	if !(x >= attnFloor) {
		return 0
	}
	const ln2 = 0.6931471805599453
	k := math.Floor(float64(x/ln2) + 0.5)
	r := x - float64(k*ln2) // |r| <= ln2/2
	p := 1.0 / 362880       // 1/9!: the next term is below 1e-11
	for _, c := range [...]float64{1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1, 1} {
		p = mad(p, r, c)
	}
	// k is in [-58, 0]: 2^k is a normal float64 built from its exponent bits.
	return float64(p * math.Float64frombits(uint64(int64(k)+1023)<<52))
}

// putFloat64s writes v as little-endian float64 bytes into dst.
func putFloat64s(dst []byte, v []float64) {
	for i, f := range v {
		binary.LittleEndian.PutUint64(dst[8*i:], math.Float64bits(f))
	}
}

// getFloat64s fills dst from 8*len(dst) little-endian bytes of src.
func getFloat64s(dst []float64, src []byte) {
	for i := range dst {
		dst[i] = math.Float64frombits(binary.LittleEndian.Uint64(src[8*i:]))
	}
}
