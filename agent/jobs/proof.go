package jobs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ErrNoClaim means a claim proof does not hold: no such claim, a claim of
// another generation, or a task that does not read the payload.
var ErrNoClaim = errors.New("jobs: no claim on a task reading the payload")

// ClaimProof is what a consumer shows a producer to get a ticket for a
// peer-to-peer payload: the claim it holds on the task whose inputs name
// the payload. The producer checks it against etcd (ClaimHolder), so it
// proves nothing by itself; it only says where to look.
type ClaimProof struct {
	Stage   Stage  `json:"stage"`
	Task    string `json:"task"`
	TaskKey string `json:"task_key"`
	Rev     int64  `json:"rev"`  // the claim's fencing token (Claim.Rev)
	Node    string `json:"node"` // the claim's holder, whose key it is
}

// Proof is c's claim proof, encoded for transfer.WithTicketProof. An
// offered claim has none until it is confirmed (Settle): its proof names
// revision 0, which every producer refuses.
func (c *Claim) Proof() []byte {
	b, _ := json.Marshal(ClaimProof{Stage: c.Task.Stage, Task: c.Task.ID, TaskKey: c.Task.Key, Rev: c.Revision(), Node: c.Node})
	return b
}

// ClaimHolder checks proof, as sent by a consumer asking for a ticket for
// payload, with one etcd read: the claim it names exists with revision Rev,
// and the task at TaskKey is that task and lists payload among its inputs.
// It returns the node holding the claim; the caller checks that the asking
// peer is that node. Errors other than ErrNoClaim are etcd failures.
func (s *Store) ClaimHolder(ctx context.Context, proof []byte, payload string) (string, error) {
	var p ClaimProof
	if err := json.Unmarshal(proof, &p); err != nil {
		return "", fmt.Errorf("%w: undecodable proof: %v", ErrNoClaim, err)
	}
	if !slices.Contains(Stages(), p.Stage) || !validID(p.Task) || !strings.HasPrefix(p.TaskKey, s.taskPrefix(p.Stage)) ||
		!strings.HasSuffix(p.TaskKey, "-"+p.Task) || p.Rev <= 0 || !validNode(p.Node) {
		return "", fmt.Errorf("%w: malformed proof", ErrNoClaim)
	}
	ck := s.claimKey(p.Stage, p.Node, p.Task)
	resp, err := s.cli.Txn(ctx).Then(clientv3.OpGet(ck), clientv3.OpGet(p.TaskKey)).Commit()
	if err != nil {
		return "", fmt.Errorf("jobs: read claim %s: %w", ck, err)
	}
	claims, tasks := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(claims) == 0 || claims[0].ModRevision != p.Rev {
		return "", fmt.Errorf("%w: claim %s at revision %d is gone", ErrNoClaim, ck, p.Rev)
	}
	var cr claimRecord
	if err := json.Unmarshal(claims[0].Value, &cr); err != nil || cr.Task != p.Task || cr.Node != p.Node {
		return "", fmt.Errorf("%w: claim %s does not name task %s", ErrNoClaim, ck, p.Task)
	}
	if len(tasks) == 0 {
		return "", fmt.Errorf("%w: task %s is gone", ErrNoClaim, p.TaskKey)
	}
	var t Task
	if err := json.Unmarshal(tasks[0].Value, &t); err != nil || t.ID != p.Task {
		return "", fmt.Errorf("%w: task %s is not %s", ErrNoClaim, p.TaskKey, p.Task)
	}
	if !slices.ContainsFunc(t.Inputs, func(in Input) bool { return in.Payload == payload && !in.Store }) {
		return "", fmt.Errorf("%w: task %s does not read payload %s", ErrNoClaim, p.Task, payload)
	}
	return cr.Node, nil
}
