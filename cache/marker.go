package cache

import (
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Holder markers.
//
// Every holder a record names has a marker, an empty key at
// <prefix>/holders/<node>/<id>, written by the transaction that names it
// (Staged.Op, a repair, a reannounce) and on the record's lease, so a
// marker of an expiring record expires with it. A Store watches its own
// markers' prefix, and the key of each record a marker points to
// (follow.go): a record's changes reach its holders, not every agent, so
// a write costs O(replicas) watch events whatever the mesh's size. Every
// Store used to watch all of objects/, N events a write for N agents.
//
// A writer that read the record it replaces (a repair, an unlisting, the
// collector, an eviction, a failed put taken back) deletes, in the same
// transaction, the markers of the holders it takes out. Records are also
// written and deleted blind (a put over an older record of the same id, a
// consuming commit or a job's deletion by key or prefix, Delete): a holder
// whose record went or stopped naming it deletes its own marker on its
// next pass (dropMarkers). A holder restarted without its copies finds the
// records that still name it by its markers, and unlists itself.

// markersPrefix is the key prefix of node's markers.
func markersPrefix(prefix, node string) string { return prefix + "/holders/" + node + "/" }

// markerKey is node's marker for object id.
func markerKey(prefix, node, id string) string { return markersPrefix(prefix, node) + id }

// writeOps are the operations that set object id's record to rec (nil:
// delete it) with its holders' markers: a marker for each holder rec names
// that was does not, and no marker for each holder of was that rec does
// not name. was is the record the write replaces, when the writer read it
// (and its transaction compares that record's revision); nil for a blind
// write, whose left-out holders drop their own markers.
func writeOps(prefix, id string, rec *Record, lease clientv3.LeaseID, was []Holder) []clientv3.Op {
	var opts []clientv3.OpOption
	if lease != 0 {
		opts = append(opts, clientv3.WithLease(lease))
	}
	key := ObjectKey(prefix, id)
	var ops []clientv3.Op
	var now []Holder
	if rec == nil {
		ops = append(ops, clientv3.OpDelete(key))
	} else {
		ops = append(ops, clientv3.OpPut(key, encodeRecord(*rec), opts...))
		now = rec.Holders
	}
	// A node is named once per record, but a record read from etcd is not
	// ours to trust: a key written twice would fail the transaction.
	seen := map[string]bool{}
	for _, h := range now {
		if !seen[h.Node] && !names(was, h.Node) {
			ops = append(ops, clientv3.OpPut(markerKey(prefix, h.Node, id), "", opts...))
		}
		seen[h.Node] = true
	}
	for _, h := range was {
		if !seen[h.Node] {
			ops = append(ops, clientv3.OpDelete(markerKey(prefix, h.Node, id)))
		}
		seen[h.Node] = true
	}
	return ops
}
