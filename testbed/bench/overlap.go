package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer"
)

// OverlapConfig configures RunOverlap.
type OverlapConfig struct {
	// Frames, Width and Height shape the video (the latent is frame-major
	// [Frames, C, Height/8, Width/8] float32, one chunk per frame).
	Frames, Width, Height int
	// ChunkInterval is how often the producer finishes a frame, modelling a
	// denoiser that completes frames one by one. 0 means one frame's decode
	// time, measured before the run: a balanced pipeline in which neither
	// stage waits for the other in steady state. Shorter intervals make the
	// decoder the bottleneck and shrink what chunking can win.
	ChunkInterval time.Duration
	// Reps is the number of measured repetitions of each path, interleaved,
	// after one warm-up of each.
	Reps int
	// Engine is the decoder's engine configuration; the producer uses its
	// defaults, so shape fields must stay at theirs.
	Engine engine.Config
	// Transfer is the consumer's transfer configuration.
	Transfer transfer.Config
	// Producer and ProducerEnv are as in TransferConfig.
	Producer    []string
	ProducerEnv []string
	// Progress, if not nil, receives a line per repetition.
	Progress io.Writer
	// Logger receives the consumer's logs.
	Logger *zap.Logger
}

// DefaultOverlapConfig is an 8-frame 256x256 video, the engine's default
// frame size, with the chunk interval matched to the decoder.
func DefaultOverlapConfig() OverlapConfig {
	return OverlapConfig{
		Frames:        8,   // a short clip, as in the 8-chunk latent
		Width:         256, // engine.DefaultSpec's frame size
		Height:        256,
		ChunkInterval: 0, // measured: one frame's decode time
		Reps:          5, // an odd count gives a true median
		Engine:        engine.DefaultConfig(),
		Transfer:      transfer.DefaultConfig(),
		Producer:      ProducerCommand(),
		Logger:        zap.NewNop(),
	}
}

// OverlapPath is one way of getting a video decoded.
type OverlapPath struct {
	// TimeToFirstFrameMS is the median time from asking the producer for the
	// latent until the first frame is decoded.
	TimeToFirstFrameMS float64 `json:"time_to_first_frame_ms"`
	// TotalMS is the median time until every frame is decoded.
	TotalMS float64 `json:"total_ms"`
}

// OverlapResult is RunOverlap's measurement and the parameters behind it.
type OverlapResult struct {
	Frames          int     `json:"frames"`
	Width           int     `json:"width"`
	Height          int     `json:"height"`
	LatentBytes     int64   `json:"latent_bytes"`
	ChunkIntervalMS float64 `json:"chunk_interval_ms"`
	DecodeFrameMS   float64 `json:"decode_frame_ms"` // median, measured before the run
	Reps            int     `json:"reps"`
	// Chunked pulls with PullChunks and decodes each frame as it lands;
	// Whole pulls with PullInto and then decodes frame by frame.
	Chunked OverlapPath `json:"chunked"`
	Whole   OverlapPath `json:"whole"`
	// FirstFrameRatio is Chunked over Whole time to first frame; TotalRatio
	// the same for total time.
	FirstFrameRatio float64 `json:"first_frame_ratio"`
	TotalRatio      float64 `json:"total_ratio"`
}

// OverlapReport is what `bench overlap --json` prints.
type OverlapReport struct {
	Overlap OverlapResult `json:"overlap"`
}

func (c OverlapConfig) validate() error {
	switch {
	case c.Frames < 1:
		return fmt.Errorf("bench: frames %d < 1", c.Frames)
	case c.ChunkInterval < 0:
		return fmt.Errorf("bench: chunk interval %v < 0", c.ChunkInterval)
	case c.Reps < 1:
		return fmt.Errorf("bench: reps %d < 1", c.Reps)
	case c.Logger == nil:
		return errors.New("bench: nil logger")
	}
	return nil
}

// RunOverlap starts the producer process and measures both paths.
func RunOverlap(ctx context.Context, cfg OverlapConfig) (_ *OverlapReport, err error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	eng, err := engine.New(cfg.Engine)
	if err != nil {
		return nil, err
	}
	spec := latentSpec(cfg.Frames, cfg.Width, cfg.Height)
	if err := spec.Validate(cfg.Engine.Limits); err != nil {
		return nil, fmt.Errorf("bench: video: %w", err)
	}
	meta := eng.LatentMeta(spec)
	decodeFrame, err := measureDecode(ctx, eng, spec)
	if err != nil {
		return nil, err
	}
	interval := cfg.ChunkInterval
	if interval == 0 {
		interval = decodeFrame
	}

	cfg.Transfer.Logger = cfg.Logger
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c, err := startChild(ctx, cfg.Producer, cfg.ProducerEnv, request{TCPCongestion: cfg.Transfer.TCPCongestion})
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := c.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	h, err := newHost(loopback)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	svc, err := transfer.New(cfg.Transfer, h)
	if err != nil {
		return nil, err
	}
	defer svc.Close()

	o := &overlapRun{c: c, svc: svc, eng: eng, spec: spec, interval: interval, dst: make([]byte, meta.Bytes())}
	touch(o.dst)
	var cFirst, cTotal, wFirst, wTotal []float64
	for i := -1; i < cfg.Reps; i++ { // i == -1 is the warm-up
		if cfg.Progress != nil {
			if i < 0 {
				fmt.Fprintf(cfg.Progress, "bench overlap: warm-up\n")
			} else {
				fmt.Fprintf(cfg.Progress, "bench overlap: rep %d/%d\n", i+1, cfg.Reps)
			}
		}
		f, t, err := o.run(ctx, true)
		if err != nil {
			return nil, fmt.Errorf("bench: overlap chunked: %w", err)
		}
		f2, t2, err := o.run(ctx, false)
		if err != nil {
			return nil, fmt.Errorf("bench: overlap whole: %w", err)
		}
		if i >= 0 {
			cFirst, cTotal = append(cFirst, ms(f)), append(cTotal, ms(t))
			wFirst, wTotal = append(wFirst, ms(f2)), append(wTotal, ms(t2))
		}
	}
	res := OverlapResult{
		Frames: cfg.Frames, Width: cfg.Width, Height: cfg.Height, LatentBytes: meta.Bytes(),
		ChunkIntervalMS: ms(interval), DecodeFrameMS: ms(decodeFrame), Reps: cfg.Reps,
		Chunked: OverlapPath{TimeToFirstFrameMS: summarize(cFirst).median, TotalMS: summarize(cTotal).median},
		Whole:   OverlapPath{TimeToFirstFrameMS: summarize(wFirst).median, TotalMS: summarize(wTotal).median},
	}
	if res.Whole.TimeToFirstFrameMS > 0 {
		res.FirstFrameRatio = res.Chunked.TimeToFirstFrameMS / res.Whole.TimeToFirstFrameMS
	}
	if res.Whole.TotalMS > 0 {
		res.TotalRatio = res.Chunked.TotalMS / res.Whole.TotalMS
	}
	return &OverlapReport{Overlap: res}, nil
}

// measureDecode is the median time to decode one frame of spec's latent
// (three tries on a finite sample latent).
func measureDecode(ctx context.Context, eng *engine.Engine, spec engine.Spec) (time.Duration, error) {
	d, err := eng.NewFrameDecoder(spec)
	if err != nil {
		return 0, err
	}
	frame := make([]byte, d.FrameBytes())
	var ts []float64
	for range 3 {
		t0 := time.Now()
		if err := d.DecodeFrames(ctx, 0, frame); err != nil {
			return 0, fmt.Errorf("bench: decode sample frame: %w", err)
		}
		ts = append(ts, float64(time.Since(t0)))
	}
	return time.Duration(summarize(ts).median), nil
}

// overlapRun is the state of one RunOverlap.
type overlapRun struct {
	c        *child
	svc      *transfer.Service
	eng      *engine.Engine
	spec     engine.Spec
	interval time.Duration
	dst      []byte
}

// run asks the producer for a fresh latent and decodes it, chunk by chunk
// as chunks land or after pulling it whole. It returns the time to the first
// decoded frame and to the last, both from the request.
func (o *overlapRun) run(ctx context.Context, chunked bool) (first, total time.Duration, err error) {
	dec, err := o.eng.NewFrameDecoder(o.spec)
	if err != nil {
		return 0, 0, err
	}
	fb := dec.FrameBytes()
	t0 := time.Now()
	resp, err := o.c.call(request{Op: opLatent, Frames: o.spec.Frames, Width: o.spec.Width, Height: o.spec.Height, Interval: o.interval})
	if err != nil {
		return 0, 0, err
	}
	defer o.c.call(request{Op: opRelease, ID: resp.Ref.ID})
	decoded := 0
	decode := func(frame int, b []byte) error {
		if err := dec.DecodeFrames(ctx, frame, b); err != nil {
			return err
		}
		if decoded == 0 {
			first = time.Since(t0)
		}
		decoded += len(b) / fb
		return nil
	}
	if chunked {
		pctx, cancel := context.WithCancel(ctx)
		defer cancel()
		p, err := o.svc.PullChunks(pctx, resp.Ref, o.dst)
		if err != nil {
			return 0, 0, err
		}
		perChunk := o.spec.Frames / resp.Ref.Meta.Chunks() // 1 with LatentMeta
		for ch := range p.Chunks() {
			if err := decode(ch.Index*perChunk, ch.Data); err != nil {
				cancel()
				p.Wait()
				return 0, 0, err
			}
		}
		if err := p.Wait(); err != nil {
			return 0, 0, err
		}
	} else {
		if err := o.svc.PullInto(ctx, resp.Ref, o.dst); err != nil {
			return 0, 0, err
		}
		for f := range o.spec.Frames {
			if err := decode(f, o.dst[f*fb:(f+1)*fb]); err != nil {
				return 0, 0, err
			}
		}
	}
	total = time.Since(t0)
	if decoded != o.spec.Frames {
		return 0, 0, fmt.Errorf("decoded %d of %d frames", decoded, o.spec.Frames)
	}
	return first, total, nil
}

// WriteTable writes the report as aligned columns, with its parameters.
func (rep *OverlapReport) WriteTable(w io.Writer) error {
	r := rep.Overlap
	fmt.Fprintf(w, "video %dx%d x %d frames, latent %s in %d chunks; producer finishes a frame every %.1f ms; decode %.1f ms/frame; %d reps (medians)\n",
		r.Width, r.Height, r.Frames, bytesize.Format(r.LatentBytes), r.Frames, r.ChunkIntervalMS, r.DecodeFrameMS, r.Reps)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "path\tfirst frame ms\ttotal ms\t")
	fmt.Fprintf(tw, "chunked (pull chunks, decode as they land)\t%.1f\t%.1f\t\n", r.Chunked.TimeToFirstFrameMS, r.Chunked.TotalMS)
	fmt.Fprintf(tw, "whole (pull whole, then decode)\t%.1f\t%.1f\t\n", r.Whole.TimeToFirstFrameMS, r.Whole.TotalMS)
	fmt.Fprintf(tw, "chunked / whole\t%.2f\t%.2f\t\n", r.FirstFrameRatio, r.TotalRatio)
	return tw.Flush()
}
