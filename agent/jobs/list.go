package jobs

// This file lists jobs in the order they were created, a page at a time,
// for the client API's lists (GET /v1/videos).

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ListQuery selects a page of jobs.
type ListQuery struct {
	// After is the id of the job the page starts after ("" for the first
	// page); ErrNotFound if it no longer exists.
	After string
	// Limit is the most jobs returned, in [1,MaxListLimit].
	Limit int
	// Newest puts the newest job first.
	Newest bool
	// Match, if set, keeps only the jobs it accepts (videos, a token's own).
	Match func(Job) bool
}

// MaxListLimit bounds a page, and listScan how many records one List reads
// looking for matches: a page of a mostly non-matching history comes back
// short, with more set, rather than reading all of etcd.
const (
	MaxListLimit = 100
	listScan     = 1000
)

// List returns a page of jobs in creation order (etcd's create revision of
// their records), and whether more may follow. Records are read as they
// stand: a running job shows as queued here (Get reads its progress).
// etcd sorts the range itself, so one page costs one range read per 100
// records scanned, whatever the number of jobs.
func (s *Store) List(ctx context.Context, q ListQuery) ([]Job, bool, error) {
	if q.Limit < 1 || q.Limit > MaxListLimit {
		return nil, false, fmt.Errorf("jobs: list limit %d: want [1,%d]", q.Limit, MaxListLimit)
	}
	order := clientv3.SortAscend
	if q.Newest {
		order = clientv3.SortDescend
	}
	var cursor int64 // the create revision to continue past; 0: from the start
	if q.After != "" {
		if !validID(q.After) {
			return nil, false, ErrNotFound
		}
		resp, err := s.cli.Get(ctx, s.jobKey(q.After), clientv3.WithKeysOnly())
		if err != nil {
			return nil, false, fmt.Errorf("jobs: list after %s: %w", q.After, err)
		}
		if len(resp.Kvs) == 0 {
			return nil, false, ErrNotFound
		}
		cursor = resp.Kvs[0].CreateRevision
	}
	prefix := s.cfg.Prefix + "/jobs/"
	var out []Job
	for scanned := 0; scanned < listScan; {
		opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, order), clientv3.WithLimit(100)}
		if cursor > 0 && q.Newest {
			opts = append(opts, clientv3.WithMaxCreateRev(cursor-1))
		} else if cursor > 0 {
			opts = append(opts, clientv3.WithMinCreateRev(cursor+1))
		}
		resp, err := s.cli.Get(ctx, prefix, opts...)
		if err != nil {
			return nil, false, fmt.Errorf("jobs: list: %w", err)
		}
		for i, kv := range resp.Kvs {
			scanned++
			cursor = kv.CreateRevision
			var rec record
			if err := json.Unmarshal(kv.Value, &rec); err != nil {
				s.log.Warn("list: undecodable job record skipped")
				continue
			}
			if q.Match != nil && !q.Match(rec.Job) {
				continue
			}
			out = append(out, rec.Job)
			if len(out) == q.Limit {
				return out, i < len(resp.Kvs)-1 || resp.More, nil
			}
		}
		if !resp.More {
			return out, false, nil
		}
	}
	return out, true, nil
}
