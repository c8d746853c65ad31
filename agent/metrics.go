package agent

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/status"

	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// This file feeds the agent's Prometheus series (httpapi.Metrics) from the
// places the figures live; docs/metrics.md says what each series means.

// Requeue reasons, as execute names them.
const (
	reasonPreempted = httpapi.ReasonPreempted
	reasonDrained   = httpapi.ReasonDrained
	reasonRetry     = httpapi.ReasonRetry
)

// agentStats is what the metrics read at every scrape.
func (a *Agent) agentStats() httpapi.AgentStats {
	xs := a.xfer.Stats()
	st := httpapi.AgentStats{
		HeapPublishes:  xs.HeapFallbacks,
		HeapPulls:      a.heapPulls.Load(),
		Members:        map[string]int{},
		ExternalEngine: a.ext != nil,
	}
	for purpose, by := range map[string]map[string]transfer.PullTotals{"stage": xs.Transfers, "store": xs.StoreTransfers} {
		for tr, t := range by {
			st.Transfers = append(st.Transfers, httpapi.TransferStats{Purpose: purpose, Transport: tr, Pulls: t.Pulls, Bytes: t.Bytes, Time: t.Time})
		}
	}
	if a.ext != nil {
		st.EngineRegistered = a.ext.Engine() != nil
	}
	for _, p := range a.member.Peers() {
		switch {
		case !p.Alive:
			st.Members["dead"]++
		case p.Suspect:
			st.Members["suspect"]++
		default:
			st.Members["alive"]++
		}
	}
	return st
}

// Claims is how this agent's tasks were claimed so far, per stage it
// serves: its claim transactions, the conflicts among them, and the claims
// pushed to it that it started or gave back (the latentmesh_claim_* and
// latentmesh_pushed_claims_total series). For an in-process caller that
// does not scrape, such as `latentmesh-dev bench serve`.
func (a *Agent) Claims() map[jobs.Stage]httpapi.ClaimCounts {
	out := make(map[jobs.Stage]httpapi.ClaimCounts, len(a.cfg.Roles))
	for _, st := range a.cfg.Roles {
		out[st] = a.metrics.Claims(st)
	}
	return out
}

// chainFrame notes each engine frame with note, then hands it to next
// (extengine.Config.OnFrame), if any.
func chainFrame(note func(), next func(string)) func(string) {
	return func(t string) {
		note()
		if next != nil {
			next(t)
		}
	}
}

// firstFrame is when a job's first preview frame was stored (unix ns; 0:
// none), carried in the decode's context like pullTime.
type firstFrame = atomic.Int64

type firstFrameKey struct{}

func withFirstFrame(ctx context.Context, f *firstFrame) context.Context {
	return context.WithValue(ctx, firstFrameKey{}, f)
}

// markFirstFrame notes that a preview frame is readable now, if it is the
// first of ctx's job.
func markFirstFrame(ctx context.Context) {
	if f, ok := ctx.Value(firstFrameKey{}).(*firstFrame); ok {
		f.CompareAndSwap(0, time.Now().UnixNano())
	}
}

// observeJob records a job whose last stage c committed: its end-to-end
// latency and its time to first frame (the first preview frame, or the
// result when it had none).
func (a *Agent) observeJob(c *jobs.Claim, f *firstFrame) {
	if c.JobCreatedAt.IsZero() {
		return
	}
	done := time.Now()
	first := done
	if ns := f.Load(); ns != 0 {
		first = time.Unix(0, ns)
	}
	a.metrics.ObserveJob(c.Task.Class, done.Sub(c.JobCreatedAt), first.Sub(c.JobCreatedAt))
}

// commitRejected counts a commit etcd refused for good.
func (a *Agent) commitRejected(st jobs.Stage, err error) {
	switch {
	case errors.Is(err, jobs.ErrFenced):
		a.metrics.CommitRejected(st, httpapi.ReasonFenced)
	case errors.Is(err, jobs.ErrFinished):
		a.metrics.CommitRejected(st, httpapi.ReasonFinished)
	}
}

// rewindReason names why c's input was lost (see pullFailed): its
// producer left the mesh, or says it no longer has the payload, or the
// input could not be used (its description was invalid).
func (a *Agent) rewindReason(c *jobs.Claim, err error) string {
	for _, in := range c.Task.Inputs {
		if p, ok := a.member.Peer(in.Node); !in.Store && (!ok || !p.Registered) {
			return httpapi.ReasonProducerLeft
		}
	}
	if errors.Is(err, transfer.ErrNotFound) {
		return httpapi.ReasonPayloadGone
	}
	return httpapi.ReasonInvalidInput
}

// observedEtcd returns a client that shares cli's connection and watches
// and times the unary KV and lease requests made through it. It is a copy
// of the client value, so that agents sharing one client (the testbed's
// in-process meshes) count only their own requests; wrapping clientv3's
// KV and Lease interfaces, as etcd's namespace package does, sees both the
// gRPC client and the embedded server's in-process one, which a gRPC
// interceptor would miss. Do not Close the copy: its owner closes cli.
func observedEtcd(cli *clientv3.Client, m *httpapi.Metrics) *clientv3.Client {
	c := *cli // the client's mutexes are pointers: the copy shares them
	c.KV = etcdKV{KV: cli.KV, m: m}
	c.Lease = etcdLease{Lease: cli.Lease, m: m}
	return &c
}

// observeEtcd records one request that started at start and ended in err.
func observeEtcd(m *httpapi.Metrics, op string, start time.Time, err error) {
	m.ObserveEtcd(op, time.Since(start), etcdCode(err))
}

// etcdCode is err's gRPC code name, "" for none.
func etcdCode(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, context.Canceled):
		return "Canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "DeadlineExceeded"
	}
	if s, ok := status.FromError(err); ok {
		return s.Code().String()
	}
	return "Unknown"
}

type etcdKV struct {
	clientv3.KV
	m *httpapi.Metrics
}

func (k etcdKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	start := time.Now()
	r, err := k.KV.Get(ctx, key, opts...)
	observeEtcd(k.m, "get", start, err)
	return r, err
}

func (k etcdKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	start := time.Now()
	r, err := k.KV.Put(ctx, key, val, opts...)
	observeEtcd(k.m, "put", start, err)
	return r, err
}

func (k etcdKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	start := time.Now()
	r, err := k.KV.Delete(ctx, key, opts...)
	observeEtcd(k.m, "delete", start, err)
	return r, err
}

func (k etcdKV) Compact(ctx context.Context, rev int64, opts ...clientv3.CompactOption) (*clientv3.CompactResponse, error) {
	start := time.Now()
	r, err := k.KV.Compact(ctx, rev, opts...)
	observeEtcd(k.m, "compact", start, err)
	return r, err
}

func (k etcdKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	start := time.Now()
	r, err := k.KV.Do(ctx, op)
	observeEtcd(k.m, "do", start, err)
	return r, err
}

func (k etcdKV) Txn(ctx context.Context) clientv3.Txn { return etcdTxn{Txn: k.KV.Txn(ctx), m: k.m} }

// etcdTxn times a transaction's Commit (a failed comparison is an answer,
// not an error).
type etcdTxn struct {
	clientv3.Txn
	m *httpapi.Metrics
}

func (t etcdTxn) If(cs ...clientv3.Cmp) clientv3.Txn { return etcdTxn{Txn: t.Txn.If(cs...), m: t.m} }
func (t etcdTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	return etcdTxn{Txn: t.Txn.Then(ops...), m: t.m}
}
func (t etcdTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	return etcdTxn{Txn: t.Txn.Else(ops...), m: t.m}
}

func (t etcdTxn) Commit() (*clientv3.TxnResponse, error) {
	start := time.Now()
	r, err := t.Txn.Commit()
	observeEtcd(t.m, "txn", start, err)
	return r, err
}

// etcdLease times the lease requests; KeepAlive's stream is not a request.
type etcdLease struct {
	clientv3.Lease
	m *httpapi.Metrics
}

func (l etcdLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	start := time.Now()
	r, err := l.Lease.Grant(ctx, ttl)
	observeEtcd(l.m, "lease_grant", start, err)
	return r, err
}

func (l etcdLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	start := time.Now()
	r, err := l.Lease.Revoke(ctx, id)
	observeEtcd(l.m, "lease_revoke", start, err)
	return r, err
}

func (l etcdLease) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	start := time.Now()
	r, err := l.Lease.TimeToLive(ctx, id, opts...)
	observeEtcd(l.m, "lease_ttl", start, err)
	return r, err
}

func (l etcdLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	start := time.Now()
	r, err := l.Lease.KeepAliveOnce(ctx, id)
	observeEtcd(l.m, "lease_keepalive_once", start, err)
	return r, err
}
