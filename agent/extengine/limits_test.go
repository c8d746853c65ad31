package extengine

import (
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/agent/engine"
)

func wanLike() Model {
	return Model{
		Name: "wan", Stages: []string{StageDenoise},
		MaxSide: 1280, MaxFramePixels: 1280 * 720, MaxFrames: 81, SideMultiple: 16, FrameStep: 4, FrameOffset: 1,
		Cond:   Layout{DType: "float32", Shape: []int64{512, 64}},
		Latent: LatentLayout{DType: "float32", Channels: 16, Scale: 8},
	}
}

// A model's registered limits replace the agent's defaults (they may be
// larger), and a pixel budget left out is what its sides and frames
// multiply out to.
func TestModelLimitsReplaceDefaults(t *testing.T) {
	base := engine.DefaultLimits()
	l := wanLike().Limits(base)
	if l.MaxSide != 1280 || l.MaxFrames != 81 || l.MaxPixels != 1280*720*81 || l.SideMultiple != 16 || l.FrameStep != 4 || l.FrameOffset != 1 {
		t.Fatalf("limits %+v", l)
	}
	if l.MaxSteps != base.MaxSteps || l.MaxPromptBytes != base.MaxPromptBytes || l.MinSide != base.MinSide {
		t.Fatalf("unregistered limits changed: %+v", l)
	}
	ok := engine.Spec{Prompt: "x", Width: 832, Height: 480, Frames: 81, Steps: 50, GuidanceScale: 5}
	if err := ok.Validate(l); err != nil {
		t.Fatalf("832x480x81: %v", err)
	}
	if err := ok.Validate(base); err == nil {
		t.Fatal("the built-in defaults took 832x480x81")
	}
	for _, tc := range []struct {
		w, h, f int
		want    string
	}{
		{1280, 1024, 81, "more than 921600"},
		{720, 1280, 81, ""}, // portrait of the same frame budget
		{832, 480, 80, "4k+1"},
		{832, 480, 85, "[1,81]"},
		{840, 480, 81, "multiple of 16"},
		{832, 480, 1, ""}, // an image
	} {
		s := ok
		s.Width, s.Height, s.Frames = tc.w, tc.h, tc.f
		err := s.Validate(l)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%dx%dx%d: %v", tc.w, tc.h, tc.f, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%dx%dx%d: %v, want %q", tc.w, tc.h, tc.f, err, tc.want)
		}
	}
	// Only sides: the budget is the square of the side, times the frames.
	m := Model{Name: "sq", Stages: []string{StageDenoise}, MaxSide: 512, Latent: LatentLayout{Scale: 8}}
	if l := m.Limits(base); l.MaxPixels != 512*512*base.MaxFrames {
		t.Errorf("side-only budget %d", l.MaxPixels)
	}
	// Nothing registered: the defaults, whole.
	if l := (Model{Latent: LatentLayout{Scale: 8}}).Limits(base); l.MaxPixels != base.MaxPixels || l.SideMultiple != 8 {
		t.Errorf("no limits registered: %+v", l)
	}
}

// Registered limits are bounded like every other field.
func TestModelLimitsValidated(t *testing.T) {
	for name, mut := range map[string]func(*Model){
		"negative":         func(m *Model) { m.MaxFramePixels = -1 },
		"huge side":        func(m *Model) { m.MaxSide = MaxLimitSide + 1 },
		"huge pixels":      func(m *Model) { m.MaxPixels = int64(MaxLimitSide) * MaxLimitSide * MaxLimitFrames * 2 },
		"offset >= step":   func(m *Model) { m.FrameOffset = 4 },
		"min above max":    func(m *Model) { m.MinSide = 2048 },
		"huge frame steps": func(m *Model) { m.FrameStep = 100 },
	} {
		m := wanLike()
		mut(&m)
		if err := m.validate(); err == nil {
			t.Errorf("%s: accepted %+v", name, m)
		}
	}
	m := wanLike()
	if err := m.validate(); err != nil {
		t.Fatal(err)
	}
}
