package cache

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// listed is a record with what a conditional update needs.
type listed struct {
	Record
	modRev int64
	lease  clientv3.LeaseID
	// thin: taken from a marker (thinRecord), not the record itself; read
	// the record (Store.whole) before acting on it.
	thin bool
}

// entry is one object this node follows: a marker of its points to the
// object's record (or the node found a record naming one of its copies
// without one, checkUnnamed), and a watch of the record's key keeps rec
// current (follow.go), or, for a record followed by its markers alone,
// the marker's own events.
type entry struct {
	id  string
	rec *listed // the record as of rev; nil: none
	// rev is the revision the key's state is known through; 0 while it
	// loads (its first read, or its watch's first event, has not come).
	rev    int64
	marker int64              // this node's marker's mod revision; 0: none
	stop   context.CancelFunc // ends the key's watch; nil until it starts
	// byMarker: the record is followed by this node's marker alone, no
	// watch of its key (byMarkerOnly); checked is when it was last read.
	byMarker bool
	checked  time.Time
}

// byMarkerOnly reports whether a record's holders follow it by their
// markers alone. A Pinned record (a job's result) lives as long as its
// retention, days, and changes only by writes that tell its holders'
// markers: its repairs and unlistings, which put every holder's marker,
// its job's deletion and the collector, which delete them, and its
// lease's end, which takes them with it. A watch of each such record on
// each holder would be thousands of watches an agent, held for days.
// Other records live for a stage or a checkpoint's while, and are deleted
// blind (a consuming commit, a job's end): their holders watch them.
func byMarkerOnly(l *listed) bool { return l != nil && l.Mode == Pinned }

// names reports whether e's record names node.
func (e *entry) names(node string) bool { return e.rec != nil && names(e.rec.Holders, node) }

// index is the records that name this node, as its watches have seen them
// (follow.go): maintenance works from it instead of reading them from etcd
// on every pass. An entry's record is replaced, never changed in place, so
// a snapshot may share records with the index.
type index struct {
	mu sync.Mutex
	// mu guards the fields below. The watches hold it while they apply a
	// response, to the holdings as well as to the entries, and maintenance
	// while it reconciles the holdings with them: each sees the other's
	// work whole.
	entries map[string]*entry // by object id
	rev     int64             // the markers are whole through rev; 0: not listed
}

// getLocked returns object id's entry, or nil.
func (x *index) getLocked(id string) *entry { return x.entries[id] }

// addLocked follows object id (its entry loading).
func (x *index) addLocked(id string) *entry {
	if x.entries == nil {
		x.entries = map[string]*entry{}
	}
	e := &entry{id: id}
	x.entries[id] = e
	return e
}

// forgetLocked stops following e.
func (x *index) forgetLocked(e *entry) {
	if e.stop != nil {
		e.stop()
	}
	if x.entries[e.id] == e {
		delete(x.entries, e.id)
	}
}

// reset stops following every record, until the markers are listed again;
// passes skip meanwhile.
func (x *index) reset() {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, e := range x.entries {
		x.forgetLocked(e)
	}
	x.rev = 0
}

// recordsLocked returns the records of the loaded entries, in id order.
func (x *index) recordsLocked() []*listed {
	var ls []*listed
	for _, e := range x.entries {
		if e.rev != 0 && e.rec != nil {
			ls = append(ls, e.rec)
		}
	}
	slices.SortFunc(ls, func(a, b *listed) int { return strings.Compare(a.ID, b.ID) })
	return ls
}
