package jobs

// This file holds the records of peer-to-peer payloads, which a commit
// writes and its consumer's commit deletes (delete-on-consume): the
// release of consumed inputs, the producer's watch of its own releases,
// and the reads that resync and check them.

import (
	"context"
	"encoding/json"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/cache"
)

// PayloadRecord says where a peer-to-peer output payload lives until its
// consumer commits (a Store object has its own record, under objects/).
type PayloadRecord struct {
	Input
	Job   string `json:"job"`
	Stage Stage  `json:"stage"` // the stage that produced it
}

// releaseOps free consumed inputs: delete-on-consume for peer-to-peer
// payloads (the producer frees the buffer) and Store objects alike (the
// holders free their copies), but for conditioning cache entries, which
// other jobs share.
func (s *Store) releaseOps(in []Input) []clientv3.Op {
	ops := make([]clientv3.Op, 0, len(in))
	for _, i := range in {
		if i.Cached {
			continue // a cache entry outlives its consumers
		}
		if i.Store {
			ops = append(ops, clientv3.OpDelete(cache.ObjectKey(s.cfg.Prefix, i.Payload)))
		} else {
			ops = append(ops, clientv3.OpDelete(s.payloadKey(i.Node, i.Payload)))
		}
	}
	return ops
}

// WatchReleases calls release with the id of every payload produced by node
// whose record is deleted (consumed, cancelled or rewound), until ctx is done.
// The producer frees the buffer then. It follows node's payload records
// only (they are keyed by producer), so a release costs one event, to the
// producer. When etcd compacted away the events of a gap in the watch,
// resync is called: the caller must compare what it holds with Recorded
// and release the difference.
func (s *Store) WatchReleases(ctx context.Context, node string, release func(payload string), resync func()) {
	// Watch from now on (payloads of a previous incarnation died with it);
	// after a broken watch, resume after the last revision seen so no release
	// in the gap is missed, unless etcd compacted it away meanwhile.
	prefix := s.producerPrefix(node)
	var next int64
	for ctx.Err() == nil {
		opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithFilterPut()}
		if next > 0 {
			opts = append(opts, clientv3.WithRev(next))
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range s.cli.Watch(wctx, prefix, opts...) {
			if wr.CompactRevision > 0 {
				s.log.Warn("payload release watch compacted; resyncing held payloads",
					zap.Int64("from", next), zap.Int64("compacted", wr.CompactRevision))
				next = 0
				resync()
				break
			}
			for _, ev := range wr.Events {
				release(strings.TrimPrefix(string(ev.Kv.Key), prefix))
			}
			if wr.Header.Revision > 0 {
				next = wr.Header.Revision + 1
			}
		}
		cancel()
		select {
		case <-ctx.Done():
		case <-time.After(time.Second): // watch broke (leader loss): re-establish
		}
	}
}

// Payloads lists the payload records, for status pages and leak checks.
func (s *Store) Payloads(ctx context.Context) ([]PayloadRecord, error) {
	resp, err := s.cli.Get(ctx, s.payloadPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := make([]PayloadRecord, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var pr PayloadRecord
		if err := json.Unmarshal(kv.Value, &pr); err == nil {
			out = append(out, pr)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Payload < out[j].Payload })
	return out, nil
}

// PayloadRecorded reports whether payload id, produced by node, has a
// record: whether a commit that published it took effect.
func (s *Store) PayloadRecorded(ctx context.Context, node, id string) (bool, error) {
	resp, err := s.cli.Get(ctx, s.payloadKey(node, id), clientv3.WithCountOnly())
	if err != nil {
		return false, err
	}
	return resp.Count > 0, nil
}

// Recorded returns the ids of the payload records of node.
func (s *Store) Recorded(ctx context.Context, node string) (map[string]bool, error) {
	prefix := s.producerPrefix(node)
	resp, err := s.cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), prefix)] = true
	}
	return out, nil
}
