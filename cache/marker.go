package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/transfer"
)

// Holder markers.
//
// Every holder a record names has a marker, a key at
// <prefix>/holders/<node>/<id>, written by the transaction that names it
// (Staged.Op, a repair, a reannounce) and on the record's lease, so a
// marker of an expiring record expires with it. Its value is the record
// that transaction wrote, thinned (thinRecord, encodeThin): a holder that sees the
// marker's event knows what its copy needs without reading the record, and
// reads the whole record only to act on it (a repair, an unlisting, a
// cache entry's lookup), which a copy that stays healthy never does.
// Markers written before they carried it are empty: their holders read
// the record. A Store watches its own
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
// delete it) with its holders' markers: a marker for each holder rec
// names, and no marker for each holder of was that rec does not name. was is the record the write replaces, when the writer read it
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
	var thin string
	if rec == nil {
		ops = append(ops, clientv3.OpDelete(key))
	} else {
		ops = append(ops, clientv3.OpPut(key, encodeRecord(*rec), opts...))
		thin, now = encodeThin(*rec), rec.Holders
	}
	// Every holder's marker is put, not only a new holder's: it carries
	// the record, and a holder that follows the record by its marker alone
	// (byMarkerOnly) learns of the rewrite from it. A node is named once
	// per record, but a record read from etcd is not ours to trust: a key
	// written twice would fail the transaction.
	seen := map[string]bool{}
	for _, h := range now {
		if !seen[h.Node] && validMarkerNode(h.Node) {
			ops = append(ops, clientv3.OpPut(markerKey(prefix, h.Node, id), thin, opts...))
		}
		seen[h.Node] = true
	}
	return append(ops, dropMarkers(prefix, id, was, seen)...)
}

// dropMarkers are the deletes of the markers object id's holders have,
// but those of the nodes in keep (which it fills): each node once, and
// none whose name could reach outside its own markers (validMarkerNode).
func dropMarkers(prefix, id string, holders []Holder, keep map[string]bool) []clientv3.Op {
	var ops []clientv3.Op
	for _, h := range holders {
		if !keep[h.Node] && validMarkerNode(h.Node) {
			ops = append(ops, clientv3.OpDelete(markerKey(prefix, h.Node, id)))
		}
		keep[h.Node] = true
	}
	return ops
}

// thinRecord is what a record's markers carry of it: what a holder needs
// to judge its copy and whether the object is short of copies (the
// holders' nodes, tiers and copy ids, the object's checksum, mode and
// replicas), not what a reader or a rewrite needs (where each copy is
// served, the object's size, layout, owner and retention), in short keys:
// a marker stays a fraction of its record.
type thinRecord struct {
	ID       string       `json:"i"`
	Checksum uint64       `json:"x"`
	Mode     Mode         `json:"m"`
	Replicas int          `json:"r"`
	Holders  []thinHolder `json:"h"`
}

type thinHolder struct {
	Node string `json:"n"`
	Tier Tier   `json:"t"`
	Ref  string `json:"r"` // the copy's transfer.Ref.ID
}

// A marker names at most maxHolders holders (a record has at most 8
// replicas, and a repair adds one before its rewrite drops one) in at
// most maxThin bytes: decodeThin refuses more.
const (
	maxHolders = 16
	maxThin    = 4096
)

// encodeThin is rec's thin copy, as a marker's value.
func encodeThin(rec Record) string {
	t := thinRecord{ID: rec.ID, Checksum: rec.Checksum, Mode: rec.Mode, Replicas: rec.Replicas, Holders: make([]thinHolder, len(rec.Holders))}
	for i, h := range rec.Holders {
		t.Holders[i] = thinHolder{Node: h.Node, Tier: h.Tier, Ref: h.Ref.ID}
	}
	b, err := json.Marshal(t)
	if err != nil {
		panic(fmt.Sprintf("cache: marshal marker: %v", err)) // plain struct of ours
	}
	return string(b)
}

// decodeThin is the record a marker's value b carries, thinned: the fields
// encodeThin keeps, the others zero.
func decodeThin(b []byte) (Record, error) {
	// Any node may write a marker: bound what one makes a holder decode.
	if len(b) > maxThin {
		return Record{}, fmt.Errorf("cache: marker of %d bytes, over %d", len(b), maxThin)
	}
	var t thinRecord
	if err := json.Unmarshal(b, &t); err != nil {
		return Record{}, fmt.Errorf("cache: decode marker: %w", err)
	}
	if !ValidID(t.ID) {
		return Record{}, errors.New("cache: marker without a valid id")
	}
	if len(t.Holders) > maxHolders {
		return Record{}, fmt.Errorf("cache: marker names %d holders, over %d", len(t.Holders), maxHolders)
	}
	rec := Record{ID: t.ID, Checksum: t.Checksum, Mode: t.Mode, Replicas: t.Replicas, Holders: make([]Holder, len(t.Holders))}
	for i, h := range t.Holders {
		rec.Holders[i] = Holder{Node: h.Node, Tier: h.Tier, Ref: transfer.Ref{ID: h.Ref}}
	}
	return rec, nil
}

// MarkerDeletes are the deletes of the markers of every holder the record
// kv (read from etcd) names: a writer deleting a record it read deletes
// them in the same transaction, so that holders that follow the record by
// their markers alone (a result) free their copies at once. None for a
// record that does not decode.
func MarkerDeletes(prefix string, kv *mvccpb.KeyValue) []clientv3.Op {
	rec, err := decodeRecord(kv.Value)
	if err != nil {
		return nil
	}
	return dropMarkers(prefix, rec.ID, rec.Holders, map[string]bool{})
}

// validMarkerNode reports whether node may name a marker: a node id with
// no '/' (Config.Node's rule), so a record read from etcd cannot make a
// delete reach outside its node's markers.
func validMarkerNode(node string) bool { return node != "" && !strings.Contains(node, "/") }
