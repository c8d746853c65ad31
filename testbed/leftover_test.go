package testbed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// With the conditioning cache, the denoiser's tensor cache and step
// checkpoints on, 500 jobs (repeated prompts, a few hot negative prompts,
// some cancelled) leave nothing behind once they are deleted but cache
// entries within each agent's room (issue 19, done-when 7): in etcd no key
// but the nodes' registrations, the entries' records and their holders'
// markers; on each agent no
// Store copy but the entries, no payload but those copies, and no arena
// byte but theirs.
func TestNothingLeftAfter500Jobs(t *testing.T) {
	const room = 256 << 10 // 13 entries of 19.7 KiB per agent: eviction is exercised
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.Agent.CondCacheBytes = room
		c.Agent.CheckpointEvery = 2
	})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	entry := cl.Agents[0]
	hot := []string{"blurry, low quality", "watermark, text", ""}
	specOf := func(i int) engine.Spec {
		neg := hot[i%len(hot)]
		if i%7 == 0 {
			neg = fmt.Sprintf("a one-off dislike %d", i)
		}
		return engine.Spec{Prompt: fmt.Sprintf("a harbour scene %d", i%40), NegativePrompt: neg, Seed: int64(i),
			Width: 64, Height: 64, Steps: 4, Frames: 1}.WithDefaults()
	}
	ids := make([]string, 500)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 24) // jobs in flight at once
	for i := range ids {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			j, err := entry.Submit(ctx, specOf(i), jobs.Options{Class: routing.Standard})
			if err != nil {
				t.Errorf("submit %d: %v", i, err)
				return
			}
			ids[i] = j.ID
			if i%50 == 25 {
				if _, err := entry.Cancel(ctx, j.ID); err != nil && !errors.Is(err, jobs.ErrFinished) {
					t.Errorf("cancel %d: %v", i, err)
				}
			}
			if j, err = entry.Wait(ctx, j.ID); err != nil || (j.State != jobs.Succeeded && j.State != jobs.Cancelled) {
				t.Errorf("job %d: %s %v", i, j.State, err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	for _, id := range ids {
		if err := entry.Delete(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}

	prefix := cl.cfg.Agent.Jobs.Prefix
	objects := cache.ObjectsPrefix(prefix)
	var last string
	deadline := time.Now().Add(time.Minute)
	for {
		left, err := leftovers(ctx, cl, prefix, objects, room)
		if err == nil && len(left) == 0 {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if s := strings.Join(left, "\n"); s != last {
			last = s
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after the last delete, left behind:\n%s", last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// leftovers lists what the mesh holds beyond nodes' registrations and
// conditioning cache entries within room.
func leftovers(ctx context.Context, cl *Cluster, prefix, objects string, room int64) ([]string, error) {
	align := cl.cfg.Agent.Transfer.Arena.Align
	resp, err := cl.Client.Get(ctx, prefix+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	var left []string
	entries := map[string]int{}     // holder -> entries its records name
	named := map[string]bool{}      // "<holder>/<entry>" for each holder an entry's record names
	var markers []string            // "<holder>/<object>" for each holder marker
	holders := prefix + "/holders/" // cache's markers: <holder>/<object id>
	for _, kv := range resp.Kvs {
		key := string(kv.Key)
		switch {
		case strings.HasPrefix(key, prefix+"/nodes/"):
			continue
		case strings.HasPrefix(key, holders):
			markers = append(markers, strings.TrimPrefix(key, holders))
			continue
		case strings.HasPrefix(key, objects):
			var r cache.Record
			if json.Unmarshal(kv.Value, &r) == nil && r.Mode == cache.Cache && r.Job == "" && strings.HasPrefix(r.ID, "cond.") {
				for _, h := range r.Holders {
					entries[h.Node]++
					named[h.Node+"/"+r.ID] = true
				}
				continue
			}
		}
		left = append(left, "etcd key "+key)
	}
	for _, m := range markers {
		if !named[m] { // an entry's holder keeps its marker; nothing else does
			left = append(left, "etcd key "+holders+m)
		}
	}
	for _, a := range cl.Agents {
		st, err := a.Status(ctx)
		if err != nil {
			return nil, err
		}
		d, s := st.Data, st.Store
		switch {
		case s.Copies != entries[a.ID()]:
			left = append(left, fmt.Sprintf("%s holds %d Store copies, %d cache entries name it", a.ID(), s.Copies, entries[a.ID()]))
		case d.HeldPayloads != s.Copies || d.HeldBytes != s.CacheUsed:
			left = append(left, fmt.Sprintf("%s holds %d payloads of %d bytes; its %d cache entries are %d bytes", a.ID(), d.HeldPayloads, d.HeldBytes, s.Copies, s.CacheUsed))
		case d.ArenaBytes-d.ArenaFree > s.CacheUsed+int64(s.Copies)*(align-1):
			// Each buffer is rounded up to the arena's alignment.
			left = append(left, fmt.Sprintf("%s uses %d arena bytes; its %d cache entries are %d", a.ID(), d.ArenaBytes-d.ArenaFree, s.Copies, s.CacheUsed))
		case s.CacheUsed > room:
			left = append(left, fmt.Sprintf("%s holds %d bytes of cache entries, room %d", a.ID(), s.CacheUsed, room))
		}
	}
	return left, nil
}
