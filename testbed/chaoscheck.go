package testbed

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
)

// This file holds the chaos run's invariant checks. Each reads real state:
// etcd's MVCC history of every job record, the payload and object records,
// and every agent's own account of what it holds.

// jobVersion is one write of a job record, as etcd's history keeps it.
type jobVersion struct {
	Rev int64 // the write's revision (the key's ModRevision then)
	Job jobs.Job
}

// jobHistory reads every version of the job record at key, oldest first,
// by walking etcd's MVCC history backwards: a read at revision r returns
// the version current then, whose ModRevision is the write that made it,
// and a read at ModRevision-1 the one before, down to version 1 (the
// submission). Job records are never deleted in a chaos run, and the
// external etcd never compacts (it has no --auto-compaction flag), so the
// history is whole; a compacted revision is an error, not a pass.
func jobHistory(ctx context.Context, cli *clientv3.Client, key string) ([]jobVersion, error) {
	var out []jobVersion
	rev := int64(0) // 0: now
	for {
		var opts []clientv3.OpOption
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := cli.Get(ctx, key, opts...)
		if err != nil {
			return nil, fmt.Errorf("history of %s at revision %d: %w", key, rev, err)
		}
		if len(resp.Kvs) == 0 {
			return nil, fmt.Errorf("history of %s: no version at revision %d", key, rev)
		}
		kv := resp.Kvs[0]
		var j jobs.Job
		if err := json.Unmarshal(kv.Value, &j); err != nil {
			return nil, fmt.Errorf("history of %s: version at %d: %w", key, kv.ModRevision, err)
		}
		out = append(out, jobVersion{Rev: kv.ModRevision, Job: j})
		if kv.Version <= 1 {
			break
		}
		rev = kv.ModRevision - 1
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, nil
}

// duplicateCommits finds the stage commits in one job's history (oldest
// first) that must not have happened, and says why for each.
//
// A stage commit is the write of the job record that changes the stage's
// StageRecord (node, attempt, finish time): the fenced commit transaction
// writes it, and nothing else does. A job passes through encode, denoise
// and decode once per pass; a rewind (Rewinds+1, back to encode, written
// without any StageRecord change) starts a new pass. So in a correct
// history every (pass, stage) is committed at most once, each commit is of
// the stage the job was at (the previous version's Stage), no commit lands
// on a finished job, and a succeeded job's result never changes. A second
// commit of one stage (a stale worker whose fencing failed), a commit of a
// stage the job had moved past, or one after the job finished is counted
// once each.
func duplicateCommits(history []jobVersion) []string {
	var dups []string
	type passStage struct {
		pass  int
		stage jobs.Stage
	}
	seen := map[passStage]int64{} // first commit's revision
	for i := 1; i < len(history); i++ {
		prev, cur := history[i-1].Job, history[i].Job
		rev := history[i].Rev
		for _, st := range jobs.Stages() {
			cr, pr := cur.Stages[st], prev.Stages[st]
			if cr == nil || (pr != nil && sameStageRecord(*pr, *cr)) {
				continue
			}
			switch {
			case prev.State.Terminal():
				dups = append(dups, fmt.Sprintf("job %s: %s committed at revision %d by %s (attempt %d) after the job was %s",
					cur.ID, st, rev, cr.Node, cr.Attempt, prev.State))
			case prev.Stage != st:
				dups = append(dups, fmt.Sprintf("job %s: %s committed at revision %d by %s (attempt %d) while the job was at %q",
					cur.ID, st, rev, cr.Node, cr.Attempt, prev.Stage))
			default:
				k := passStage{cur.Rewinds, st}
				if first, ok := seen[k]; ok {
					dups = append(dups, fmt.Sprintf("job %s: %s committed twice in pass %d: at revision %d and again at %d by %s (attempt %d)",
						cur.ID, st, cur.Rewinds, first, rev, cr.Node, cr.Attempt))
				} else {
					seen[k] = rev
				}
			}
		}
		if prev.State == jobs.Succeeded && prev.Result != nil && (cur.Result == nil || *cur.Result != *prev.Result) {
			dups = append(dups, fmt.Sprintf("job %s: result rewritten at revision %d after the job succeeded", cur.ID, rev))
		}
	}
	return dups
}

func sameStageRecord(a, b jobs.StageRecord) bool {
	return a.Node == b.Node && a.Attempt == b.Attempt && a.FinishedAt.Equal(b.FinishedAt) && a.StartedAt.Equal(b.StartedAt)
}

// succeededAt is the revision of the write that made the job succeeded (0
// if it never did).
func succeededAt(history []jobVersion) int64 {
	for _, v := range history {
		if v.Job.State == jobs.Succeeded {
			return v.Rev
		}
	}
	return 0
}

// etcdSnapshot is the payload and object records at one revision, and
// every job record.
type etcdSnapshot struct {
	Jobs     map[string]jobs.Job
	Payloads []jobs.PayloadRecord
	Objects  []cache.Record
	// ObjectCreated is each object record's CreateRevision, by id.
	ObjectCreated map[string]int64
}

// readSnapshot reads the jobs, payload and object records under prefix in
// one transaction, so they agree with each other.
func readSnapshot(ctx context.Context, cli *clientv3.Client, prefix string) (etcdSnapshot, error) {
	resp, err := cli.Txn(ctx).Then(
		clientv3.OpGet(prefix+"/jobs/", clientv3.WithPrefix()),
		clientv3.OpGet(prefix+"/payloads/", clientv3.WithPrefix()),
		clientv3.OpGet(cache.ObjectKey(prefix, ""), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return etcdSnapshot{}, fmt.Errorf("read jobs and records: %w", err)
	}
	s := etcdSnapshot{Jobs: map[string]jobs.Job{}, ObjectCreated: map[string]int64{}}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		var j jobs.Job
		if err := json.Unmarshal(kv.Value, &j); err != nil {
			return etcdSnapshot{}, fmt.Errorf("job record %s: %w", kv.Key, err)
		}
		s.Jobs[j.ID] = j
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		var pr jobs.PayloadRecord
		if err := json.Unmarshal(kv.Value, &pr); err != nil {
			return etcdSnapshot{}, fmt.Errorf("payload record %s: %w", kv.Key, err)
		}
		s.Payloads = append(s.Payloads, pr)
	}
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		var r cache.Record
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return etcdSnapshot{}, fmt.Errorf("object record %s: %w", kv.Key, err)
		}
		s.Objects = append(s.Objects, r)
		s.ObjectCreated[r.ID] = kv.CreateRevision
	}
	return s, nil
}

// holdings is what one agent says it holds (admin status).
type holdings struct {
	Node string
	// Payloads counts the transfer registry's payloads: peer-to-peer
	// outputs and Store copies alike (a copy is published as a payload).
	Payloads int
	// Copies counts Store copies, staged ones included; Staged those.
	Copies, Staged int
	// CacheUsed is the bytes of its cache entries, CacheCapacity their
	// room (0: unbounded).
	CacheUsed, CacheCapacity int64
}

// leakedRecords lists the records in s that belong to no live job once
// every job is finished: any payload record (a p2p payload lives only
// until its consumer commits, or the job fails, is cancelled or rewinds),
// and any object record but the result of a succeeded job (relayed
// latents are consumed by a commit, previews are deleted by the decode
// commit, and the collector removes what a dead job left and previews a
// stale attempt put after that commit).
func leakedRecords(s etcdSnapshot) []string {
	var out []string
	for _, pr := range s.Payloads {
		j, ok := s.Jobs[pr.Job]
		if !ok || j.State.Terminal() {
			out = append(out, fmt.Sprintf("payload record %s (node %s, %s output) of %s job %s", pr.Payload, pr.Node, pr.Stage, stateOf(j, ok), pr.Job))
		}
	}
	for _, r := range s.Objects {
		if r.Mode == cache.Cache && r.Job == "" {
			continue // a conditioning cache entry: its holder's room bounds them (leakedHoldings)
		}
		j, ok := s.Jobs[r.Job]
		if ok && j.State == jobs.Succeeded && j.Result != nil && j.Result.Object == r.ID {
			continue
		}
		if ok && !j.State.Terminal() {
			continue // still in use
		}
		out = append(out, fmt.Sprintf("object record %s (%s, holders %s) of %s job %s", r.ID, r.Mode, holderNames(r), stateOf(j, ok), r.Job))
	}
	sort.Strings(out)
	return out
}

func stateOf(j jobs.Job, ok bool) string {
	if !ok {
		return "missing"
	}
	return string(j.State)
}

func holderNames(r cache.Record) string {
	var n []string
	for _, h := range r.Holders {
		n = append(n, h.Node)
	}
	return strings.Join(n, ",")
}

// leakedHoldings compares what each agent holds with what the records
// say it should: an agent should hold exactly one Store copy per object
// record naming it as a holder and, besides its copies, one payload per
// payload record naming it as producer. More than that is held memory no
// record will ever free; it is counted, one per extra copy or payload.
// (Fewer is a missing replica, which maintenance repairs and the result
// check catches if it matters; it is not a leak.)
func leakedHoldings(s etcdSnapshot, hs []holdings) (int, []string) {
	wantCopies, wantPayloads := map[string]int{}, map[string]int{}
	for _, r := range s.Objects {
		for _, h := range r.Holders {
			wantCopies[h.Node]++
		}
	}
	for _, pr := range s.Payloads {
		wantPayloads[pr.Node]++
	}
	n := 0
	var out []string
	for _, h := range hs {
		if h.CacheCapacity > 0 && h.CacheUsed > h.CacheCapacity {
			n++
			out = append(out, fmt.Sprintf("agent %s holds %d bytes of cache entries, beyond its room of %d", h.Node, h.CacheUsed, h.CacheCapacity))
		}
		if extra := h.Copies - wantCopies[h.Node]; extra > 0 {
			n += extra
			out = append(out, fmt.Sprintf("agent %s holds %d Store copies (%d staged), records name it for %d", h.Node, h.Copies, h.Staged, wantCopies[h.Node]))
		}
		if extra := h.Payloads - h.Copies - wantPayloads[h.Node]; extra > 0 {
			n += extra
			out = append(out, fmt.Sprintf("agent %s holds %d payloads besides its Store copies, payload records name it for %d", h.Node, h.Payloads-h.Copies, wantPayloads[h.Node]))
		}
	}
	return n, out
}
