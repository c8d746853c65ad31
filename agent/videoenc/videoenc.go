// Package videoenc turns a video result as the engines commit it (an
// animated GIF) into what a client asks for: an H.264 MP4 (yuv420p, the
// profile every player takes) through the ffmpeg binary, or the first
// frame as a PNG thumbnail. The MP4 is derived at serve time from the
// durable GIF, so the pipeline's output bytes, and the Store object that
// holds them, stay as they are. It imports nothing of latentmesh; the
// client API (agent/httpapi) uses it.
package videoenc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"image"
	"image/draw"
	"image/gif"
	"image/png"
	"io"
	"os"
	"os/exec"
	"strconv"
	"time"
)

// Content types of what this package makes.
const (
	ContentTypeMP4 = "video/mp4"
	ContentTypePNG = "image/png"
)

// Sentinel errors.
var (
	// ErrNoFFmpeg means no ffmpeg binary was found: MP4 cannot be made.
	ErrNoFFmpeg = errors.New("videoenc: ffmpeg not found")
	// ErrBadGIF means the input is not a GIF within the caller's bounds.
	ErrBadGIF = errors.New("videoenc: bad gif")
)

// Bounds limit what Frames decodes, so that a file cannot make it allocate
// more than the engine's own limits allow.
type Bounds struct {
	MaxSide   int // pixels, each side
	MaxFrames int
	MaxPixels int // width*height*frames
}

// Frames decodes an animated GIF into full RGBA frames, composed as a
// player shows them (each frame drawn over the last, with its disposal). It
// checks the declared size against b before decoding any frame.
func Frames(data []byte, b Bounds) ([]*image.RGBA, error) {
	cfg, err := gif.DecodeConfig(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadGIF, err)
	}
	if cfg.Width < 1 || cfg.Height < 1 || cfg.Width > b.MaxSide || cfg.Height > b.MaxSide {
		return nil, fmt.Errorf("%w: %dx%d is outside [1,%d] a side", ErrBadGIF, cfg.Width, cfg.Height, b.MaxSide)
	}
	g, err := gif.DecodeAll(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadGIF, err)
	}
	n := len(g.Image)
	if n < 1 || n > b.MaxFrames || cfg.Width*cfg.Height*n > b.MaxPixels {
		return nil, fmt.Errorf("%w: %d frames of %dx%d is outside the bounds (%d frames, %d pixels)", ErrBadGIF, n, cfg.Width, cfg.Height, b.MaxFrames, b.MaxPixels)
	}
	rect := image.Rect(0, 0, cfg.Width, cfg.Height)
	canvas := image.NewRGBA(rect)
	out := make([]*image.RGBA, n)
	for i, fr := range g.Image {
		var before *image.RGBA
		if i < len(g.Disposal) && g.Disposal[i] == gif.DisposalPrevious {
			before = cloneRGBA(canvas)
		}
		draw.Draw(canvas, fr.Bounds(), fr, fr.Bounds().Min, draw.Over)
		out[i] = cloneRGBA(canvas)
		if i < len(g.Disposal) {
			switch g.Disposal[i] {
			case gif.DisposalBackground:
				draw.Draw(canvas, fr.Bounds(), image.Transparent, image.Point{}, draw.Src)
			case gif.DisposalPrevious:
				canvas = before
			}
		}
	}
	return out, nil
}

func cloneRGBA(m *image.RGBA) *image.RGBA {
	c := image.NewRGBA(m.Rect)
	copy(c.Pix, m.Pix)
	return c
}

// Thumbnail is the first frame of frames as a PNG.
func Thumbnail(frames []*image.RGBA) ([]byte, error) {
	if len(frames) == 0 {
		return nil, fmt.Errorf("%w: no frames", ErrBadGIF)
	}
	var buf bytes.Buffer
	if err := png.Encode(&buf, frames[0]); err != nil {
		return nil, fmt.Errorf("videoenc: png: %w", err)
	}
	return buf.Bytes(), nil
}

// Encoder makes MP4s with one ffmpeg binary, a bounded number at a time.
type Encoder struct {
	path    string
	timeout time.Duration
	slots   chan struct{}
}

// Config configures an Encoder.
type Config struct {
	// FFmpeg is the ffmpeg binary: a path, or a name looked up in $PATH.
	FFmpeg string
	// Parallel bounds the encodes run at once; more wait for a slot.
	Parallel int
	// Timeout bounds one encode, waiting for a slot included.
	Timeout time.Duration
}

// DefaultConfig returns a Config with every field set.
func DefaultConfig() Config {
	return Config{
		FFmpeg:   "ffmpeg",         // Debian's, on $PATH
		Parallel: 2,                // an encode takes a core; the agent's own work keeps the rest
		Timeout:  30 * time.Second, // a 64-frame 1024x1024 video encodes in seconds at the engine's limits
	}
}

// New finds cfg's ffmpeg; without one it returns ErrNoFFmpeg, and the
// caller serves GIF.
func New(cfg Config) (*Encoder, error) {
	d := DefaultConfig()
	if cfg.FFmpeg == "" {
		cfg.FFmpeg = d.FFmpeg
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = d.Parallel
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = d.Timeout
	}
	path, err := exec.LookPath(cfg.FFmpeg)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoFFmpeg, err)
	}
	return &Encoder{path: path, timeout: cfg.Timeout, slots: make(chan struct{}, cfg.Parallel)}, nil
}

// Path is the ffmpeg binary the encoder runs.
func (e *Encoder) Path() string { return e.path }

// MP4 encodes frames, all of one even-sided size, as an H.264 MP4 in
// yuv420p at fps frames a second: exactly len(frames) frames, moov atom
// first (faststart) so a browser plays it while it downloads. The frames go
// to ffmpeg's stdin as raw RGB; the MP4 is written to a temporary file
// (an MP4 muxer seeks back to write its index) and read back.
func (e *Encoder) MP4(ctx context.Context, frames []*image.RGBA, fps float64) ([]byte, error) {
	if len(frames) == 0 {
		return nil, fmt.Errorf("%w: no frames", ErrBadGIF)
	}
	r := frames[0].Rect
	w, h := r.Dx(), r.Dy()
	if w%2 != 0 || h%2 != 0 {
		return nil, fmt.Errorf("videoenc: %dx%d: yuv420p needs even sides", w, h)
	}
	for i, f := range frames {
		if f.Rect != r {
			return nil, fmt.Errorf("videoenc: frame %d is %v, frame 0 %v", i, f.Rect, r)
		}
	}
	if !(fps > 0 && fps <= 240) {
		return nil, fmt.Errorf("videoenc: frame rate %v: want (0,240]", fps)
	}
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	select {
	case e.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("videoenc: waiting for an encode slot: %w", ctx.Err())
	}
	defer func() { <-e.slots }()

	tmp, err := os.CreateTemp("", "latentmesh-*.mp4")
	if err != nil {
		return nil, fmt.Errorf("videoenc: %w", err)
	}
	out := tmp.Name()
	tmp.Close()
	defer os.Remove(out)

	cmd := exec.CommandContext(ctx, e.path,
		"-hide_banner", "-loglevel", "error", "-y",
		"-f", "rawvideo", "-pix_fmt", "rgb24", "-s", strconv.Itoa(w)+"x"+strconv.Itoa(h),
		"-framerate", strconv.FormatFloat(fps, 'f', -1, 64), "-i", "pipe:0",
		"-an", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-preset", "veryfast", "-crf", "18",
		"-threads", "1", // one core per encode; Parallel bounds the cores
		"-fflags", "+bitexact", "-flags:v", "+bitexact", "-map_metadata", "-1",
		"-movflags", "+faststart", "-f", "mp4", out)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("videoenc: %w", err)
	}
	var stderr tailBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("videoenc: start %s: %w", e.path, err)
	}
	werr := writeRGB(stdin, frames)
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("videoenc: ffmpeg: %w", ctx.Err())
		}
		return nil, fmt.Errorf("videoenc: ffmpeg: %v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	if werr != nil {
		return nil, fmt.Errorf("videoenc: writing frames to ffmpeg: %w", werr)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		return nil, fmt.Errorf("videoenc: %w", err)
	}
	return b, nil
}

// writeRGB writes frames as packed RGB24, one row at a time.
func writeRGB(w io.Writer, frames []*image.RGBA) error {
	r := frames[0].Rect
	row := make([]byte, 3*r.Dx())
	for _, f := range frames {
		for y := range r.Dy() {
			src := f.Pix[y*f.Stride : y*f.Stride+4*r.Dx()]
			for x := range r.Dx() {
				copy(row[3*x:3*x+3], src[4*x:4*x+3])
			}
			if _, err := w.Write(row); err != nil {
				return err
			}
		}
	}
	return nil
}

// tailBuffer keeps the last 4 KiB written: enough of ffmpeg's stderr to say
// why it failed, never more.
type tailBuffer struct{ b []byte }

const tailMax = 4 << 10

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > tailMax {
		t.b = t.b[len(t.b)-tailMax:]
	}
	return len(p), nil
}

func (t *tailBuffer) Bytes() []byte { return t.b }
