package engine

import (
	"fmt"
	"unicode/utf8"
)

// Spec is one generation request as the engine sees it: everything that
// determines the output bytes. Two runs of the same Spec produce identical
// files, whichever agents ran which stage.
type Spec struct {
	// Model names the model that serves the request (OpenAI's "model");
	// "" means DefaultModel, the built-in engine. Only agents whose engine
	// serves the model claim its tasks.
	Model          string  `json:"model,omitempty" msgpack:"model"`
	Prompt         string  `json:"prompt" msgpack:"prompt"`
	NegativePrompt string  `json:"negative_prompt,omitempty" msgpack:"negative_prompt"`
	Seed           int64   `json:"seed" msgpack:"seed"`
	Width          int     `json:"width" msgpack:"width"`
	Height         int     `json:"height" msgpack:"height"`
	Frames         int     `json:"frames" msgpack:"frames"` // 1 = image (PNG), >1 = video (GIF)
	Steps          int     `json:"steps" msgpack:"steps"`
	GuidanceScale  float64 `json:"guidance_scale" msgpack:"guidance_scale"`
	// Params are the model's own parameters, complete (defaults applied
	// at submission; params.go), and Image the request's reference image:
	// both reach an engine beside the spec (extengine's task fields), not
	// in it, so the spec a v1 engine reads is what it always was.
	Params Params    `json:"params,omitempty" msgpack:"-"`
	Image  *ImageRef `json:"image,omitempty" msgpack:"-"`
	// Adapter names a LoRA-like weight delta of the model's denoiser
	// ("lora" in the APIs; adapter.go), which an external engine loads at
	// run time: only a worker whose engine has it loaded runs the denoise.
	Adapter string `json:"lora,omitempty" msgpack:"-"`
}

// DefaultModel is the built-in engine's model name, what a Spec without a
// model asks for.
const DefaultModel = "latentmesh-reference"

// MaxModelLen bounds a model name: it travels in gossip, where a node
// advertises several within 512 bytes.
const MaxModelLen = 48

// ModelName is s.Model, or DefaultModel when it is empty.
func (s Spec) ModelName() string {
	if s.Model == "" {
		return DefaultModel
	}
	return s.Model
}

// ValidModel reports whether name is a usable model name: 1 to MaxModelLen
// bytes of letters, digits and . _ - / :
func ValidModel(name string) error {
	if name == "" || len(name) > MaxModelLen {
		return fmt.Errorf("must be 1-%d bytes", MaxModelLen)
	}
	for _, c := range []byte(name) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-', c == '/', c == ':':
		default:
			return fmt.Errorf("%q: only letters, digits and . _ - / : are allowed", name)
		}
	}
	return nil
}

// Limits bound what one request may ask for, so a single request cannot
// exhaust an agent's memory or hold a denoise slot for hours.
//
// A model served by an external engine registers its own (extengine.Model):
// a video model such as Wan2.1 takes 1280x720 frames, 81 of them, sides in
// multiples of 16 and frame counts of the form 4k+1 (its VAE compresses time
// 4x). The zero value of each field after MaxGuidance means no such rule.
type Limits struct {
	MaxPromptBytes int // UTF-8 bytes of prompt and of negative prompt, each
	MinSide        int // pixels; sides must also be multiples of SideMultiple
	MaxSide        int
	MaxPixels      int // width*height*frames
	MaxFrames      int
	MaxSteps       int
	MaxGuidance    float64
	// MaxFramePixels bounds width*height (0: MaxSide squared), so a model
	// can take 1280x720 and 720x1280 but not 1280x1280.
	MaxFramePixels int
	// SideMultiple is what width and height must be multiples of: the
	// VAE's spatial factor times the patch size (0: 8).
	SideMultiple int
	// FrameStep and FrameOffset are a temporal VAE's rule for videos:
	// frames = FrameStep*k + FrameOffset (Wan: 4k+1). FrameStep 0: any.
	FrameStep, FrameOffset int
}

// DefaultLimits fit the built-in engine on a small CPU machine and keep a
// finished file small.
func DefaultLimits() Limits {
	return Limits{
		MaxPromptBytes: 2000,    // a long prompt; engines truncate tokens anyway
		MinSide:        64,      // 8x8 latent, the smallest useful picture
		MaxSide:        1024,    // 128x128 latent
		MaxPixels:      4 << 20, // 1024x1024x4 or 256x256x64: bounds output size
		MaxFrames:      64,      // a few seconds of GIF
		MaxSteps:       200,     // beyond any real sampler schedule
		MaxGuidance:    30,      // CFG beyond this is meaningless
	}
}

// DefaultSpec is what an unset field means.
func DefaultSpec() Spec {
	return Spec{Width: 256, Height: 256, Frames: 1, Steps: 20, GuidanceScale: 5}
}

// FieldError names the request field that is out of range.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return fmt.Sprintf("%s: %s", e.Field, e.Msg) }

// WithDefaults fills zero fields from DefaultSpec.
func (s Spec) WithDefaults() Spec {
	d := DefaultSpec()
	if s.Width == 0 {
		s.Width = d.Width
	}
	if s.Height == 0 {
		s.Height = d.Height
	}
	if s.Frames == 0 {
		s.Frames = d.Frames
	}
	if s.Steps == 0 {
		s.Steps = d.Steps
	}
	if s.GuidanceScale == 0 {
		s.GuidanceScale = d.GuidanceScale
	}
	return s
}

// Validate reports the first field of s outside l, as a *FieldError.
func (s Spec) Validate(l Limits) error {
	mult := l.SideMultiple
	if mult <= 0 {
		mult = 8
	}
	bad := func(field, format string, a ...any) error {
		return &FieldError{Field: field, Msg: fmt.Sprintf(format, a...)}
	}
	if s.Model != "" {
		if err := ValidModel(s.Model); err != nil {
			return &FieldError{Field: "model", Msg: err.Error()}
		}
	}
	if s.Adapter != "" {
		if err := ValidAdapter(s.Adapter); err != nil {
			return &FieldError{Field: "lora", Msg: err.Error()}
		}
	}
	switch {
	case s.Prompt == "":
		return bad("prompt", "must not be empty")
	case len(s.Prompt) > l.MaxPromptBytes:
		return bad("prompt", "longer than %d bytes", l.MaxPromptBytes)
	case !utf8.ValidString(s.Prompt):
		return bad("prompt", "not valid UTF-8")
	case len(s.NegativePrompt) > l.MaxPromptBytes:
		return bad("negative_prompt", "longer than %d bytes", l.MaxPromptBytes)
	case !utf8.ValidString(s.NegativePrompt):
		return bad("negative_prompt", "not valid UTF-8")
	case s.Width < l.MinSide || s.Width > l.MaxSide || s.Width%mult != 0:
		return bad("width", "%d: must be a multiple of %d in [%d,%d]", s.Width, mult, l.MinSide, l.MaxSide)
	case s.Height < l.MinSide || s.Height > l.MaxSide || s.Height%mult != 0:
		return bad("height", "%d: must be a multiple of %d in [%d,%d]", s.Height, mult, l.MinSide, l.MaxSide)
	case l.MaxFramePixels > 0 && s.Width*s.Height > l.MaxFramePixels:
		return bad("size", "%dx%d is %d pixels a frame, more than %d", s.Width, s.Height, s.Width*s.Height, l.MaxFramePixels)
	case s.Frames < 1 || s.Frames > l.MaxFrames:
		return bad("frames", "%d: must be in [1,%d]", s.Frames, l.MaxFrames)
	case l.FrameStep > 1 && s.Frames > 1 && s.Frames%l.FrameStep != l.FrameOffset%l.FrameStep:
		return bad("frames", "%d: must be %dk+%d (the model's VAE compresses time %dx)", s.Frames, l.FrameStep, l.FrameOffset, l.FrameStep)
	case s.Width*s.Height*s.Frames > l.MaxPixels:
		return bad("frames", "%dx%dx%d is more than %d pixels", s.Width, s.Height, s.Frames, l.MaxPixels)
	case s.Steps < 1 || s.Steps > l.MaxSteps:
		return bad("steps", "%d: must be in [1,%d]", s.Steps, l.MaxSteps)
	case !(s.GuidanceScale >= 0 && s.GuidanceScale <= l.MaxGuidance): // also rejects NaN
		return bad("guidance_scale", "%v: must be in [0,%v]", s.GuidanceScale, l.MaxGuidance)
	}
	return nil
}
