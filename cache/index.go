package cache

import (
	"slices"
	"strings"
	"sync"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// listed is a record with what a conditional update needs.
type listed struct {
	Record
	modRev int64
	lease  clientv3.LeaseID
}

// index is the object records as this node's watch has seen them, whole
// through revision rev: maintenance works from it instead of reading every
// record from etcd on every pass. The watch loads it from a list (at start,
// after a compacted watch, after etcd was replaced) and applies every event
// to it. An entry is replaced, never changed in place, so a snapshot may
// share entries with the index.
type index struct {
	mu sync.Mutex
	// mu guards the fields below. The watch holds it while it applies a
	// response, to the holdings as well as to the index, and maintenance
	// while it reconciles the holdings with the index: each sees the
	// other's work whole.
	recs []*listed // in id order; a record's id is its key's
	rev  int64     // every event up to rev is applied; 0: not loaded
	// changed is closed, and replaced, whenever the index changes
	// (changedLocked): Memo waits on it for an entry to appear.
	changed chan struct{}
}

// changedLocked wakes whoever waits for the index to change.
func (x *index) changedLocked() {
	if x.changed != nil {
		close(x.changed)
	}
	x.changed = make(chan struct{})
}

// watch returns a channel closed at the index's next change.
func (x *index) watch() <-chan struct{} {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.changed == nil {
		x.changed = make(chan struct{})
	}
	return x.changed
}

// loadLocked replaces the index with ls, listed at revision rev; it sorts
// ls in place, and keeps it.
func (x *index) loadLocked(ls []*listed, rev int64) {
	slices.SortFunc(ls, func(a, b *listed) int { return strings.Compare(a.ID, b.ID) })
	x.recs, x.rev = ls, rev
	x.changedLocked()
}

// reset empties the index until the next load; passes skip meanwhile.
func (x *index) reset() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.recs, x.rev = nil, 0
}

// putLocked replaces (or adds) the entry of l's object.
func (x *index) putLocked(l *listed) {
	i, found := search(x.recs, l.ID)
	if found {
		x.recs[i] = l
		return
	}
	x.recs = slices.Insert(x.recs, i, l)
}

// deleteLocked removes object id's entry, if any.
func (x *index) deleteLocked(id string) {
	if i, found := search(x.recs, id); found {
		x.recs = slices.Delete(x.recs, i, i+1)
	}
}

// search finds object id in ls (in id order): its position, or where it
// would go.
func search(ls []*listed, id string) (int, bool) {
	return slices.BinarySearchFunc(ls, id, func(l *listed, id string) int { return strings.Compare(l.ID, id) })
}

// lookup returns object id's entry in ls (in id order), or nil.
func lookup(ls []*listed, id string) *listed {
	if i, found := search(ls, id); found {
		return ls[i]
	}
	return nil
}
