package jobs

// This file is the job store's etcd key schema: every key and prefix the
// Store names, all under Config.Prefix, and the check that keeps a
// caller's id inside its key. In brief (docs/ARCHITECTURE.md, "etcd
// layout", has the full table):
//
//	key                                                 value          lifetime
//	jobs/<job>                                          record (Job)   until finished; then a retention lease
//	ended/<job>                                         record (Job)   written as it finishes; 10 minutes (Wait)
//	progress/<job>                                      Progress       the worker's lease
//	queues/<stage>/tasks/<class>/<creator>/<ns>-<task>  Task           until its stage commits
//	queues/<stage>/claims/<node>/<task>                 claimRecord    the worker's lease
//	payloads/<producer>/<payload>                       PayloadRecord  until its consumer commits
//	objects/<job>.<name>                                cache.Record   package cache's: ResultID, PreviewID, relayed payloads
//
// <creator> is the node that created the task, its first dispatcher;
// <ns> is the enqueue time in nanoseconds, 16 hex digits, so a creator's
// task keys sort by class, then age.

import (
	"fmt"
	"strings"

	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/routing"
)

// Key layout. Values are JSON (except result parts) so etcdctl shows them.
func (s *Store) jobKey(id string) string      { return s.cfg.Prefix + "/jobs/" + id }
func (s *Store) progressKey(id string) string { return s.cfg.Prefix + "/progress/" + id }

// endedKey is a copy of a job's record written by the transaction that
// finishes it, on a short lease: Wait watches it, so a waiting client sees
// one event a job, not one a stage.
func (s *Store) endedKey(id string) string { return s.cfg.Prefix + "/ended/" + id }

// A stage's claims are kept by the node that holds them, so a worker
// follows its own (its Inbox) and no other's; a stage's tasks are kept by
// the node that created them, which follows its own (its Fed): nobody
// watches a whole stage.
func (s *Store) queuePrefix(st Stage) string { return s.cfg.Prefix + "/queues/" + string(st) + "/" }
func (s *Store) taskPrefix(st Stage) string  { return s.queuePrefix(st) + "tasks/" }
func (s *Store) claimPrefix(st Stage) string { return s.queuePrefix(st) + "claims/" }
func (s *Store) inboxPrefix(st Stage, node string) string {
	return s.claimPrefix(st) + node + "/"
}
func (s *Store) claimKey(st Stage, node, task string) string { return s.inboxPrefix(st, node) + task }

// heldKey is the claim key of t's holder ("": t names none).
func (s *Store) heldKey(t *Task) string {
	if t.Holder == "" {
		return ""
	}
	return s.claimKey(t.Stage, t.Holder, t.ID)
}

// Payload records are keyed by their producer, so that a producer follows
// the releases of its own payloads and no others'.
func (s *Store) payloadPrefix() string             { return s.cfg.Prefix + "/payloads/" }
func (s *Store) producerPrefix(node string) string { return s.payloadPrefix() + node + "/" }
func (s *Store) payloadKey(node, id string) string { return s.producerPrefix(node) + id }

// objectsOf is the key prefix of every Store object a job owns (its result,
// previews and relayed latents are named cache.JobObjectID(job, ...)).
func (s *Store) objectsOf(id string) string {
	return cache.ObjectKey(s.cfg.Prefix, cache.JobObjectID(id, ""))
}

// PreviewID names frame f's preview object of job id.
func PreviewID(id string, f int) string { return fmt.Sprintf("%s%04d", previewsOf(id), f) }

// previewsOf is the id prefix of job id's preview objects.
func previewsOf(id string) string { return cache.JobObjectID(id, "frame.") }

// IsPreview reports whether a Store object id names a frame preview of job
// id (PreviewID).
func IsPreview(id, obj string) bool { return strings.HasPrefix(obj, previewsOf(id)) }

// ResultID names the result object of job id.
func ResultID(id string) string { return cache.JobObjectID(id, "result") }

// previewPrefix is the key prefix of a job's preview objects.
func (s *Store) previewPrefix(id string) string {
	return cache.ObjectKey(s.cfg.Prefix, previewsOf(id))
}

// taskKey is <stage's tasks>/<class>/<creator>/<enqueue time>-<id>: the
// tasks a node creates, and so dispatches (Task.Dispatcher), lie under
// one prefix per class (fedPrefix), which its ledger watches; a stage's
// depth by class is a count of one prefix (ClassDepth). The key does not
// move when another node adopts the task.
func (s *Store) taskKey(t *Task) string {
	return fmt.Sprintf("%s%016x-%s", s.fedPrefix(t.Stage, t.Class, t.Dispatcher), t.EnqueuedAt.UnixNano(), t.ID)
}

// fedPrefix is the key prefix of the tasks of stage and class that node
// created ("" names the tasks created with no dispatcher named).
func (s *Store) fedPrefix(st Stage, c routing.Class, node string) string {
	if node == "" {
		node = "-"
	}
	return fmt.Sprintf("%s%d/%s/", s.taskPrefix(st), c, node)
}

// validID keeps user-supplied ids from escaping their key (no '/').
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// validNode keeps a node id named by a peer (a claim proof) inside its
// claim key: gossip's rule for node ids (no '/', at most 128 bytes).
func validNode(node string) bool {
	return node != "" && len(node) <= 128 && !strings.ContainsAny(node, "/ \t\r\n")
}
