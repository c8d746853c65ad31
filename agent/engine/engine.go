// Package engine is the built-in reference diffusion pipeline: a pure-Go,
// deterministic stand-in for a GPU model with the real structure of one.
//
// A request runs in three stages that may run in different processes:
// Encode (tokenize and embed the prompt and the negative prompt, two halves
// that EncodeTextInto can also encode one at a time), Denoise (seeded noise,
// K sampler steps with classifier-free guidance, the denoiser cross-attending
// to the conditioning tokens as a DiT does) and Decode (latent to RGB,
// written as PNG or animated GIF). Stages exchange Tensors as bytes. The same
// Spec always gives byte-identical files, whichever machines ran which stage.
//
// The unconditional branch's attention keys and values depend only on the
// negative prompt; DenoiseWith can take them from a KVCache shared across
// requests instead of recomputing them every step, with the same output.
//
// DenoiseWith also takes step Checkpoints (the latent and the schedule, at
// full precision) and resumes from them on any worker with byte-identical
// output, stops at one when asked, and forks: a checkpoint resumed with
// another prompt, guidance or step count continues its latent under them.
//
// The agent's stage runners use this package; it knows nothing of jobs,
// routing or transfer beyond the TensorMeta it fills in.
package engine

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// Errors returned (wrapped) by the engine.
var (
	ErrBadConfig     = errors.New("engine: bad config")
	ErrBadSpec       = errors.New("engine: bad spec")
	ErrBadTensor     = errors.New("engine: bad tensor")
	ErrMissingFrames = errors.New("engine: missing frames")
)

// version names the algorithm. Bump it whenever any stage's output bytes
// change for some input, since IDs key caches of stage results.
//
//	v2: PNGs deflated at BestSpeed
//	v3: known words carry colours, places and shapes (semantic.go)
//	v4: the denoiser cross-attends to the conditioning tokens (attention.go)
const version = "builtin/v4"

// Config shapes the model and its simulated cost. Fields other than the costs
// and Limits change the output bytes and therefore the engine's ID.
type Config struct {
	EmbedDim       int    // width of a token embedding; from 46 (and VocabSize 2048) its last 23 carry known words' meaning
	MaxTokens      int    // prompt length after padding/truncation
	VocabSize      int    // token ids, including the two reserved ones
	LatentChannels int    // channels of the latent image
	TableSeed      uint64 // seeds the embedding table and projections

	// StepCost, EncodeCost and DecodeCost are simulated accelerator time
	// slept per denoise step and per Encode/Decode call, on top of the real
	// CPU work. Sleeping honours ctx.
	StepCost   time.Duration
	EncodeCost time.Duration
	DecodeCost time.Duration

	// Limits bound the Specs the engine accepts.
	Limits Limits
}

// DefaultConfig is a small model that runs a 256x256, 20-step image in well
// under a second on one core.
func DefaultConfig() Config {
	return Config{
		EmbedDim:       64,   // enough features for the scene, small cache entries
		MaxTokens:      77,   // CLIP's context length, as real pipelines use
		VocabSize:      8192, // few collisions for prompt-sized vocabularies
		LatentChannels: 4,    // as Stable Diffusion's VAE: 3 colour + 1 texture
		TableSeed:      0x6c6d,
		StepCost:       0, // real CPU work only; tests and demos set a cost
		EncodeCost:     0,
		DecodeCost:     0,
		Limits:         DefaultLimits(),
	}
}

// Engine runs the three stages. It holds no mutable state, so one Engine may
// serve any number of concurrent calls.
type Engine struct {
	cfg   Config
	id    string
	table *embedTable
	proj  [][]float64 // sceneFeatures x table.rand projection of the pooled embedding's random part
	attn  *crossAttn  // the denoiser's cross-attention weights
}

// New validates cfg and builds an Engine.
func New(cfg Config) (*Engine, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, a...))
	}
	switch {
	case cfg.EmbedDim < 4 || cfg.EmbedDim > 4096:
		return nil, bad("embed_dim %d not in [4,4096]", cfg.EmbedDim)
	case cfg.MaxTokens < 2 || cfg.MaxTokens > 4096:
		return nil, bad("max_tokens %d not in [2,4096]", cfg.MaxTokens)
	case cfg.VocabSize < 16 || cfg.VocabSize > 1<<24:
		return nil, bad("vocab_size %d not in [16,%d]", cfg.VocabSize, 1<<24)
	case cfg.LatentChannels < 3 || cfg.LatentChannels > 64:
		return nil, bad("latent_channels %d not in [3,64]", cfg.LatentChannels)
	case cfg.StepCost < 0 || cfg.EncodeCost < 0 || cfg.DecodeCost < 0:
		return nil, bad("negative cost")
	case cfg.Limits.MinSide < 8 || cfg.Limits.MaxSide < cfg.Limits.MinSide ||
		cfg.Limits.MaxFrames < 1 || cfg.Limits.MaxSteps < 1 || cfg.Limits.MaxPixels < 1:
		return nil, bad("limits %+v", cfg.Limits)
	}
	e := &Engine{cfg: cfg, id: makeID(cfg)}
	e.table = newEmbedTable(cfg)
	e.proj = newProjection(cfg, e.table.rand)
	e.attn = newCrossAttn(cfg)
	return e, nil
}

// makeID is version for the default model and version+hash otherwise, so
// that engines that would embed or draw differently never share cache keys.
func makeID(cfg Config) string {
	d := DefaultConfig()
	if cfg.EmbedDim == d.EmbedDim && cfg.MaxTokens == d.MaxTokens && cfg.VocabSize == d.VocabSize &&
		cfg.LatentChannels == d.LatentChannels && cfg.TableSeed == d.TableSeed {
		return version
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d/%d/%d/%d", cfg.EmbedDim, cfg.MaxTokens, cfg.VocabSize, cfg.LatentChannels, cfg.TableSeed)
	return fmt.Sprintf("%s+%016x", version, h.Sum64())
}

// ID names the engine's algorithm and every setting that changes its output,
// e.g. "builtin/v4". Equal IDs produce equal bytes for equal Specs.
func (e *Engine) ID() string { return e.id }

// Config returns the engine's (frozen) configuration.
func (e *Engine) Config() Config { return e.cfg }

// CondMeta is the meta of Encode's output: [2, MaxTokens, EmbedDim] float32,
// conditional row first.
func (e *Engine) CondMeta() transfer.TensorMeta {
	return transfer.TensorMeta{
		DType:     transfer.Float32,
		Shape:     []int64{2, int64(e.cfg.MaxTokens), int64(e.cfg.EmbedDim)},
		NumChunks: 1,
	}
}

// LatentMeta is the meta of Denoise's output for s: frame-major
// [Frames, LatentChannels, Height/8, Width/8] float32, one chunk per frame
// for videos so a decoder can start on the first frames.
func (e *Engine) LatentMeta(s Spec) transfer.TensorMeta {
	return transfer.TensorMeta{
		DType:     transfer.Float32,
		Shape:     []int64{int64(s.Frames), int64(e.cfg.LatentChannels), int64(s.Height / 8), int64(s.Width / 8)},
		NumChunks: max(s.Frames, 1),
	}
}

// checkSpec validates s against the engine's limits.
func (e *Engine) checkSpec(s Spec) error {
	if err := s.Validate(e.cfg.Limits); err != nil {
		return fmt.Errorf("%w: %w", ErrBadSpec, err)
	}
	return nil
}

// Spend sleeps for the simulated cost d, returning early with ctx's error.
// The agent's simulated GPUs (bench serve) spend their time through it too.
func Spend(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil || d <= 0 {
		return err
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
