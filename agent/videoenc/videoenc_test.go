package videoenc

import (
	"bytes"
	"context"
	"encoding/json"
	"image"
	"image/color"
	"image/color/palette"
	"image/gif"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func testGIF(t *testing.T, w, h, n int) []byte {
	t.Helper()
	g := &gif.GIF{}
	for i := range n {
		img := image.NewPaletted(image.Rect(0, 0, w, h), palette.Plan9)
		for y := range h {
			for x := range w {
				img.Set(x, y, color.RGBA{uint8(x * 2), uint8(y * 2), uint8(i * 20), 255})
			}
		}
		g.Image = append(g.Image, img)
		g.Delay = append(g.Delay, 8)
	}
	var buf bytes.Buffer
	if err := gif.EncodeAll(&buf, g); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

var bounds = Bounds{MaxSide: 1024, MaxFrames: 64, MaxPixels: 4 << 20}

func TestFramesBounds(t *testing.T) {
	g := testGIF(t, 96, 64, 5)
	frames, err := Frames(g, bounds)
	if err != nil || len(frames) != 5 || frames[0].Rect.Dx() != 96 || frames[0].Rect.Dy() != 64 {
		t.Fatalf("frames %d, %v", len(frames), err)
	}
	if frames[4].RGBAAt(0, 0).A != 255 {
		t.Fatal("frames are not opaque")
	}
	for name, b := range map[string]Bounds{
		"side":   {MaxSide: 64, MaxFrames: 64, MaxPixels: 4 << 20},
		"frames": {MaxSide: 1024, MaxFrames: 4, MaxPixels: 4 << 20},
		"pixels": {MaxSide: 1024, MaxFrames: 64, MaxPixels: 96 * 64 * 4},
	} {
		if _, err := Frames(g, b); err == nil {
			t.Errorf("%s: a GIF outside the bounds decoded", name)
		}
	}
	if _, err := Frames([]byte("GIF89a nonsense"), bounds); err == nil {
		t.Error("garbage decoded")
	}
	th, err := Thumbnail(frames)
	if err != nil {
		t.Fatal(err)
	}
	if img, err := png.Decode(bytes.NewReader(th)); err != nil || img.Bounds() != frames[0].Rect {
		t.Fatalf("thumbnail: %v", err)
	}
}

// needTool fails without a binary scripts/install-deps.sh installs, and
// skips only under -short.
func needTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if testing.Short() {
			t.Skipf("%s not installed", name)
		}
		t.Fatalf("%s not installed: run scripts/install-deps.sh: %v", name, err)
	}
	return p
}

// The MP4 is H.264 yuv420p with every frame, at the size and rate asked.
func TestMP4(t *testing.T) {
	needTool(t, "ffmpeg")
	ffprobe := needTool(t, "ffprobe")
	enc, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	frames, err := Frames(testGIF(t, 96, 64, 7), bounds)
	if err != nil {
		t.Fatal(err)
	}
	mp4, err := enc.MP4(context.Background(), frames, 12.5)
	if err != nil {
		t.Fatal(err)
	}
	again, err := enc.MP4(context.Background(), frames, 12.5)
	if err != nil || !bytes.Equal(mp4, again) {
		t.Fatalf("two encodes of the same frames differ (%v)", err)
	}
	path := filepath.Join(t.TempDir(), "v.mp4")
	if err := os.WriteFile(path, mp4, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(ffprobe, "-v", "error", "-count_frames", "-select_streams", "v:0",
		"-show_entries", "stream=codec_name,pix_fmt,width,height,nb_read_frames,avg_frame_rate", "-of", "json", path).CombinedOutput()
	if err != nil {
		t.Fatalf("ffprobe: %v %s", err, out)
	}
	var pr struct {
		Streams []map[string]any `json:"streams"`
	}
	if err := json.Unmarshal(out, &pr); err != nil || len(pr.Streams) != 1 {
		t.Fatalf("ffprobe %s", out)
	}
	s := pr.Streams[0]
	if s["codec_name"] != "h264" || s["pix_fmt"] != "yuv420p" || s["width"] != 96.0 || s["height"] != 64.0 || s["nb_read_frames"] != "7" || s["avg_frame_rate"] != "25/2" {
		t.Fatalf("ffprobe: %v", s)
	}

	if _, err := enc.MP4(context.Background(), nil, 12.5); err == nil {
		t.Error("no frames encoded")
	}
	if _, err := New(Config{FFmpeg: "/nonexistent/ffmpeg"}); err == nil {
		t.Error("a missing ffmpeg was found")
	}
}
