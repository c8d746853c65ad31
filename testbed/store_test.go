package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

const prefix = "/latentmesh/default"

// objects reads the Store's records whose id starts with idPrefix.
func objects(t *testing.T, cli *clientv3.Client, idPrefix string) []cache.Record {
	t.Helper()
	resp, err := cli.Get(context.Background(), cache.ObjectsPrefix(prefix)+idPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var out []cache.Record
	for _, kv := range resp.Kvs {
		var r cache.Record
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			t.Fatalf("record %s: %v", kv.Key, err)
		}
		out = append(out, r)
	}
	return out
}

// storeAgent is an in-process agent config with a Store of the given size.
func storeAgent(cl *Cluster, id string, mode jobs.TransferMode, memory int64, roles ...jobs.Stage) agent.Config {
	ac := cl.cfg.Agent
	ac.NodeID, ac.Roles, ac.Logger = id, roles, cl.cfg.Logger
	ac.TransferMode, ac.StoreMemory = mode, memory
	return ac
}

func addAgent(t *testing.T, cl *Cluster, ac agent.Config) *agent.Agent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, err := cl.AddAgentConfig(ctx, ac)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// waitStage waits until job id is queued or running at stage st.
func waitStage(t *testing.T, a *agent.Agent, id string, st jobs.Stage) {
	t.Helper()
	eventually(t, 60*time.Second, func() error {
		j, err := a.Get(context.Background(), id)
		if err != nil {
			return err
		}
		if j.State.Terminal() {
			return fmt.Errorf("job %s ended %s before reaching %s", id, j.State, st)
		}
		if j.Stage != st {
			return fmt.Errorf("job %s at %s, want %s", id, j.Stage, st)
		}
		return nil
	})
}

// With --transfer-mode store the denoise agent's arena holds nothing of a
// job once it has handed the latent on, before decode of that job starts:
// the latent waits in the Store (the RFC's point: the denoise GPU is free).
func TestStoreRelayFreesProducerBeforeDecode(t *testing.T) {
	cl := startCluster(t, "", nil)
	addAgent(t, cl, storeAgent(cl, "enc", jobs.P2P, 8<<20, jobs.Encode))
	addAgent(t, cl, storeAgent(cl, "spare", jobs.P2P, 8<<20, jobs.Encode))
	den := addAgent(t, cl, storeAgent(cl, "den", jobs.StoreRelay, 0, jobs.Denoise))
	ctx := context.Background()
	spec := engine.Spec{Prompt: "a kite over dunes", Seed: 11, Width: 256, Height: 256, Steps: 4}.WithDefaults()
	job, err := cl.Agents[0].Submit(ctx, spec, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	waitStage(t, cl.Agents[0], job.ID, jobs.Decode) // no decode agent yet: it waits there

	st, err := den.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Data.HeldPayloads != 0 || st.Data.ArenaFree != st.Data.ArenaBytes || st.Data.Relayed != 1 {
		t.Fatalf("denoise agent after its handoff: %d payloads held, arena %d of %d free, %d relayed; want 0, all, 1",
			st.Data.HeldPayloads, st.Data.ArenaFree, st.Data.ArenaBytes, st.Data.Relayed)
	}
	latents := objects(t, cl.Client, cache.JobObjectID(job.ID, "denoise."))
	if len(latents) != 1 || latents[0].Mode != cache.Consume || len(latents[0].Holders) != 2 {
		t.Fatalf("the relayed latent in the Store: %+v", latents)
	}
	for _, h := range latents[0].Holders {
		if h.Node == "den" {
			t.Fatal("the denoise agent, which lends no Store memory, holds a copy")
		}
	}

	addAgent(t, cl, storeAgent(cl, "dec", jobs.P2P, 8<<20, jobs.Decode))
	done, err := cl.Agents[0].Wait(ctx, job.ID)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v %v", done, err)
	}
	data, _, err := cl.Agents[0].Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, spec)) {
		t.Fatal("store-relayed job's file differs from the engine run in one process")
	}
	// Consumed: the latent's record went with the decode commit.
	eventually(t, 10*time.Second, func() error {
		if left := objects(t, cl.Client, cache.JobObjectID(job.ID, "denoise.")); len(left) != 0 {
			return fmt.Errorf("consumed latent still recorded: %+v", left)
		}
		return nil
	})
}

// Fill the Store: unconsumed latents go to memory, then spill to disk, and
// are consumed byte-identically later; once disk is full too, submissions
// get a 503 with a clear message, and every job accepted before completes.
func TestStoreSpillsThenRefuses(t *testing.T) {
	cl := startCluster(t, "", nil)
	spill := t.TempDir()
	holder := storeAgent(cl, "enc", jobs.StoreRelay, 200<<10, jobs.Encode)
	holder.Store.SpillDir, holder.Store.SpillCapacity = spill, 200<<10
	enc := addAgent(t, cl, holder)
	addAgent(t, cl, storeAgent(cl, "den", jobs.StoreRelay, 0, jobs.Denoise))
	api := httpapi.Client{BaseURL: "http://" + enc.HTTPAddr()}
	ctx := context.Background()

	// 512x512: a 64 KiB latent. With no decode agent every latent stays.
	var accepted []jobs.Job
	var refused *httpapi.APIError
	for i := 0; i < 12 && refused == nil; i++ {
		seed, side, steps := int64(100+i), 512, 2
		j, err := api.Submit(ctx, httpapi.JobRequest{Prompt: "a tide pool", Seed: &seed, Width: &side, Height: &side, Steps: &steps, TransferMode: "store"})
		if errors.As(err, &refused) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		accepted = append(accepted, j)
		// Settle: the job reaches decode (its latent relayed), or waits for
		// room at denoise when the Store is full.
		eventually(t, 30*time.Second, func() error {
			got, err := api.Get(ctx, j.ID)
			if err != nil {
				return err
			}
			if got.Stage == jobs.Decode {
				return nil
			}
			if st, _ := enc.Status(ctx); st.Store.MemoryCapacity-st.Store.MemoryUsed < 64<<10 && st.Store.DiskCapacity-st.Store.DiskUsed < 64<<10 {
				return nil
			}
			return fmt.Errorf("job %s at %s", j.ID, got.Stage)
		})
	}
	if refused == nil {
		t.Fatalf("%d jobs accepted into a 400 KiB Store of 64 KiB latents; none refused", len(accepted))
	}
	if refused.Status != http.StatusServiceUnavailable || refused.Code != httpapi.CodeOverloaded || !strings.Contains(refused.Message, "Store has no room") {
		t.Fatalf("refusal: %d %s %q", refused.Status, refused.Code, refused.Message)
	}
	// Count once no copy is staged any more (the last accepted job's latent
	// may still be in flight): every copy is then named by a record.
	var inMemory, onDisk int
	eventually(t, 30*time.Second, func() error {
		if st, err := enc.Status(ctx); err != nil || st.Store.Staged != 0 {
			return fmt.Errorf("copies still staged (%v)", err)
		}
		inMemory, onDisk = 0, 0
		for _, r := range objects(t, cl.Client, "") {
			for _, h := range r.Holders {
				switch h.Tier {
				case cache.Memory:
					inMemory++
				case cache.Disk:
					onDisk++
				}
			}
		}
		if files, _ := filepath.Glob(filepath.Join(spill, "enc", "*.spill")); len(files) != onDisk {
			return fmt.Errorf("%d spill files for %d disk copies", len(files), onDisk)
		}
		return nil
	})
	if inMemory == 0 || onDisk == 0 {
		t.Fatalf("latents in memory %d, on disk %d: want both tiers used", inMemory, onDisk)
	}
	t.Logf("%d jobs accepted; Store copies: %d in memory, %d on disk; then: %s", len(accepted), inMemory, onDisk, refused.Message)

	// A decode agent drains the Store: every accepted job completes with
	// the file the engine makes in one process.
	addAgent(t, cl, storeAgent(cl, "dec", jobs.StoreRelay, 0, jobs.Decode))
	for _, j := range accepted {
		wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		done, err := enc.Wait(wctx, j.ID)
		cancel()
		if err != nil || done.State != jobs.Succeeded {
			t.Fatalf("accepted job %s: %+v %v", j.ID, done, err)
		}
		data, _, err := enc.Result(ctx, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data, referenceOutput(t, j.Spec)) {
			t.Fatalf("job %s (relayed via the Store, some latents spilled) differs from the engine run", j.ID)
		}
	}
	// Every latent was consumed and freed; the spill directory holds only
	// what records still name (results may have spilled too).
	eventually(t, 10*time.Second, func() error {
		disk := 0
		for _, r := range objects(t, cl.Client, "") {
			if r.Mode == cache.Consume {
				return fmt.Errorf("latent %s still in the Store", r.ID)
			}
			for _, h := range r.Holders {
				if h.Tier == cache.Disk {
					disk++
				}
			}
		}
		if files, _ := filepath.Glob(filepath.Join(spill, "enc", "*.spill")); len(files) != disk {
			return fmt.Errorf("%d spill files for %d disk copies in the records", len(files), disk)
		}
		return nil
	})
}

// etcd's NOSPACE alarm: submissions get a 503 saying what to do, /readyz
// turns 503 once a write was refused, and both recover once the operator
// frees space and disarms.
func TestNoSpaceAlarmRefusesJobs(t *testing.T) {
	cl := startCluster(t, Colocated, func(c *ClusterConfig) { c.Etcd.QuotaBackendBytes = 16 << 20 })
	a := cl.Agents[0]
	api := httpapi.Client{BaseURL: "http://" + a.HTTPAddr()}
	ctx := context.Background()
	junk := strings.Repeat("x", 1<<20)
	for i := 0; ; i++ {
		if _, err := cl.Client.Put(ctx, fmt.Sprintf("/junk/%d", i), junk); err != nil {
			if !jobs.IsNoSpace(err) {
				t.Fatal(err)
			}
			break
		}
		if i > 64 {
			t.Fatal("a 16 MiB quota took 64 MiB of puts")
		}
	}
	readyz := func() int {
		resp, err := http.Get("http://" + a.AdminAddr() + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// The agent has written nothing since etcd filled up, so it does not
	// know yet (it polls the alarm only once a write was refused): its
	// first submission is refused by etcd, answered 503 with what to do,
	// and from then on /readyz says so too.
	_, err := api.Submit(ctx, httpapi.JobRequest{Prompt: "a full disk"})
	var apiErr *httpapi.APIError
	if !errors.As(err, &apiErr) || apiErr.Status != http.StatusServiceUnavailable || !strings.Contains(apiErr.Message, "etcdctl alarm disarm") {
		t.Fatalf("submit under NOSPACE: %v", err)
	}
	if code := readyz(); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz %d once a write was refused for NOSPACE", code)
	}
	_, err = api.Submit(ctx, httpapi.JobRequest{Prompt: "still full"})
	if !errors.As(err, &apiErr) || apiErr.Status != http.StatusServiceUnavailable || !strings.Contains(apiErr.Message, "etcdctl alarm disarm") {
		t.Fatalf("second submit under NOSPACE: %v", err)
	}

	// The operator's recovery, as etcdctl makes it (over gRPC): delete,
	// compact, defragment, disarm.
	op, err := NewEtcdClient(cl.Etcd.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close()
	resp, err := op.Delete(ctx, "/junk/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := op.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	if _, err := op.Defragment(ctx, cl.Etcd.Endpoints()[0]); err != nil {
		t.Fatal(err)
	}
	alarms, err := op.AlarmList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, al := range alarms.Alarms {
		if _, err := op.AlarmDisarm(ctx, (*clientv3.AlarmMember)(al)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, func() error {
		if code := readyz(); code != http.StatusOK {
			return fmt.Errorf("/readyz %d after disarm", code)
		}
		return nil
	})
	steps := 2
	j, err := api.Submit(ctx, httpapi.JobRequest{Prompt: "room again", Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := api.Wait(ctx, j.ID, 30*time.Second); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job after recovery: %+v %v", done, err)
	}
}

// 500 jobs, images and videos, through a mesh on an external etcd started
// with default flags (1.5 MiB requests, 2 GiB quota): every job succeeds,
// etcd holds no file bytes, and a finished job costs at most 4 KiB of etcd.
// After the result TTL and the job retention (shortened here) nothing of the
// jobs is left in etcd or the Store.
func TestManyJobsOnDefaultExternalEtcd(t *testing.T) {
	// Beside TestIdleAgentEtcdLoad, which idles: on an external etcd
	// process, it adds no proposal to the embedded etcd that test counts.
	t.Parallel()
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no etcd binary and not root to install it: %v", err)
		}
		t.Fatal(err)
	}
	ctx := context.Background()
	ecfg := DefaultEtcdProcessConfig()
	ecfg.Dir = t.TempDir()
	etcd, err := StartEtcdProcess(ctx, ecfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { etcd.Close() })
	const resultTTL, retention = 10 * time.Second, 15 * time.Second
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.EtcdEndpoints = etcd.Endpoints()
		c.Agent.ResultTTL = resultTTL
		c.Agent.Jobs.Retention = retention
	})
	n := 500
	if testing.Short() {
		n = 100
	}
	specs := make([]engine.Spec, n)
	for i := range specs {
		specs[i] = engine.Spec{Prompt: fmt.Sprintf("tiny job %d", i), Seed: int64(i), Width: 64, Height: 64, Steps: 2}.WithDefaults()
		if i%10 == 0 {
			specs[i].Frames = 4 // a video: previews and a GIF
		}
	}
	start := time.Now()
	var wg sync.WaitGroup
	ids := make([]string, n)
	errs := make(chan error, n)
	sem := make(chan struct{}, 32) // 32 clients
	for i := range specs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			a := cl.Agents[i%len(cl.Agents)]
			j, err := a.Submit(ctx, specs[i], jobs.Options{Class: routing.Standard})
			if err != nil {
				errs <- err
				return
			}
			ids[i] = j.ID
			wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			defer cancel()
			done, err := a.Wait(wctx, j.ID)
			if err == nil && done.State != jobs.Succeeded {
				err = fmt.Errorf("job %s %s: %+v", j.ID, done.State, done.Error)
			}
			if err == nil {
				var data []byte
				if data, _, err = a.Result(ctx, j.ID); err == nil && len(data) == 0 {
					err = fmt.Errorf("job %s: empty result", j.ID)
				}
			}
			if err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	took := time.Since(start)

	// A video's frame previews outlive its commit a moment, for streams
	// still reading the last one (agent.dropPreviewsLater): not what a
	// finished job keeps.
	eventually(t, 30*time.Second, func() error {
		resp, err := cl.Client.Get(ctx, prefix+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return err
		}
		for _, kv := range resp.Kvs {
			if strings.Contains(string(kv.Key), ".frame.") {
				return fmt.Errorf("frame preview %s still in etcd", kv.Key)
			}
		}
		return nil
	})

	// What etcd holds now: job records, result object records and their
	// holders' markers, no file bytes. Jobs whose retention passed during the run are gone already;
	// the cost of a finished job is measured on those still there.
	resp, err := cl.Client.Get(ctx, prefix+"/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	perKey := map[string]int{}  // job id -> bytes of its record and objects
	entries, entryBytes := 0, 0 // conditioning cache entries: no job's
	ended := 0                  // waiters' copies of finished records
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if bytes.Contains(kv.Value, []byte("\x89PNG")) || bytes.Contains(kv.Value, []byte("GIF8")) {
			t.Fatalf("file bytes in etcd at %s", k)
		}
		switch {
		case strings.HasPrefix(k, prefix+"/nodes/"):
		case strings.HasPrefix(k, cache.ObjectsPrefix(prefix)+"cond."):
			entries++
			entryBytes += len(kv.Key) + len(kv.Value)
		case strings.HasPrefix(k, prefix+"/jobs/"):
			perKey[strings.TrimPrefix(k, prefix+"/jobs/")] += len(kv.Key) + len(kv.Value)
		case strings.HasPrefix(k, prefix+"/ended/"):
			// A finished job's copy for its waiters, for ten minutes
			// (jobs.Store.Wait): not what a job keeps.
			ended++
		case strings.HasPrefix(k, cache.ObjectsPrefix(prefix)):
			id, _, _ := strings.Cut(strings.TrimPrefix(k, cache.ObjectsPrefix(prefix)), ".")
			perKey[id] += len(kv.Key) + len(kv.Value)
		case strings.HasPrefix(k, prefix+"/holders/"):
			// A Store holder's marker of an object: an entry's, or a job's.
			_, obj, _ := strings.Cut(strings.TrimPrefix(k, prefix+"/holders/"), "/")
			if strings.HasPrefix(obj, "cond.") {
				entryBytes += len(kv.Key)
				break
			}
			id, _, _ := strings.Cut(obj, ".")
			perKey[id] += len(kv.Key) + len(kv.Value)
		default:
			t.Errorf("left in etcd after every job finished: %s", k)
		}
	}
	total, worst := 0, 0
	for _, b := range perKey {
		total += b
		worst = max(worst, b)
	}
	if len(perKey) == 0 {
		t.Fatal("every job expired before it could be measured: lengthen the retention")
	}
	t.Logf("%d jobs in %v (%.0f jobs/s); etcd holds %d bytes per finished job on average, %d at most (%d jobs still recorded)",
		n, took.Round(time.Millisecond), float64(n)/took.Seconds(), total/len(perKey), worst, len(perKey))
	if ended > n {
		t.Errorf("%d ended keys for %d jobs: want one a job at most", ended, n)
	}
	if worst > 4096 {
		t.Errorf("a finished job takes %d bytes of etcd, want at most 4 KiB", worst)
	}
	// Each prompt is new: an entry each, and one for the empty negative
	// prompt, within the entries each agent may hold.
	t.Logf("conditioning cache entries: %d records, %d bytes of etcd (%d each)", entries, entryBytes, entryBytes/max(entries, 1))
	for _, a := range cl.Agents {
		if st, err := a.Status(ctx); err != nil || st.Store.CacheEntries > 512 {
			t.Errorf("%s holds %d cache entries, more than an agent's 512 (%v)", a.ID(), st.Store.CacheEntries, err)
		}
	}
	// The Store holds results within their TTL, nothing else: no latent,
	// no preview. (The first results may have expired already.)
	left := slices.DeleteFunc(objects(t, cl.Client, ""), func(r cache.Record) bool { return r.Mode == cache.Cache && strings.HasPrefix(r.ID, "cond.") })
	for _, r := range left {
		if r.Mode != cache.Pinned || !strings.HasSuffix(r.ID, ".result") || r.ExpiresAt.IsZero() {
			t.Errorf("left in the Store after every job finished: %s (%s)", r.ID, r.Mode)
		}
	}
	sum := cache.Summarize(left)
	t.Logf("Store after the run: %d results (%d bytes in %d copies), %d pending consumers", sum.Objects, sum.Bytes, sum.Copies, sum.PendingConsumers)

	// After the TTL and the retention, nothing is left.
	eventually(t, resultTTL+retention+30*time.Second, func() error {
		r, err := cl.Client.Get(ctx, prefix+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return err
		}
		for _, kv := range r.Kvs {
			k := string(kv.Key)
			_, marked, _ := strings.Cut(strings.TrimPrefix(k, prefix+"/holders/"), "/") // an entry's marker
			if !strings.HasPrefix(k, prefix+"/nodes/") && !strings.HasPrefix(k, cache.ObjectsPrefix(prefix)+"cond.") &&
				!(strings.HasPrefix(k, prefix+"/holders/") && strings.HasPrefix(marked, "cond.")) {
				return fmt.Errorf("still in etcd: %s (and %d keys in all)", kv.Key, len(r.Kvs))
			}
		}
		for _, a := range cl.Agents {
			// Conditioning cache entries stay until evicted.
			if st, _ := a.Status(ctx); st.Store.Copies != st.Store.CacheEntries || st.Store.MemoryUsed != st.Store.CacheUsed {
				return fmt.Errorf("%s still holds %d copies (%d bytes) besides its cache entries", a.ID(), st.Store.Copies-st.Store.CacheEntries, st.Store.MemoryUsed-st.Store.CacheUsed)
			}
		}
		return nil
	})
	if _, _, err := cl.Agents[0].Result(ctx, ids[0]); !errors.Is(err, jobs.ErrNotFound) {
		t.Fatalf("result of an expired job: %v", err)
	}
}

// kill -9 of the agent that produced a store-relayed latent, before decode
// starts: the decode completes from a replica, and nothing is rewound (each
// stage ran once).
func TestStoreRelaySurvivesProducerKill(t *testing.T) {
	m := startMesh(t)
	small := []string{"--arena-size", "64MiB"}
	_, enc := m.agent("enc-r", "encode", small...)
	m.agent("spare-r", "encode", small...) // a second Store holder
	den, _ := m.agent("den-r", "denoise", append(small, "--transfer-mode", "store")...)
	c := httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	ctx := context.Background()
	seed, side, steps := int64(5), 128, 6
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a barn owl", Seed: &seed, Width: &side, Height: &side, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	var latent cache.Record
	eventually(t, 60*time.Second, func() error {
		j, err := c.Get(ctx, job.ID)
		if err != nil {
			return err
		}
		if j.Stage != jobs.Decode {
			return fmt.Errorf("job at %s %s", j.State, j.Stage)
		}
		recs := objects(t, m.cli, cache.JobObjectID(job.ID, "denoise."))
		if len(recs) != 1 {
			return fmt.Errorf("%d relayed latents recorded", len(recs))
		}
		latent = recs[0]
		return nil
	})
	if len(latent.Holders) != 2 {
		t.Fatalf("relayed latent has %d holders, want 2: %+v", len(latent.Holders), latent.Holders)
	}
	den.Kill()
	m.agent("dec-r", "decode", small...)
	done, err := c.Wait(ctx, job.ID, 60*time.Second)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job after the producer's kill: %+v %v", done, err)
	}
	if done.Rewinds != 0 || done.Stages[jobs.Encode].Attempt != 1 || done.Stages[jobs.Denoise].Attempt != 1 {
		t.Fatalf("rewound or rerun: rewinds %d, encode attempts %d, denoise attempts %d",
			done.Rewinds, done.Stages[jobs.Encode].Attempt, done.Stages[jobs.Denoise].Attempt)
	}
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, done.Spec)) {
		t.Fatal("file differs from the engine run in one process")
	}
}

// kill -9 of one holder of a finished result: the result is still served,
// and the survivors bring the object back to R replicas.
func TestResultSurvivesHolderKill(t *testing.T) {
	m := startMesh(t)
	small := []string{"--arena-size", "64MiB"}
	procs := map[string]*Process{}
	recs := map[string]string{} // node -> HTTP address
	for _, a := range [][2]string{{"enc-h", "encode"}, {"den-h", "denoise"}, {"dec-h", "decode"}, {"spare-h", "encode"}} {
		p, rec := m.agent(a[0], a[1], small...)
		procs[a[0]], recs[a[0]] = p, rec.HTTPAddr
	}
	ctx := context.Background()
	c := httpapi.Client{BaseURL: "http://" + recs["enc-h"]}
	seed, steps := int64(8), 4
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a paper boat", Seed: &seed, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := c.Wait(ctx, job.ID, 60*time.Second); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v %v", done, err)
	}
	want, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	res := objects(t, m.cli, jobs.ResultID(job.ID))
	if len(res) != 1 || len(res[0].Holders) != 2 {
		t.Fatalf("result object: %+v", res)
	}
	victim := res[0].Holders[0].Node
	procs[victim].Kill()
	// Ask an agent that is not the victim.
	for node, addr := range recs {
		if node != victim {
			c = httpapi.Client{BaseURL: "http://" + addr}
			break
		}
	}
	got, _, err := c.Result(ctx, job.ID)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("result after a holder's kill: %d bytes, %v", len(got), err)
	}
	start := time.Now()
	eventually(t, 30*time.Second, func() error {
		r := objects(t, m.cli, jobs.ResultID(job.ID))
		if len(r) != 1 {
			return fmt.Errorf("result record gone")
		}
		if len(r[0].Holders) != 2 {
			return fmt.Errorf("%d holders", len(r[0].Holders))
		}
		for _, h := range r[0].Holders {
			if h.Node == victim {
				return fmt.Errorf("record still names the killed holder %s", victim)
			}
		}
		return nil
	})
	t.Logf("result back to 2 replicas %v after the kill of %s", time.Since(start).Round(time.Millisecond), victim)
	if got, _, err := c.Result(ctx, job.ID); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("result from the new replicas: %v", err)
	}
}
