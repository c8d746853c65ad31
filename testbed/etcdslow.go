package testbed

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// DelayEtcdWrites makes every write cli sends (a put, a delete, a
// transaction that writes) wait d before it goes: the latency a loaded
// etcd adds to each raft write, for a bench on an idle machine's etcd
// (`bench api --etcd-write-delay`). Reads and watches are not delayed; a
// write's watch event follows the write, so it comes d later too. Call it
// before anything uses cli.
func DelayEtcdWrites(cli *clientv3.Client, d time.Duration) {
	if d > 0 {
		cli.KV = &slowKV{KV: cli.KV, d: d}
	}
}

type slowKV struct {
	clientv3.KV
	d time.Duration
}

// wait sleeps the delay, or until ctx ends.
func (k *slowKV) wait(ctx context.Context) error {
	t := time.NewTimer(k.d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (k *slowKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	if err := k.wait(ctx); err != nil {
		return nil, err
	}
	return k.KV.Put(ctx, key, val, opts...)
}

func (k *slowKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	if err := k.wait(ctx); err != nil {
		return nil, err
	}
	return k.KV.Delete(ctx, key, opts...)
}

func (k *slowKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	if !op.IsGet() {
		if err := k.wait(ctx); err != nil {
			return clientv3.OpResponse{}, err
		}
	}
	return k.KV.Do(ctx, op)
}

func (k *slowKV) Txn(ctx context.Context) clientv3.Txn {
	return &slowTxn{Txn: k.KV.Txn(ctx), kv: k, ctx: ctx}
}

// slowTxn delays a transaction whose branches write.
type slowTxn struct {
	clientv3.Txn
	kv     *slowKV
	ctx    context.Context
	writes bool
}

func (t *slowTxn) note(ops []clientv3.Op) {
	for _, op := range ops {
		if op.IsPut() || op.IsDelete() || op.IsTxn() {
			t.writes = true
		}
	}
}

func (t *slowTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }

func (t *slowTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.note(ops)
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *slowTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.note(ops)
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *slowTxn) Commit() (*clientv3.TxnResponse, error) {
	if t.writes {
		if err := t.kv.wait(t.ctx); err != nil {
			return nil, err
		}
	}
	return t.Txn.Commit()
}
