package testbed

import (
	"context"
	"sync"
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
		writesOf(cli).d = d
	}
}

// EtcdWriteGate holds back the writes of a client while it is shut: each
// waits, unsent, until the gate opens or its context ends. A test that
// freezes etcd shuts it first, so that no write sent into the frozen etcd
// can take effect once etcd thaws (etcd may apply a request whose client
// had given up on it), and a write that timed out is known not to have
// happened.
type EtcdWriteGate struct {
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

// GateEtcdWrites puts a gate, open, on cli's writes. Call it before
// anything uses cli.
func GateEtcdWrites(cli *clientv3.Client) *EtcdWriteGate {
	g := &EtcdWriteGate{open: make(chan struct{})}
	close(g.open)
	writesOf(cli).gate = g
	return g
}

// Shut holds back every write from now on.
func (g *EtcdWriteGate) Shut() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default: // shut already
	}
}

// Open lets the writes go, the held ones first.
func (g *EtcdWriteGate) Open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

// opened is closed once the gate is open.
func (g *EtcdWriteGate) opened() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.open
}

// writesOf returns cli's write-holding KV, putting one in if it has none.
func writesOf(cli *clientv3.Client) *slowKV {
	if k, ok := cli.KV.(*slowKV); ok {
		return k
	}
	k := &slowKV{KV: cli.KV}
	cli.KV = k
	return k
}

// slowKV holds back a client's writes: each waits d, then for the gate.
type slowKV struct {
	clientv3.KV
	d    time.Duration
	gate *EtcdWriteGate // nil: none
}

// wait holds a write back, or fails with ctx's error once ctx ends.
func (k *slowKV) wait(ctx context.Context) error {
	if k.d > 0 {
		t := time.NewTimer(k.d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if k.gate == nil {
		return nil
	}
	select {
	case <-k.gate.opened():
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
