package testbed

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/cache"
)

// repairWatch measures, from outside the mesh, how long Store objects go
// short of live copies: from the moment a record names fewer registered
// holders than it wants (a holder's lease expired, or a holder that
// restarted without its copy unlisted itself) to the moment it names R
// registered holders again. It follows the object and node records
// through one etcd watch, as an operator's tool would, and never asks an
// agent. Objects that are deleted while short (consumed, collected) end
// their spell without a sample. Results (pinned) and relayed latents
// (consume) are measured; previews (ttl, one local copy) and cache entries
// are not repaired by design.
type repairWatch struct {
	cli    *clientv3.Client
	prefix string

	mu sync.Mutex
	// mu guards the fields below.
	records  map[string]watchedObject // by object id
	nodes    map[string]bool          // registered node ids
	short    map[string]time.Time     // object id -> when it went short
	times    []time.Duration          // completed repairs
	results  []time.Duration          // of which results
	longest  string                   // the object of the longest spell, and when it ended
	maxSpell time.Duration            // its length
}

// watchedObject is what the watch keeps of an object record.
type watchedObject struct {
	holders  []string
	replicas int
	pinned   bool
}

func newRepairWatch(cli *clientv3.Client, prefix string) *repairWatch {
	return &repairWatch{cli: cli, prefix: prefix, records: map[string]watchedObject{}, nodes: map[string]bool{}, short: map[string]time.Time{}}
}

// run follows etcd until ctx ends: a list, then a watch from its revision;
// a broken watch (an etcd member killed under it) lists again.
func (w *repairWatch) run(ctx context.Context) {
	objects, nodes := cache.ObjectsPrefix(w.prefix), w.prefix+"/nodes/"
	for ctx.Err() == nil {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		resp, err := w.cli.Txn(lctx).Then(clientv3.OpGet(objects, clientv3.WithPrefix()), clientv3.OpGet(nodes, clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
		cancel()
		if err != nil {
			select { // etcd is away (a fault): list again shortly
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
			continue
		}
		w.mu.Lock()
		w.records, w.nodes = map[string]watchedObject{}, map[string]bool{}
		for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
			w.putLocked(strings.TrimPrefix(string(kv.Key), objects), kv.Value)
		}
		for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
			w.nodes[strings.TrimPrefix(string(kv.Key), nodes)] = true
		}
		w.evaluateLocked(time.Now())
		w.mu.Unlock()
		wctx, stop := context.WithCancel(ctx)
		// One watch over the whole mesh prefix, filtered here: objects/
		// and nodes/ in one ordered stream.
		for wr := range w.cli.Watch(wctx, w.prefix+"/", clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1)) {
			if wr.Err() != nil {
				break
			}
			now := time.Now()
			w.mu.Lock()
			for _, ev := range wr.Events {
				key := string(ev.Kv.Key)
				switch {
				case strings.HasPrefix(key, objects):
					id := strings.TrimPrefix(key, objects)
					if ev.Type == clientv3.EventTypeDelete {
						delete(w.records, id)
						delete(w.short, id)
					} else {
						w.putLocked(id, ev.Kv.Value)
					}
				case strings.HasPrefix(key, nodes):
					w.nodes[strings.TrimPrefix(key, nodes)] = ev.Type == clientv3.EventTypePut
				}
			}
			w.evaluateLocked(now)
			w.mu.Unlock()
		}
		stop()
	}
}

func (w *repairWatch) putLocked(id string, value []byte) {
	var r cache.Record
	if json.Unmarshal(value, &r) != nil || (r.Mode != cache.Pinned && r.Mode != cache.Consume) {
		delete(w.records, id)
		delete(w.short, id)
		return
	}
	o := watchedObject{replicas: r.Replicas, pinned: r.Mode == cache.Pinned}
	for _, h := range r.Holders {
		o.holders = append(o.holders, h.Node)
	}
	w.records[id] = o
}

// evaluateLocked starts and ends short spells as of now.
func (w *repairWatch) evaluateLocked(now time.Time) {
	for id, o := range w.records {
		live := 0
		for _, n := range o.holders {
			if w.nodes[n] {
				live++
			}
		}
		since, short := w.short[id]
		switch {
		case live < o.replicas && !short:
			w.short[id] = now
		case live >= o.replicas && short:
			delete(w.short, id)
			if d := now.Sub(since); d > w.maxSpell {
				w.maxSpell = d
				w.longest = fmt.Sprintf("%s (%.1fs, ended %s)", id, d.Seconds(), now.UTC().Format("15:04:05.000"))
			}
			w.times = append(w.times, now.Sub(since))
			if o.pinned {
				w.results = append(w.results, now.Sub(since))
			}
		}
	}
}

// RepairFigures are a chaos run's repair times, in seconds.
type RepairFigures struct {
	Measured int     `json:"measured"` // spells that ended with R live copies
	P50S     float64 `json:"p50_s"`
	P99S     float64 `json:"p99_s"`
	MaxS     float64 `json:"max_s"`
	// ResultsMeasured and ResultsP99S are the same for results alone.
	ResultsMeasured int     `json:"results_measured"`
	ResultsP99S     float64 `json:"results_p99_s"`
	// ShortAtEnd counts objects still short of live copies when the run
	// ended.
	ShortAtEnd int `json:"short_at_end"`
	// Longest names the object of the longest spell, for reading the
	// agents' logs.
	Longest string `json:"longest,omitempty"`
}

func (w *repairWatch) figures() RepairFigures {
	w.mu.Lock()
	defer w.mu.Unlock()
	q := func(ts []time.Duration, p float64) float64 {
		if len(ts) == 0 {
			return 0
		}
		s := slices.Clone(ts)
		slices.Sort(s)
		return s[min(len(s)-1, int(p*float64(len(s))))].Seconds()
	}
	return RepairFigures{
		Measured: len(w.times), P50S: q(w.times, 0.5), P99S: q(w.times, 0.99), MaxS: q(w.times, 1),
		ResultsMeasured: len(w.results), ResultsP99S: q(w.results, 0.99), ShortAtEnd: len(w.short), Longest: w.longest,
	}
}
