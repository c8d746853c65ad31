package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/latentmesh/latentmesh/transfer"
)

// Mode is an object's lease mode: who frees it.
type Mode string

// Lease modes.
const (
	// Consume objects are freed by the fenced commit of the stage that
	// consumes them (a failed consumer's retry still finds them).
	Consume Mode = "consume"
	// TTL objects are freed when their retention passes.
	TTL Mode = "ttl"
	// Pinned objects are never evicted; they are freed by an explicit
	// delete or when their retention (if any) passes.
	Pinned Mode = "pinned"
	// Cache objects may be evicted, least recently used first, when a
	// holder needs room. They have one replica by default.
	Cache Mode = "cache"
)

// Valid reports whether m is one of the lease modes.
func (m Mode) Valid() bool {
	switch m {
	case Consume, TTL, Pinned, Cache:
		return true
	}
	return false
}

// Tier is where a holder keeps its copy.
type Tier string

// Tiers.
const (
	Memory Tier = "memory" // the holder's registered arena
	Disk   Tier = "disk"   // a file in the holder's spill directory
)

// Holder is one copy of an object: the node that holds it, the tier, and
// the transfer reference readers pull it with.
type Holder struct {
	Node string       `json:"node" msgpack:"node"`
	Tier Tier         `json:"tier" msgpack:"tier"`
	Ref  transfer.Ref `json:"ref" msgpack:"ref"`
}

// Record is an object's metadata, stored as JSON at <prefix>/objects/<ID>.
type Record struct {
	ID          string              `json:"id"`
	Size        int64               `json:"size"`
	Checksum    uint64              `json:"xxh3"` // XXH3-64 of the bytes
	Meta        transfer.TensorMeta `json:"meta"`
	ContentType string              `json:"content_type,omitempty"`
	Mode        Mode                `json:"mode"`
	Job         string              `json:"job,omitempty"` // owner job, for the collector
	Replicas    int                 `json:"replicas"`      // copies wanted
	Holders     []Holder            `json:"holders"`
	CreatedAt   time.Time           `json:"created_at"`
	ExpiresAt   time.Time           `json:"expires_at,omitzero"` // retention end; zero = none
}

// Holds reports whether node holds a copy, and which payload it is.
func (r Record) Holds(node string) (transfer.Ref, bool) {
	for _, h := range r.Holders {
		if h.Node == node {
			return h.Ref, true
		}
	}
	return transfer.Ref{}, false
}

// names reports whether hs names node.
func names(hs []Holder, node string) bool {
	for _, h := range hs {
		if h.Node == node {
			return true
		}
	}
	return false
}

// Key layout under the mesh prefix.

// ObjectsPrefix is the key prefix of every object record of the mesh.
func ObjectsPrefix(prefix string) string { return prefix + "/objects/" }

// ObjectKey is the key of object id's record.
func ObjectKey(prefix, id string) string { return ObjectsPrefix(prefix) + id }

// MaxIDLen bounds an object id (an etcd key segment).
const MaxIDLen = 200

// ValidID reports whether id may name an object: 1 to MaxIDLen letters,
// digits, '-', '_' and '.', so it never addresses another key.
func ValidID(id string) bool {
	if id == "" || len(id) > MaxIDLen || strings.Trim(id, ".") == "" {
		return false
	}
	for _, c := range id {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			return false
		}
	}
	return true
}

// JobObjectID names an object owned by job: "<job>.<name>". Objects of one
// job share the prefix "<job>.", so listing a job's objects is a range read.
func JobObjectID(job, name string) string { return job + "." + name }

// decodeRecord parses a record value.
func decodeRecord(b []byte) (Record, error) {
	var r Record
	if err := json.Unmarshal(b, &r); err != nil {
		return Record{}, fmt.Errorf("cache: decode record: %w", err)
	}
	if !ValidID(r.ID) {
		return Record{}, errors.New("cache: record without a valid id")
	}
	return r, nil
}

func encodeRecord(r Record) string {
	b, err := json.Marshal(r)
	if err != nil {
		panic(fmt.Sprintf("cache: marshal record: %v", err)) // plain struct of ours
	}
	return string(b)
}
