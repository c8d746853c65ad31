package etcdguard

import (
	"context"

	"go.etcd.io/etcd/api/v3/etcdserverpb"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// guardKV passes every call through and shows its response header to the
// guard.
type guardKV struct {
	clientv3.KV
	g *Guard
}

func (k *guardKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	s := k.g.send()
	resp, err := k.KV.Put(ctx, key, val, opts...)
	if err == nil {
		k.g.observe(resp.Header, s, true)
	}
	return resp, err
}

func (k *guardKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	s := k.g.send()
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.g.observe(resp.Header, s, !clientv3.OpGet(key, opts...).IsSerializable())
	}
	return resp, err
}

func (k *guardKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	s := k.g.send()
	resp, err := k.KV.Delete(ctx, key, opts...)
	if err == nil {
		k.g.observe(resp.Header, s, true)
	}
	return resp, err
}

func (k *guardKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	s := k.g.send()
	resp, err := k.KV.Do(ctx, op)
	if err == nil {
		var h *etcdserverpb.ResponseHeader
		switch {
		case resp.Get() != nil:
			h = resp.Get().Header
		case resp.Put() != nil:
			h = resp.Put().Header
		case resp.Del() != nil:
			h = resp.Del().Header
		case resp.Txn() != nil:
			h = resp.Txn().Header
		}
		k.g.observe(h, s, !op.IsSerializable())
	}
	return resp, err
}

func (k *guardKV) Txn(ctx context.Context) clientv3.Txn {
	return &guardTxn{Txn: k.KV.Txn(ctx), g: k.g}
}

// guardTxn shows a committed transaction's header to the guard. A
// transaction is served linearizably (this project sends no serializable
// reads inside one).
type guardTxn struct {
	clientv3.Txn
	g *Guard
}

func (t *guardTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.Txn = t.Txn.If(cs...)
	return t
}

func (t *guardTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *guardTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *guardTxn) Commit() (*clientv3.TxnResponse, error) {
	s := t.g.send()
	resp, err := t.Txn.Commit()
	if err == nil {
		t.g.observe(resp.Header, s, true)
	}
	return resp, err
}

// guardWatcher ends the watches of a generation when it ends, and refuses
// watches that start past every revision seen: either way the watcher gets
// a compaction response, which tells it to read its state again.
type guardWatcher struct {
	clientv3.Watcher
	g *Guard
}

func (w *guardWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	gen := w.g.generation()
	if rev := clientv3.OpGet(key, opts...).Rev(); rev > 0 && w.g.future(rev) {
		return compacted(w.g.seen.Load())
	}
	wctx, cancel := context.WithCancel(ctx)
	inner := w.Watcher.Watch(wctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		defer cancel()
		for {
			select {
			case r, ok := <-inner:
				if !ok {
					return
				}
				if r.Header.Revision > 0 && r.Err() == nil {
					w.g.sawRevision(r.Header.Revision)
				}
				select {
				case out <- r:
				case <-ctx.Done():
					return
				case <-gen.Done():
					sendCompacted(ctx, out, w.g.seen.Load())
					return
				}
			case <-gen.Done():
				sendCompacted(ctx, out, w.g.seen.Load())
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// compacted is a watch channel that says at once that the history asked
// for is gone, and closes.
func compacted(rev int64) clientv3.WatchChan {
	out := make(chan clientv3.WatchResponse, 1)
	out <- compaction(rev)
	close(out)
	return out
}

func sendCompacted(ctx context.Context, out chan<- clientv3.WatchResponse, rev int64) {
	select {
	case out <- compaction(rev):
	case <-ctx.Done():
	}
}

// compaction is the response etcd sends a watch whose start revision was
// compacted away: Err() is ErrCompacted and the watch is cancelled.
func compaction(rev int64) clientv3.WatchResponse {
	return clientv3.WatchResponse{CompactRevision: max(rev, 1), Canceled: true}
}
