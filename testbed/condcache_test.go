package testbed

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// negativeHit reports whether job j's negative prompt came from the
// conditioning cache: its whole encode was (Cached), or the encode that
// ran found that half (CacheHits).
func negativeHit(j jobs.Job) bool {
	enc := j.Stages[jobs.Encode]
	return enc != nil && (enc.Cached || slices.Contains(enc.CacheHits, "negative"))
}

// The conditioning cache on a 3-agent mesh, each agent serving every stage
// (issue 19, done-when 1): 100 jobs sharing a negative prompt, one after
// another, then 100 more at once with a new one, each set finding its
// negative prompt in the cache for all but the first job (the burst's
// encoders wait for the one that encodes it); repeated prompts skip the
// encode stage whichever agent takes them; every file is the bytes an
// uncached mesh makes; and each agent's entries stay within its room.
func TestCondCacheAcrossMesh(t *testing.T) {
	const room = 512 << 10 // 26 entries of 19.7 KiB: the prompts below need evicting
	cl := startCluster(t, "", func(c *ClusterConfig) { c.Agent.CondCacheBytes = room })
	for i := range 3 {
		if _, err := cl.AddAgent(context.Background(), fmt.Sprintf("node-%d", i), jobs.Stages()...); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	spec := func(prompt, negative string, seed int64) engine.Spec {
		return engine.Spec{Prompt: prompt, NegativePrompt: negative, Seed: seed, Width: 64, Height: 64, Steps: 2, Frames: 1}.WithDefaults()
	}
	submit := func(a *agent.Agent, s engine.Spec) string {
		t.Helper()
		j, err := a.Submit(ctx, s, jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		return j.ID
	}

	// One after another: the first job encodes the negative prompt, the
	// 99 after it find it, whichever agent takes them.
	first := map[int]jobs.Job{}
	hits := 0
	for i := range 100 {
		a := cl.Agents[i%3]
		j := waitSucceeded(t, ctx, a, submit(a, spec(fmt.Sprintf("a lighthouse number %d", i), "blurry, low quality", int64(i))))
		if negativeHit(j) {
			hits++
		}
		if i >= 97 {
			first[i] = j // the newest entries: still in their holders' rooms
		}
	}
	t.Logf("one after another: %d of 100 negative-prompt hits", hits)
	if hits < 99 {
		t.Fatalf("one after another: %d negative-prompt hits, want at least 99", hits)
	}

	// A repeated prompt skips encode, taken by another agent than the
	// first time, and makes the same file.
	for i, j0 := range first {
		a := cl.Agents[(i+1)%3] // not the agent the first was submitted to
		j := waitSucceeded(t, ctx, a, submit(a, j0.Spec))
		enc := j.Stages[jobs.Encode]
		if enc == nil || !enc.Cached {
			t.Fatalf("repeat of job %d: encode %+v, want cached", i, enc)
		}
		if j.Stages[jobs.Denoise] == nil || j.Result.SHA256 != j0.Result.SHA256 {
			t.Fatalf("repeat of job %d: result %+v, first %+v", i, j.Result, j0.Result)
		}
		t.Logf("repeat of job %d submitted to %s: encode cached on %s (first encoded on %s)", i, a.ID(), enc.Node, j0.Stages[jobs.Encode].Node)
	}

	// At once, with a negative prompt no job had: it is encoded once.
	ids := make([]string, 100)
	var wg sync.WaitGroup
	for i := range ids {
		a := cl.Agents[i%3]
		wg.Go(func() {
			ids[i] = submit(a, spec(fmt.Sprintf("a red barn number %d", i), "oversaturated, watermark", int64(i)))
		})
	}
	wg.Wait()
	hits = 0
	for i, id := range ids {
		if negativeHit(waitSucceeded(t, ctx, cl.Agents[i%3], id)) {
			hits++
		}
	}
	t.Logf("at once: %d of 100 negative-prompt hits", hits)
	if hits < 99 {
		t.Fatalf("at once: %d negative-prompt hits, want at least 99", hits)
	}

	// Within each agent's room, and the room was needed: entries went.
	var evictions int64
	for _, a := range cl.Agents {
		st, err := a.StoreStatus(ctx, "", false)
		if err != nil {
			t.Fatal(err)
		}
		if st.Local.CacheUsed > room || st.Local.CacheCapacity != room {
			t.Fatalf("%s: %d bytes of cache entries, room %d (want at most %d)", a.ID(), st.Local.CacheUsed, st.Local.CacheCapacity, room)
		}
		evictions += st.Local.Evictions
	}
	if evictions == 0 {
		t.Fatal("300 entries in 3 rooms of 26 evicted nothing")
	}
}

// An uncached mesh makes the same files: the cache changes where the
// conditioning comes from, never what it is.
func TestCondCacheSameBytesAsUncached(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	run := func(room int64) []string {
		cl := startCluster(t, Colocated, func(c *ClusterConfig) { c.Agent.CondCacheBytes = room })
		var out []string
		for i := range 4 {
			s := engine.Spec{Prompt: fmt.Sprintf("a fox %d", i%2), NegativePrompt: "blurry", Seed: 5, Width: 64, Height: 64, Steps: 3, Frames: 1}.WithDefaults()
			j, err := cl.Agents[0].Submit(ctx, s, jobs.Options{Class: routing.Standard})
			if err != nil {
				t.Fatal(err)
			}
			j = waitSucceeded(t, ctx, cl.Agents[0], j.ID)
			out = append(out, j.Result.SHA256)
			if enc := j.Stages[jobs.Encode]; room == 0 && (enc.Cached || len(enc.CacheHits) > 0) {
				t.Fatalf("cache off, but job %d's encode says %+v", i, enc)
			}
		}
		return out
	}
	cached, uncached := run(1<<20), run(0)
	if !slices.Equal(cached, uncached) {
		t.Fatalf("files differ with the cache on:\n%v\n%v", cached, uncached)
	}
}

// An encoder's new version invalidates its entries (issue 19, done-when
// 1): an external engine that registers again as another version has the
// entries of the old one dropped, and the same request is encoded again.
func TestCondCacheEncoderVersionChange(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl := startCluster(t, "", nil)
	gpu := addEngineAgent(t, ctx, cl, "gpu", t.TempDir(), jobs.Stages()...)
	models := []extengine.Model{{
		Name: "cond-stub", Stages: []string{"encode", "denoise", "decode"}, DefaultSteps: 2,
		Cond:   extengine.Layout{DType: "float32", Shape: []int64{2, 16, 8}},
		Latent: extengine.LatentLayout{DType: "float32", Channels: 4, Scale: 8},
	}}
	// The stub encodes, and fails every denoise: each job ends there.
	run := func() jobs.Job {
		t.Helper()
		j, err := gpu.Submit(ctx, engine.Spec{Model: "cond-stub", Prompt: "a quiet harbour", NegativePrompt: "blurry", Width: 64, Height: 64, Steps: 2, Frames: 1}, jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		if j, err = gpu.Wait(ctx, j.ID); err != nil || j.Stages[jobs.Encode] == nil {
			t.Fatalf("job %s: %+v %v", j.ID, j, err)
		}
		return j
	}
	entries := func() []string {
		t.Helper()
		st, err := gpu.StoreStatus(ctx, "", true)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, r := range st.Objects {
			if strings.HasPrefix(r.ID, "cond.") {
				ids = append(ids, r.ID)
			}
		}
		return ids
	}
	served := func(version string) {
		t.Helper()
		for !gpu.ModelServed("cond-stub") || gpu.Engine() == nil || gpu.Engine().Engine != version {
			if ctx.Err() != nil {
				t.Fatalf("engine %s never served", version)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	disconnect := stubEngineAs(t, ctx, gpu.EngineSocket(), "stub/1", true, models)
	served("stub/1")
	if enc := run().Stages[jobs.Encode]; enc.Cached || len(enc.CacheHits) > 0 {
		t.Fatalf("first run: encode %+v, want a miss", enc)
	}
	old := entries()
	if len(old) != 1 || !strings.Contains(old[0], ".w.") {
		t.Fatalf("entries after the first run: %v, want one whole-conditioning entry", old)
	}
	for !run().Stages[jobs.Encode].Cached {
		// The node record naming the encoder reaches this agent's view
		// of nodes/ a watch event after the registration.
		if ctx.Err() != nil {
			t.Fatal("the second run never found the conditioning in the cache")
		}
	}
	disconnect()
	for gpu.Engine() != nil {
		if ctx.Err() != nil {
			t.Fatal("the agent never saw its engine go")
		}
		time.Sleep(20 * time.Millisecond)
	}
	stubEngineAs(t, ctx, gpu.EngineSocket(), "stub/2", true, models)
	served("stub/2")
	for slices.Contains(entries(), old[0]) {
		if ctx.Err() != nil {
			t.Fatal("the old version's entry was never dropped")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if enc := run().Stages[jobs.Encode]; enc.Cached || len(enc.CacheHits) > 0 {
		t.Fatalf("after the version change: encode %+v, want a miss", enc)
	}
	if now := entries(); len(now) != 1 || now[0] == old[0] {
		t.Fatalf("entries after the change: %v (old %v)", now, old)
	}
}

// A cache entry evicted while its job waits for the denoise costs the job
// an encode, not its result: an encoder running ahead of a slow denoise
// fills a room of three entries with twelve jobs' prompts, so the denoise
// finds most of its prompts gone and the job is rewound; the rewound
// encode makes a plain payload, which no eviction takes, and every job
// succeeds with the bytes of an uncached run.
func TestCondCacheEntryEvictedBeforeDenoise(t *testing.T) {
	const entry = 19_712 // one text's half of a 64x64 conditioning
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Agent.CondCacheBytes = 3 * entry
		c.Agent.Admission.Slack = 12 // the encoder runs ahead of the denoise
		c.Agent.Engine.StepCost = 25 * time.Millisecond
	})
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 4, nil))
	addAgent(t, cl, schedAgent(cl, "den", jobs.Denoise, 1, nil))
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 2, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	entry0 := cl.Agents[0]
	spec := func(i int) engine.Spec {
		return engine.Spec{Prompt: fmt.Sprintf("a kite number %d", i), NegativePrompt: "blurry", Seed: int64(i), Width: 64, Height: 64, Steps: 4, Frames: 1}.WithDefaults()
	}
	var ids []string
	for i := range 12 {
		j, err := entry0.Submit(ctx, spec(i), jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, j.ID)
	}
	rewound := 0
	got := map[int]string{}
	for i, id := range ids {
		j := waitSucceeded(t, ctx, entry0, id)
		if j.Rewinds > 0 {
			rewound++
			if enc := j.Stages[jobs.Encode]; enc == nil || enc.Cached || len(enc.CacheHits) > 0 {
				t.Fatalf("job %d was rewound, and its encode %+v still came from the cache", i, enc)
			}
		}
		got[i] = j.Result.SHA256
	}
	t.Logf("12 jobs through a room of 3 entries: %d rewound after their entries went, all succeeded", rewound)
	if rewound == 0 {
		t.Fatal("no job lost its entry: the room was meant to be too small for the queue")
	}
	// The same bytes as a mesh without the cache.
	plain := startCluster(t, Colocated, func(c *ClusterConfig) { c.Agent.CondCacheBytes = 0 })
	for _, i := range []int{0, 5, 11} {
		j, err := plain.Agents[0].Submit(ctx, spec(i), jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		if want := waitSucceeded(t, ctx, plain.Agents[0], j.ID).Result.SHA256; got[i] != want {
			t.Fatalf("job %d: %s with the cache, %s without", i, got[i], want)
		}
	}
}
