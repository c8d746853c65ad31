package testbed

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// startCluster starts a cluster of topology top, with edit (may be nil)
// applied to its config, and closes it when the test ends.
func startCluster(t *testing.T, top Topology, edit func(*ClusterConfig)) *Cluster {
	t.Helper()
	cfg := DefaultClusterConfig()
	cfg.Topology = top
	cfg.Logger = testLogger(t)
	if edit != nil {
		edit(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl, err := StartCluster(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func post(t *testing.T, url, body string) (int, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// The real agent answers bad input with 4xx JSON errors and keeps serving.
func TestAPIOnRealCluster(t *testing.T) {
	cl := startCluster(t, Disaggregated, nil)
	base := "http://" + cl.Agents[1].HTTPAddr() // any agent serves the API

	bad := map[string]string{
		"malformed json":  `{"prompt":`,
		"unknown field":   `{"prompt":"x","colour":"red"}`,
		"size not WxH":    `{"prompt":"x","size":"big"}`,
		"size too large":  `{"prompt":"x","size":"4096x4096"}`,
		"n too large":     `{"prompt":"x","n":100}`,
		"steps too many":  `{"prompt":"x","num_inference_steps":100000}`,
		"empty prompt":    `{"prompt":""}`,
		"bad format":      `{"prompt":"x","response_format":"png"}`,
		"negative n":      `{"prompt":"x","n":-1}`,
		"guidance string": `{"prompt":"x","guidance_scale":"high"}`,
	}
	for name, body := range bad {
		code, b := post(t, base+"/v1/images/generations", body)
		var e struct {
			Error struct{ Message, Type, Code string }
		}
		if code < 400 || code >= 500 || json.Unmarshal(b, &e) != nil || e.Error.Message == "" || e.Error.Code == "" {
			t.Errorf("%s: status %d body %s", name, code, b)
		}
	}

	// A good request still works after all that.
	code, b := post(t, base+"/v1/images/generations", `{"prompt":"a small boat","size":"64x64","n":2,"num_inference_steps":4,"seed":11}`)
	if code != 200 {
		t.Fatalf("good request: %d %s", code, b)
	}
	var ok struct {
		Data []struct {
			B64JSON string `json:"b64_json"`
		}
	}
	if err := json.Unmarshal(b, &ok); err != nil || len(ok.Data) != 2 {
		t.Fatalf("response %s: %v", b, err)
	}
	img0, _ := base64.StdEncoding.DecodeString(ok.Data[0].B64JSON)
	img1, _ := base64.StdEncoding.DecodeString(ok.Data[1].B64JSON)
	checkImage(t, img0, engine.Spec{Prompt: "a small boat", Width: 64, Height: 64, Frames: 1})
	if bytes.Equal(img0, img1) {
		t.Fatal("n=2 returned the same image twice (seeds should differ)")
	}

	// Unknown job ids are 404 JSON.
	resp, err := http.Get(base + "/v1/jobs/doesnotexist")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Fatalf("unknown job: %d", resp.StatusCode)
	}
}

// The admin endpoint reports the node, its peers with roles and credits, and
// queue depths; metrics are Prometheus text.
func TestAdminStatus(t *testing.T) {
	cl := startCluster(t, Disaggregated, nil)
	admin := "http://" + cl.Agents[0].AdminAddr()
	var st agent.Status
	eventually(t, 10*time.Second, func() error {
		resp, err := http.Get(admin + "/v1/admin/status")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		st = agent.Status{}
		if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
			return err
		}
		if len(st.Peers) != 3 {
			return errorf("%d peers, want 3", len(st.Peers))
		}
		// An idle mesh gossips every credit as free.
		slots := agent.DefaultLocalConfig().Slots
		for _, p := range st.Peers {
			if !p.Alive || len(p.Roles) != 1 {
				return errorf("peer %+v", p)
			}
			if role := p.Roles[0]; int(p.Free[role]) != slots[jobs.Stage(role)] {
				return errorf("idle peer %s gossips %d free %s credits, want %d", p.ID, p.Free[role], role, slots[jobs.Stage(role)])
			}
		}
		return nil
	})
	for st2, c := range st.Credits {
		if c.Free != c.Total {
			t.Errorf("idle agent: %s credits %d/%d free", st2, c.Free, c.Total)
		}
	}
	if st.Node.ID != cl.Agents[0].ID() || len(st.Queues) != 3 {
		t.Fatalf("status: %+v", st)
	}
	for _, path := range []string{"/livez", "/readyz"} {
		resp, err := http.Get(admin + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
	}
	resp, err := http.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, name := range []string{"latentmesh_queue_depth", "latentmesh_free_credits"} {
		if !bytes.Contains(b, []byte(name)) {
			t.Errorf("metrics lack %s", name)
		}
	}
}

// A client streams a video's frames while the decode agent is still decoding.
func TestStreamFramesWhileDecoding(t *testing.T) {
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.Agent.Engine.DecodeCost = 4 * time.Second // one second per frame below
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	base := "http://" + cl.Agents[0].HTTPAddr()
	c := &httpapi.Client{BaseURL: base}
	w, h, frames, steps := 96, 64, 4, 4
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "waves", Width: &w, Height: &h, Frames: &frames, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx, "GET", base+"/v1/jobs/"+job.ID+"/frames", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("frames: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	var event string
	seen := map[int]bool{}
	var final jobs.Job
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: ") && event == "frame":
			var f struct {
				Index int    `json:"index"`
				B64   string `json:"b64_png"`
			}
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &f); err != nil {
				t.Fatal(err)
			}
			b, _ := base64.StdEncoding.DecodeString(f.B64)
			checkImage(t, b, engine.Spec{Prompt: "frame", Width: w, Height: h, Frames: 1})
			if len(seen) == 0 {
				// The first frame arrives while the video is still decoding.
				j, err := c.Get(ctx, job.ID)
				if err != nil {
					t.Fatal(err)
				}
				if j.State.Terminal() {
					t.Fatalf("first frame arrived only after the job ended (%s)", j.State)
				}
			}
			seen[f.Index] = true
		case strings.HasPrefix(line, "data: ") && event == "done":
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &final); err != nil {
				t.Fatal(err)
			}
		}
	}
	if final.State != jobs.Succeeded {
		t.Fatalf("stream ended with job %+v", final)
	}
	if len(seen) != frames {
		t.Fatalf("saw frames %v, want %d", seen, frames)
	}
}

// Cancelling a job stops the stage running it at once: the worker's credit
// and the job's payloads are freed without waiting for the stage to end.
func TestCancelStopsRunningStage(t *testing.T) {
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.Agent.Engine.StepCost = 10 * time.Second // the job would take minutes
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + cl.Agents[0].HTTPAddr()}
	steps := 20
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a very slow painting", Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool { return p.Stage == jobs.Denoise })
	if j, err := c.Cancel(ctx, job.ID); err != nil || j.State != jobs.Cancelled {
		t.Fatalf("cancel: %+v %v", j, err)
	}
	denoiser := cl.Agents[1]
	eventually(t, 10*time.Second, func() error {
		st, err := denoiser.Status(ctx)
		if err != nil {
			return err
		}
		if cr := st.Credits[jobs.Denoise]; cr.Free != cr.Total {
			return errorf("denoise credits %d/%d free", cr.Free, cr.Total)
		}
		return nil
	})
	eventually(t, 10*time.Second, func() error {
		for _, a := range cl.Agents {
			st, err := a.Status(ctx)
			if err != nil {
				return err
			}
			// Conditioning cache entries stay: other jobs share them.
			if n := st.Data.HeldPayloads - st.Store.CacheEntries; n != 0 {
				return errorf("%s still holds %d payloads besides %d cache entries", a.ID(), n, st.Store.CacheEntries)
			}
		}
		return nil
	})
}

// An agent whose lease is lost mid-task stops that task (its claim is gone),
// re-registers under a new lease and takes the task again: the job completes
// once, on attempt 2.
func TestLeaseLossMidTask(t *testing.T) {
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.Agent.Engine.StepCost = 300 * time.Millisecond
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + cl.Agents[0].HTTPAddr()}
	steps := 8
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a storm at sea", Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool { return p.Stage == jobs.Denoise && p.Step >= 1 })
	key := "/latentmesh/default/nodes/denoise-1"
	resp, err := cl.Client.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("node record: %v %v", resp, err)
	}
	old := clientv3.LeaseID(resp.Kvs[0].Lease)
	if _, err := cl.Client.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	var done jobs.Job
	eventually(t, 30*time.Second, func() error {
		if done, err = c.Get(ctx, job.ID); err != nil {
			return err
		}
		if !done.State.Terminal() {
			return errorf("job %s", done.State)
		}
		return nil
	})
	if done.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", done.State, done.Error)
	}
	if d := done.Stages[jobs.Denoise]; d.Node != "denoise-1" || d.Attempt != 2 {
		t.Fatalf("denoise stage %+v, want denoise-1 on attempt 2", d)
	}
	resp, err = cl.Client.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 || clientv3.LeaseID(resp.Kvs[0].Lease) == old {
		t.Fatalf("denoise-1 did not re-register under a new lease: %v %v", resp, err)
	}
}

// A result larger than etcd's request limit commits: the file is a Store
// object and the commit carries only its record. (Before the Store, such a
// commit was refused and the job failed with commit_failed.)
func TestLargeResultUnderSmallEtcdLimit(t *testing.T) {
	cl := startCluster(t, Colocated, func(c *ClusterConfig) {
		c.Etcd.MaxRequestBytes = 64 << 10 // smaller than a 512x512 PNG
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + cl.Agents[0].HTTPAddr()}
	side, steps := 512, 2
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a detailed map", Width: &side, Height: &side, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	j, err := c.Wait(ctx, job.ID, 50*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if j.State != jobs.Succeeded || j.Result == nil || j.Result.Bytes <= 64<<10 {
		t.Fatalf("job %s (result %+v, error %+v), want a result over 64 KiB", j.State, j.Result, j.Error)
	}
	data, _, err := c.Result(ctx, job.ID)
	if err != nil || int64(len(data)) != j.Result.Bytes {
		t.Fatalf("result: %d bytes, %v", len(data), err)
	}
	left, err := cl.Client.Get(ctx, "/latentmesh/default/queues/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || left.Count != 0 {
		t.Fatalf("tasks and claims left: %v %v", left.Count, err)
	}
}

// waitProgress waits until the job's running stage satisfies ok.
func waitProgress(t *testing.T, ctx context.Context, c *httpapi.Client, id string, ok func(*jobs.Progress) bool) {
	t.Helper()
	eventually(t, 30*time.Second, func() error {
		j, err := c.Get(ctx, id)
		if err != nil {
			return err
		}
		if j.Progress == nil || !ok(j.Progress) {
			return errorf("job %s: state %s, progress %+v", id, j.State, j.Progress)
		}
		return nil
	})
}
