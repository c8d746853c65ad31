package engine

import (
	"bytes"
	"context"
	"fmt"
	"image"
	"image/draw"
	"image/gif"
	"image/png"
	"os"
	"path/filepath"
	"testing"
)

// TestWriteSamples writes sample pictures for a person to look at. It runs
// only when LATENTMESH_ENGINE_LOOK names an output directory.
func TestWriteSamples(t *testing.T) {
	dir := os.Getenv("LATENTMESH_ENGINE_LOOK")
	if dir == "" {
		t.Skip("set LATENTMESH_ENGINE_LOOK=dir to write sample pictures")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	e, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	specs := []Spec{
		{Prompt: "a red fox in the snow", Seed: 1},
		{Prompt: "a red fox in the snow", Seed: 2},
		{Prompt: "ocean waves", Seed: 1},
		{Prompt: "sunset over the ocean", Seed: 1},
		{Prompt: "a bowl of fruit on a table", Seed: 1},
		{Prompt: "cyberpunk city at night, neon", Seed: 7},
		{Prompt: "a green forest", Seed: 1},
		{Prompt: "quasar zeitgeist", Seed: 1}, // no known word: the seeded look
		{Prompt: "a red fox in the snow", Seed: 1, GuidanceScale: 30},
		{Prompt: "a red fox in the snow", Seed: 1, NegativePrompt: "blurry"},
		// The demo's prompts (testbed.DefaultPrompts).
		{Prompt: "a red fox in a snowy forest at dawn", Seed: 1},
		{Prompt: "a lighthouse on a rocky coast under a stormy sky", Seed: 2, Width: 320, Height: 192},
		{Prompt: "a bowl of ripe oranges on a wooden table", Seed: 3, Width: 192, Height: 256},
		{Prompt: "neon city street at night in the rain", NegativePrompt: "blurry, low contrast", Seed: 4},
		{Prompt: "ocean waves rolling onto a sandy beach", Seed: 5, Width: 160, Height: 128, Frames: 8},
		{Prompt: "jellyfish drifting in deep water", Seed: 5, Frames: 16},
	}
	sheet := image.NewRGBA(image.Rect(0, 0, 4*256, 4*256))
	for i, s := range specs {
		s = s.WithDefaults()
		out, ct, err := e.Generate(context.Background(), s)
		if err != nil {
			t.Fatal(err)
		}
		ext := ".png"
		if ct == ContentTypeGIF {
			ext = ".gif"
		}
		name := filepath.Join(dir, fmt.Sprintf("%02d%s", i, ext))
		if err := os.WriteFile(name, out, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %+v", name, s)
		var img image.Image
		if ct == ContentTypeGIF {
			g, err := gif.DecodeAll(bytes.NewReader(out))
			if err != nil {
				t.Fatal(err)
			}
			img = g.Image[len(g.Image)/2]
		} else if img, err = png.Decode(bytes.NewReader(out)); err != nil {
			t.Fatal(err)
		}
		at := image.Pt(i%4*256, i/4*256)
		draw.Draw(sheet, image.Rectangle{at, at.Add(image.Pt(256, 256))}, img, image.Point{}, draw.Src)
	}
	var buf bytes.Buffer
	if err := png.Encode(&buf, sheet); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sheet.png"), buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}
