package testbed

import (
	"context"
	"strings"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// EtcdOps counts what one etcd client asks of etcd: requests by kind, the
// keys its range reads return, the watches it opens, and its claim
// transactions (those that require a key under claims/ not to exist:
// jobs.Store.TryClaim's; a commit or submit that pushes a claim writes
// one without racing for it). It is how tests and
// `bench api` say what a job, a claim and an idle agent cost etcd.
type EtcdOps struct {
	reads, writes, txns, keysRead, watches atomic.Int64
	claimTxns, claims                      atomic.Int64
}

// EtcdOpCounts is a snapshot of EtcdOps, or the difference of two.
type EtcdOpCounts struct {
	Reads, Writes, Txns int64 // requests: a transaction counts once
	KeysRead            int64 // keys returned by range reads, in or out of transactions
	Watches             int64 // watches opened
	ClaimTxns, Claims   int64 // claim transactions sent, and those that succeeded
}

// CountEtcdOps wraps cli's KV and Watcher with a counter. Call it before
// anything uses cli (etcdguard, when installed later, wraps the counter).
func CountEtcdOps(cli *clientv3.Client) *EtcdOps {
	o := &EtcdOps{}
	cli.KV = &countingKV{KV: cli.KV, o: o}
	cli.Watcher = &countingWatcher{Watcher: cli.Watcher, o: o}
	return o
}

// Snap reads the counts.
func (o *EtcdOps) Snap() EtcdOpCounts {
	return EtcdOpCounts{o.reads.Load(), o.writes.Load(), o.txns.Load(), o.keysRead.Load(), o.watches.Load(), o.claimTxns.Load(), o.claims.Load()}
}

// Minus is c - b.
func (c EtcdOpCounts) Minus(b EtcdOpCounts) EtcdOpCounts {
	return EtcdOpCounts{c.Reads - b.Reads, c.Writes - b.Writes, c.Txns - b.Txns, c.KeysRead - b.KeysRead,
		c.Watches - b.Watches, c.ClaimTxns - b.ClaimTxns, c.Claims - b.Claims}
}

// Requests is every request sent: reads, writes, transactions and watches.
func (c EtcdOpCounts) Requests() int64 { return c.Reads + c.Writes + c.Txns + c.Watches }

type countingKV struct {
	clientv3.KV
	o *EtcdOps
}

func (k *countingKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	k.o.reads.Add(1)
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.o.keysRead.Add(int64(len(resp.Kvs)))
	}
	return resp, err
}

func (k *countingKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	k.o.writes.Add(1)
	return k.KV.Put(ctx, key, val, opts...)
}

func (k *countingKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	k.o.writes.Add(1)
	return k.KV.Delete(ctx, key, opts...)
}

func (k *countingKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	switch {
	case op.IsGet():
		k.o.reads.Add(1)
	case op.IsTxn():
		k.o.txns.Add(1)
	default:
		k.o.writes.Add(1)
	}
	return k.KV.Do(ctx, op)
}

func (k *countingKV) Txn(ctx context.Context) clientv3.Txn {
	return &countingTxn{Txn: k.KV.Txn(ctx), o: k.o}
}

type countingTxn struct {
	clientv3.Txn
	o     *EtcdOps
	claim bool // the transaction races for a claim key
}

func (t *countingTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	for _, c := range cs {
		pc := pb.Compare(c)
		if pc.Target == pb.Compare_CREATE && pc.GetCreateRevision() == 0 && strings.Contains(string(pc.Key), "/claims/") {
			t.claim = true
		}
	}
	t.Txn = t.Txn.If(cs...)
	return t
}

func (t *countingTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *countingTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *countingTxn) Commit() (*clientv3.TxnResponse, error) {
	t.o.txns.Add(1)
	if t.claim {
		t.o.claimTxns.Add(1)
	}
	resp, err := t.Txn.Commit()
	if err == nil {
		for _, r := range resp.Responses {
			if rr := r.GetResponseRange(); rr != nil {
				t.o.keysRead.Add(int64(len(rr.Kvs)))
			}
		}
		if t.claim && resp.Succeeded {
			t.o.claims.Add(1)
		}
	}
	return resp, err
}

type countingWatcher struct {
	clientv3.Watcher
	o *EtcdOps
}

func (w *countingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.o.watches.Add(1)
	return w.Watcher.Watch(ctx, key, opts...)
}
