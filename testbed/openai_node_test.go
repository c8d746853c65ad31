package testbed

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
)

// needTool finds a binary scripts/install-deps.sh installs: the test fails
// without it, as CI runs install-deps, and skips only under -short.
func needTool(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if testing.Short() {
			t.Skipf("%s not installed (scripts/install-deps.sh installs it)", name)
		}
		t.Fatalf("%s not installed: run scripts/install-deps.sh: %v", name, err)
	}
	return p
}

// The official OpenAI Node client (npm openai, pinned in
// testdata/openai-node) creates a video on a real mesh, polls it to
// completion, downloads it, lists and deletes it; the MP4 it downloads is
// H.264 with the frames its seconds map to, at its size.
func TestOpenAINodeClientVideos(t *testing.T) {
	node, npm := needTool(t, "node"), needTool(t, "npm")
	ffprobe := needTool(t, "ffprobe")
	needTool(t, "ffmpeg")

	// npm ci into a copy, so the source tree gets no node_modules.
	_, file, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(file), "testdata", "openai-node")
	dir := t.TempDir()
	for _, f := range []string{"package.json", "package-lock.json", "videos.mjs"} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	ci := exec.CommandContext(ctx, npm, "ci", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error")
	ci.Dir = dir
	if out, err := ci.CombinedOutput(); err != nil {
		t.Fatalf("npm ci: %v\n%s", err, out)
	}

	cl := startCluster(t, Disaggregated, nil)
	base := "http://" + cl.Agents[1].HTTPAddr() + "/v1"
	mp4 := filepath.Join(t.TempDir(), "video.mp4")
	run := exec.CommandContext(ctx, node, "videos.mjs", base, mp4)
	run.Dir = dir
	var stderr strings.Builder
	run.Stderr = &stderr
	out, err := run.Output()
	if err != nil {
		t.Fatalf("node videos.mjs: %v\nstdout: %s\nstderr: %s", err, out, stderr.String())
	}
	var got struct {
		Models      []string `json:"models"`
		ID          string   `json:"id"`
		Statuses    []string `json:"statuses"`
		Progress    int      `json:"progress"`
		Seconds     string   `json:"seconds"`
		Size        string   `json:"size"`
		CompletedAt *int64   `json:"completed_at"`
		ContentType string   `json:"content_type"`
		Bytes       int      `json:"bytes"`
		Listed      []string `json:"listed"`
		Deleted     struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Deleted bool   `json:"deleted"`
		} `json:"deleted"`
		GoneStatus int `json:"gone_status"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("script output %q: %v", out, err)
	}
	t.Logf("client saw %s", out)
	switch {
	case len(got.Models) != 1 || got.Models[0] != "latentmesh-reference":
		t.Errorf("models %v, want [latentmesh-reference]", got.Models)
	case got.Statuses[len(got.Statuses)-1] != "completed" || got.Progress != 100 || got.CompletedAt == nil:
		t.Errorf("ended %v at progress %d, completed_at %v", got.Statuses, got.Progress, got.CompletedAt)
	case got.Seconds != "4" || got.Size != "128x128":
		t.Errorf("seconds %q size %q, want 4 and 128x128", got.Seconds, got.Size)
	case got.ContentType != "video/mp4" || got.Bytes == 0:
		t.Errorf("content %q, %d bytes", got.ContentType, got.Bytes)
	case len(got.Listed) != 1 || got.Listed[0] != got.ID:
		t.Errorf("listed %v, want [%s]", got.Listed, got.ID)
	case got.Deleted.ID != got.ID || got.Deleted.Object != "video.deleted" || !got.Deleted.Deleted:
		t.Errorf("delete answered %+v", got.Deleted)
	case got.GoneStatus != 404:
		t.Errorf("retrieve after delete: status %d, want 404", got.GoneStatus)
	}

	// ffprobe reads the MP4 as a player would, counting its frames.
	probe := exec.CommandContext(ctx, ffprobe, "-v", "error", "-count_frames", "-select_streams", "v:0",
		"-show_entries", "stream=codec_name,pix_fmt,width,height,nb_read_frames,avg_frame_rate", "-of", "json", mp4)
	pout, err := probe.CombinedOutput()
	if err != nil {
		t.Fatalf("ffprobe: %v\n%s", err, pout)
	}
	var pr struct {
		Streams []struct {
			Codec     string `json:"codec_name"`
			PixFmt    string `json:"pix_fmt"`
			Width     int    `json:"width"`
			Height    int    `json:"height"`
			Frames    string `json:"nb_read_frames"`
			FrameRate string `json:"avg_frame_rate"`
		} `json:"streams"`
	}
	if err := json.Unmarshal(pout, &pr); err != nil || len(pr.Streams) != 1 {
		t.Fatalf("ffprobe output %s: %v", pout, err)
	}
	st := pr.Streams[0]
	wantFrames := int(4 * httpapi.VideoFrameRate) // seconds "4"
	if n, _ := strconv.Atoi(st.Frames); st.Codec != "h264" || st.PixFmt != "yuv420p" || n != wantFrames || st.Width != 128 || st.Height != 128 || st.FrameRate != "25/2" {
		t.Fatalf("ffprobe: %+v; want h264 yuv420p, %d frames of 128x128 at 25/2", st, wantFrames)
	}
	t.Logf("ffprobe: %+v", st)
}

// The OpenAI endpoints on a real mesh, from Go: a JSON video create that
// completes, OpenAI's default size refused naming the sizes that fit,
// /v1/models from gossip, and an image by response_format url.
func TestOpenAIEndpointsOnRealCluster(t *testing.T) {
	cl := startCluster(t, Disaggregated, nil)
	base := "http://" + cl.Agents[0].HTTPAddr()

	code, b := post(t, base+"/v1/videos", `{"prompt":"waves","size":"720x1280"}`)
	var e struct{ Error httpapi.APIError }
	if code != 400 || json.Unmarshal(b, &e) != nil || e.Error.Param != "size" || !strings.Contains(e.Error.Message, "256x256") {
		t.Fatalf("OpenAI's default size: %d %s", code, b)
	}

	code, b = post(t, base+"/v1/videos", `{"prompt":"waves","size":"64x64","seconds":"0.32","num_inference_steps":2}`)
	var v httpapi.Video
	if code != 200 || json.Unmarshal(b, &v) != nil || v.Latentmesh.Frames != 4 {
		t.Fatalf("create: %d %s", code, b)
	}
	eventually(t, 30*time.Second, func() error {
		resp, err := http.Get(base + "/v1/videos/" + v.ID)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			return err
		}
		if v.Status != "completed" {
			return fmt.Errorf("video is %s (%d%%)", v.Status, v.Progress)
		}
		return nil
	})
	if v.Progress != 100 || v.Seconds != "0.32" || v.CompletedAt == nil || v.ExpiresAt == nil {
		t.Fatalf("completed video %+v", v)
	}

	var models httpapi.ModelList
	if code, body, _ := getJSON(t, base+"/v1/models", &models); code != 200 || len(models.Data) != 1 || models.Data[0].ID != "latentmesh-reference" || models.Data[0].Latentmesh.Nodes != 3 {
		t.Fatalf("models %d %s", code, body)
	}

	code, b = post(t, base+"/v1/images/generations", `{"prompt":"a boat","size":"64x64","num_inference_steps":2,"response_format":"url","quality":"low","style":"vivid"}`)
	var img httpapi.ImagesResponse
	if code != 200 || json.Unmarshal(b, &img) != nil || len(img.Data) != 1 || !strings.HasPrefix(img.Data[0].URL, base+"/v1/jobs/") {
		t.Fatalf("url image: %d %s", code, b)
	}
	resp, err := http.Get(img.Data[0].URL)
	if err != nil {
		t.Fatal(err)
	}
	png, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "image/png" {
		t.Fatalf("GET %s: %d %s", img.Data[0].URL, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	checkImage(t, png, engine.Spec{Prompt: "a boat", Width: 64, Height: 64, Frames: 1})
}
