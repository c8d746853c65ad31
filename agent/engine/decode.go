package engine

import (
	"bytes"
	"context"
	"fmt"
	"image"
	"image/color"
	"image/color/palette"
	"image/draw"
	"image/gif"
	"image/png"
	"math"
	"sync"
	"time"
)

// Content types Decode returns.
const (
	ContentTypePNG = "image/png"
	ContentTypeGIF = "image/gif"
)

const (
	vaeScale  = 8 // pixels per latent position along each side
	texCell   = 4 // pixels per cell of the decoder's fine texture
	gifDelay  = 8 // centiseconds per GIF frame: 12.5 frames per second
	texAmount = 0.025
)

// Decode turns a latent (Denoise's output) into a file: a PNG for images, a
// looping animated GIF for videos. It gives exactly the bytes of a
// FrameDecoder fed every frame.
func (e *Engine) Decode(ctx context.Context, s Spec, latent Tensor) (out []byte, contentType string, err error) {
	d, err := e.NewFrameDecoder(s)
	if err != nil {
		return nil, "", err
	}
	if _, err := e.checkLatent(s, latent); err != nil {
		return nil, "", err
	}
	if err := d.DecodeFrames(ctx, 0, latent.Data); err != nil {
		return nil, "", err
	}
	return d.Finish()
}

// FrameDecoder decodes a video latent frame by frame, so decoding can start
// on the first chunk while later ones are still in flight. Frames may arrive
// in any order and from several goroutines; Finish assembles the file.
type FrameDecoder struct {
	e          *Engine
	s          Spec
	h, w       int // latent size
	frameBytes int
	tex        []float64 // (H/texCell+2) x (W/texCell+2) lattice of texture values

	mu sync.Mutex
	// mu guards the fields below.
	rgb  *image.RGBA       // the picture, for a single-frame Spec
	pal  []*image.Paletted // the frames, for a video
	have []bool
	left int
}

// NewFrameDecoder prepares to decode the latent of s.
func (e *Engine) NewFrameDecoder(s Spec) (*FrameDecoder, error) {
	if err := e.checkSpec(s); err != nil {
		return nil, err
	}
	h, w := s.Height/vaeScale, s.Width/vaeScale
	d := &FrameDecoder{
		e: e, s: s, h: h, w: w,
		frameBytes: 4 * e.cfg.LatentChannels * h * w,
		have:       make([]bool, s.Frames),
		left:       s.Frames,
	}
	if s.Frames > 1 {
		d.pal = make([]*image.Paletted, s.Frames)
	}
	tw, th := s.Width/texCell+2, s.Height/texCell+2
	d.tex = make([]float64, tw*th)
	for i := range d.tex {
		d.tex[i] = float64(2*uniform(hash4(e.cfg.TableSeed, saltTexture, uint64(i%tw), uint64(i/tw)))) - 1
	}
	return d, nil
}

// FrameBytes is the size of one frame of the latent.
func (d *FrameDecoder) FrameBytes() int { return d.frameBytes }

// DecodeFrames decodes whole frames firstFrame, firstFrame+1, ... from a
// contiguous byte range of the frame-major latent. Decoding a frame twice is
// harmless.
func (d *FrameDecoder) DecodeFrames(ctx context.Context, firstFrame int, frames []byte) error {
	if d.e == nil {
		return fmt.Errorf("%w: a frame sink takes pixels (PutRGBA), not latents", ErrBadTensor)
	}
	if len(frames) == 0 || len(frames)%d.frameBytes != 0 {
		return fmt.Errorf("%w: %d bytes is not a whole number of %d-byte frames", ErrBadTensor, len(frames), d.frameBytes)
	}
	k := len(frames) / d.frameBytes
	if firstFrame < 0 || firstFrame > d.s.Frames-k {
		return fmt.Errorf("%w: frames [%d,%d) outside [0,%d)", ErrBadTensor, firstFrame, firstFrame+k, d.s.Frames)
	}
	v, err := BytesFloat32(frames)
	if err != nil {
		return err
	}
	if err := checkFinite(v); err != nil {
		return err
	}
	cost := d.e.cfg.DecodeCost * time.Duration(k) / time.Duration(d.s.Frames)
	if err := Spend(ctx, cost); err != nil {
		return err
	}
	per := len(v) / k
	for i := range k {
		if err := ctx.Err(); err != nil {
			return err
		}
		d.store(firstFrame+i, d.render(v[i*per:(i+1)*per]))
	}
	return nil
}

// store keeps frame f, rendered as img: as it is for a picture, dithered to
// the GIF palette for a video.
func (d *FrameDecoder) store(f int, img *image.RGBA) {
	var pimg *image.Paletted
	if d.pal != nil {
		pimg = image.NewPaletted(img.Rect, palette.Plan9)
		draw.FloydSteinberg.Draw(pimg, img.Rect, img, image.Point{})
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if pimg != nil {
		d.pal[f] = pimg
	} else {
		d.rgb = img
	}
	if !d.have[f] {
		d.have[f] = true
		d.left--
	}
}

// NewFrameSink prepares to assemble the file of s from frames rendered
// elsewhere (an external engine's decoder) and handed in as RGBA pixels
// with PutRGBA. Finish then encodes them exactly as a FrameDecoder of the
// built-in engine would: same PNG settings, same palette and dithering for
// GIF, so equal pixels give equal files.
func NewFrameSink(s Spec, l Limits) (*FrameDecoder, error) {
	if err := s.Validate(l); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadSpec, err)
	}
	d := &FrameDecoder{s: s, h: s.Height / vaeScale, w: s.Width / vaeScale, have: make([]bool, s.Frames), left: s.Frames}
	if s.Frames > 1 {
		d.pal = make([]*image.Paletted, s.Frames)
	}
	return d, nil
}

// PutRGBA stores frame f from its pixels: Height rows of Width RGBA pixels,
// 4 bytes each (what image.RGBA holds). pix is copied.
func (d *FrameDecoder) PutRGBA(f int, pix []byte) error {
	if f < 0 || f >= d.s.Frames {
		return fmt.Errorf("%w: frame %d outside [0,%d)", ErrBadTensor, f, d.s.Frames)
	}
	if want := 4 * d.s.Width * d.s.Height; len(pix) != want {
		return fmt.Errorf("%w: frame of %d bytes, want %d (%dx%d RGBA)", ErrBadTensor, len(pix), want, d.s.Width, d.s.Height)
	}
	img := image.NewRGBA(image.Rect(0, 0, d.s.Width, d.s.Height))
	copy(img.Pix, pix)
	d.store(f, img)
	return nil
}

// Finish encodes the decoded frames. It fails with ErrMissingFrames unless
// every frame has been decoded.
func (d *FrameDecoder) Finish() ([]byte, string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.left > 0 {
		var missing []int
		for f, ok := range d.have {
			if !ok {
				missing = append(missing, f)
			}
		}
		return nil, "", fmt.Errorf("%w: %d of %d, first %d", ErrMissingFrames, len(missing), d.s.Frames, missing[0])
	}
	var buf bytes.Buffer
	if d.pal == nil {
		if err := pngEncoder.Encode(&buf, d.rgb); err != nil {
			return nil, "", fmt.Errorf("engine: encode png: %w", err)
		}
		return buf.Bytes(), ContentTypePNG, nil
	}
	g := &gif.GIF{
		Image:     d.pal,
		Delay:     make([]int, len(d.pal)),
		LoopCount: 0, // forever
		Config:    image.Config{ColorModel: color.Palette(palette.Plan9), Width: d.s.Width, Height: d.s.Height},
	}
	for i := range g.Delay {
		g.Delay[i] = gifDelay
	}
	if err := gif.EncodeAll(&buf, g); err != nil {
		return nil, "", fmt.Errorf("engine: encode gif: %w", err)
	}
	return buf.Bytes(), ContentTypeGIF, nil
}

// render is the "VAE decoder" for one frame (C x h x w values): bilinear 8x
// upsampling, a fixed linear map from latent channels to RGB, a fine
// texture whose strength channel 3 sets, and a soft sigmoid into 0..255.
func (d *FrameDecoder) render(lat []float32) *image.RGBA {
	W, H := d.s.Width, d.s.Height
	h, w, nc := d.h, d.w, d.e.cfg.LatentChannels
	plane := h * w
	img := image.NewRGBA(image.Rect(0, 0, W, H))
	xi0, xi1, xf := upsampleTaps(W, w)
	yi0, yi1, yf := upsampleTaps(H, h)
	tw := W/texCell + 2
	v := make([]float64, nc)
	for Y := range H {
		ty, tfy := Y/texCell, smoothstep(float64(Y%texCell)/texCell)
		for X := range W {
			for c := range nc {
				p := lat[c*plane : (c+1)*plane]
				top := lerp(float64(p[yi0[Y]*w+xi0[X]]), float64(p[yi0[Y]*w+xi1[X]]), xf[X])
				bot := lerp(float64(p[yi1[Y]*w+xi0[X]]), float64(p[yi1[Y]*w+xi1[X]]), xf[X])
				v[c] = lerp(top, bot, yf[Y])
			}
			tx, tfx := X/texCell, smoothstep(float64(X%texCell)/texCell)
			t0 := lerp(d.tex[ty*tw+tx], d.tex[ty*tw+tx+1], tfx)
			t1 := lerp(d.tex[(ty+1)*tw+tx], d.tex[(ty+1)*tw+tx+1], tfx)
			grain := lerp(t0, t1, tfy)
			luma := v[0]
			if nc > 3 {
				luma = mad(float64(texAmount*grain), 1+squash(v[3]), luma)
			}
			for c := 4; c < nc; c++ {
				luma = mad(0.05, v[c], luma)
			}
			r := luma + float64(1.2*v[1]) + float64(0.3*v[2])
			g := luma - float64(0.6*v[1]) + float64(0.45*v[2])
			b := luma - float64(0.15*v[1]) - float64(1.2*v[2])
			o := img.PixOffset(X, Y)
			img.Pix[o+0] = toByte(r)
			img.Pix[o+1] = toByte(g)
			img.Pix[o+2] = toByte(b)
			img.Pix[o+3] = 0xff
		}
	}
	return img
}

// upsampleTaps gives, for each of n output pixels, the two latent samples
// (of m) to interpolate between and the weight of the second, sampling at
// pixel centres as a bilinear resize does.
func upsampleTaps(n, m int) (i0, i1 []int, frac []float64) {
	i0, i1, frac = make([]int, n), make([]int, n), make([]float64, n)
	for o := range n {
		pos := clamp(float64((float64(o)+0.5)/vaeScale)-0.5, 0, float64(m-1))
		k := int(math.Floor(pos))
		i0[o], i1[o], frac[o] = k, min(k+1, m-1), pos-float64(k)
	}
	return i0, i1, frac
}

// toByte maps a decoded value through a soft sigmoid onto 0..255.
func toByte(v float64) uint8 {
	p := float64(127.5*squash(float64(1.1*v))) + 128
	return uint8(clamp(math.Floor(p), 0, 255))
}

// MaxPreviewSide bounds the longest side of a frame preview.
const MaxPreviewSide = 256

// FramePreview returns decoded frame f as a PNG, subsampled so its longest
// side is at most MaxPreviewSide: small enough to stream to a client while
// the rest of the video decodes. It fails if frame f is not decoded yet.
func (d *FrameDecoder) FramePreview(f int) ([]byte, error) {
	d.mu.Lock()
	var src image.Image
	switch {
	case f < 0 || f >= d.s.Frames || !d.have[f]:
		d.mu.Unlock()
		return nil, fmt.Errorf("%w: frame %d not decoded", ErrMissingFrames, f)
	case d.pal != nil:
		src = d.pal[f]
	default:
		src = d.rgb
	}
	d.mu.Unlock()
	step := 1
	for max(d.s.Width, d.s.Height)/step > MaxPreviewSide {
		step++
	}
	var out image.Image = src
	if step > 1 {
		b := src.Bounds()
		small := image.NewRGBA(image.Rect(0, 0, b.Dx()/step, b.Dy()/step))
		for y := range small.Rect.Dy() {
			for x := range small.Rect.Dx() {
				small.Set(x, y, src.At(x*step, y*step))
			}
		}
		out = small
	}
	var buf bytes.Buffer
	if err := pngEncoder.Encode(&buf, out); err != nil {
		return nil, fmt.Errorf("engine: encode preview: %w", err)
	}
	return buf.Bytes(), nil
}

// Generate runs the whole pipeline in this process: the reference the
// distributed pipeline must match byte for byte.
func (e *Engine) Generate(ctx context.Context, s Spec) ([]byte, string, error) {
	cond, err := e.Encode(ctx, s)
	if err != nil {
		return nil, "", err
	}
	lat, err := e.Denoise(ctx, s, cond, nil)
	if err != nil {
		return nil, "", err
	}
	return e.Decode(ctx, s, lat)
}

// pngEncoder writes every PNG the engine makes: at BestSpeed, because
// deflate at the default level was most of a small image's decode (9% of a
// tiny job's CPU in `bench api`), and with its zlib writers pooled, because
// each new one allocates and clears about 1 MB.
var pngEncoder = &png.Encoder{CompressionLevel: png.BestSpeed, BufferPool: &pngBuffers{}}

// pngBuffers is a png.EncoderBufferPool over a sync.Pool.
type pngBuffers struct{ p sync.Pool }

func (b *pngBuffers) Get() *png.EncoderBuffer {
	if e, ok := b.p.Get().(*png.EncoderBuffer); ok {
		return e
	}
	return nil
}

func (b *pngBuffers) Put(e *png.EncoderBuffer) { b.p.Put(e) }
