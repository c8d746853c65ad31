// Package etcdguard notices when the etcd behind a client is replaced (an
// empty etcd at the same address, a cluster rebuilt from a snapshot) and
// makes every watcher of that client start over.
//
// Without it a replaced etcd strands an idle mesh: every watch resumes at
// a revision the new etcd has not reached, so watchers wait for events that
// will not come for a long time, while reads and writes work and nothing
// looks wrong.
//
// Install wraps a client's KV and Watcher. The KV side reads the header of
// every response: a cluster id that changes, or a linearizable response
// whose revision is lower than one seen before the request was sent (which
// one etcd cluster never gives), means the etcd was replaced. Then every
// open watch gets a compaction response, which every watcher of this
// project already answers by reading its state again, and is closed. A
// watch asked to start past every revision seen since is answered the same
// way at once: its revision came from the etcd that is gone.
package etcdguard

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Guard watches one client's responses for a replaced etcd.
type Guard struct {
	log *zap.Logger

	// clusterID is the cluster the responses come from; 0 until the first.
	clusterID atomic.Uint64
	// linear is the highest revision of a response that etcd guarantees
	// to be at least every revision committed before its request was sent
	// (writes, linearizable reads).
	linear atomic.Int64
	// seen is the highest revision of any response, watch events included:
	// no revision this client can know of is above it.
	seen atomic.Int64
	// resets counts replacements noticed.
	resets atomic.Int64

	mu sync.Mutex
	// gen ends when a replacement is noticed; watches opened under it end
	// with it. A new gen begins at once.
	gen    context.Context
	endGen context.CancelFunc
	hooks  []func()
}

// Install wraps cli's KV and Watcher with a Guard and returns it. Installing
// twice on one client returns the first Guard: in-process agents may share
// a client. Call it before the client is used concurrently.
func Install(cli *clientv3.Client, log *zap.Logger) *Guard {
	if kv, ok := cli.KV.(*guardKV); ok {
		return kv.g
	}
	if log == nil {
		log = zap.NewNop()
	}
	g := &Guard{log: log}
	g.gen, g.endGen = context.WithCancel(context.Background())
	cli.KV = &guardKV{KV: cli.KV, g: g}
	cli.Watcher = &guardWatcher{Watcher: cli.Watcher, g: g}
	return g
}

// Unguarded is a KV of cli's that bypasses a Guard installed on it: a KV
// of its own on cli's connection, or, for a client with none (etcd's
// in-process client), the KV the Guard wraps.
func Unguarded(cli *clientv3.Client) clientv3.KV {
	if cli.ActiveConnection() != nil {
		return clientv3.NewKV(cli)
	}
	if kv, ok := cli.KV.(*guardKV); ok {
		return kv.KV
	}
	return cli.KV
}

// OnReset registers f to run (in its own goroutine) each time a replaced
// etcd is noticed, after the open watches were told.
func (g *Guard) OnReset(f func()) {
	g.mu.Lock()
	g.hooks = append(g.hooks, f)
	g.mu.Unlock()
}

// Resets is how many replacements were noticed.
func (g *Guard) Resets() int64 { return g.resets.Load() }

// generation returns the current generation's context.
func (g *Guard) generation() context.Context {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.gen
}

// sent is what a request notes before it goes: the generation, and the
// highest ordered revision seen so far.
type sent struct {
	gen    context.Context
	before int64
}

func (g *Guard) send() sent {
	g.mu.Lock()
	defer g.mu.Unlock()
	return sent{gen: g.gen, before: g.linear.Load()}
}

// observe checks the header h of a response to a request noted as s.
// linear says whether etcd orders this response after every revision
// committed before the request was sent (writes, linearizable reads).
func (g *Guard) observe(h *etcdserverpb.ResponseHeader, s sent, linear bool) {
	if h == nil || h.ClusterId == 0 {
		return
	}
	if s.gen.Err() != nil {
		// A reset happened while the request was out: its answer may come
		// from either etcd, so it proves nothing either way.
		return
	}
	if old := g.clusterID.Load(); old == 0 {
		g.clusterID.CompareAndSwap(0, h.ClusterId)
	} else if old != h.ClusterId {
		g.reset(s, h, zap.String("reason", "cluster id changed"),
			zap.String("old_cluster", strconv.FormatUint(old, 16)), zap.String("new_cluster", strconv.FormatUint(h.ClusterId, 16)))
		return
	}
	if linear && h.Revision < s.before {
		g.reset(s, h, zap.String("reason", "revision went backwards"),
			zap.Int64("seen", s.before), zap.Int64("now", h.Revision))
		return
	}
	if linear {
		raise(&g.linear, h.Revision)
	}
	raise(&g.seen, h.Revision)
}

// sawRevision notes a revision from a watch response: not ordered, but one
// this client knows of.
func (g *Guard) sawRevision(rev int64) { raise(&g.seen, rev) }

// future reports whether a watch from rev starts past every revision this
// client has seen: rev came from an etcd that is gone.
func (g *Guard) future(rev int64) bool {
	seen := g.seen.Load()
	return seen > 0 && rev > seen+1
}

// reset starts a new generation from the header h of the new etcd,
// unless another response noticed the replacement since s was noted.
func (g *Guard) reset(s sent, h *etcdserverpb.ResponseHeader, why ...zap.Field) {
	g.mu.Lock()
	if s.gen != g.gen {
		g.mu.Unlock()
		return
	}
	g.clusterID.Store(h.ClusterId)
	g.linear.Store(h.Revision)
	g.seen.Store(h.Revision)
	g.resets.Add(1)
	g.endGen()
	g.gen, g.endGen = context.WithCancel(context.Background())
	hooks := append([]func(){}, g.hooks...)
	g.mu.Unlock()
	g.log.Warn("etcd was replaced (empty or restored): every watch starts over from the new etcd", why...)
	for _, f := range hooks {
		go f()
	}
}

func raise(v *atomic.Int64, rev int64) {
	for {
		old := v.Load()
		if rev <= old || v.CompareAndSwap(old, rev) {
			return
		}
	}
}
