package cache

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Member is a live member of the mesh as the Store needs it: how to reach
// it, whether it shares this host, and how much Store room it gossips.
type Member struct {
	Node     string
	PeerID   string   // libp2p peer id: where store requests go
	P2PAddrs []string // its libp2p multiaddrs
	Host     string   // host identity; equal to ours means same host
	Free     int64    // the largest object it can take now (Store.Room), as last gossiped
	// Suspect: gossip's probes of it failed lately (paused, cut off): a
	// repair asks it last.
	Suspect bool
}

// Config configures a Store. New copies it; it is frozen afterwards.
type Config struct {
	// Prefix is the mesh's etcd key prefix.
	Prefix string
	// Node is this agent's node id, as holders are named in records.
	Node string
	// MemoryCapacity is how many bytes of the arena this node lends to the
	// Store (0: it holds nothing in memory).
	MemoryCapacity int64
	// SpillDir is where copies go when memory is full; "" means no disk
	// tier. Each node uses its own subdirectory, <SpillDir>/<Node>, which it
	// empties when it starts: spilled copies die with the agent, as memory
	// copies do, and the survivors' replicas cover them.
	SpillDir string
	// SpillCapacity bounds the bytes kept in SpillDir.
	SpillCapacity int64
	// CacheCapacity bounds the bytes of Cache objects (content-addressed
	// entries, Memo) this node holds, within MemoryCapacity: past it the
	// least recently used are evicted. 0 leaves them bounded by
	// MemoryCapacity alone. Cache copies are held in memory only.
	CacheCapacity int64
	// CacheEntries bounds how many Cache objects this node holds (0: no
	// bound but CacheCapacity): each has a record in etcd, so this bounds
	// the etcd bytes the node's entries take, whatever their size.
	CacheEntries int
	// MemoWait is how long a Memo waits for an entry another agent is
	// producing (it holds the entry's flight key) before producing it
	// itself: longer than producing one entry takes.
	MemoWait time.Duration
	// EntryTTL is how long Entry trusts an entry held on another node that
	// it read from etcd, before it reads it again: an entry evicted
	// meanwhile costs the job that found it a rewind.
	EntryTTL time.Duration
	// Replicas is R for objects whose put does not say: relayed latents,
	// results. Cache objects default to one.
	Replicas int
	// StageTimeout is how long a holder keeps a staged copy whose record
	// has not appeared (its putter died or gave up) before dropping it.
	StageTimeout time.Duration
	// RequestTimeout bounds one store request to a peer, including the copy
	// of the object's bytes onto it.
	RequestTimeout time.Duration
	// MaintainEvery is the period of the maintenance pass: reconcile held
	// copies with the records, re-replicate objects that lost a holder,
	// collect lost, expired and orphaned objects. A pass works from the
	// records naming this node that its watches keep in memory and reads
	// none of them from etcd; the collector reads one page of records
	// (OrphanBatch). A member leaving triggers a pass at once (Kick).
	MaintainEvery time.Duration
	// RepairTimeout bounds asking one member for a repair copy (plus a
	// second per 64 MiB of the object): a paused or cut-off candidate costs
	// its object this, and the next candidate is asked.
	RepairTimeout time.Duration
	// VerifyEvery is how often a record that its holders follow by their
	// markers alone (a Pinned one: a result) is read again, a batch of
	// them a pass: a write that left a holder's marker unchanged (a blind
	// put over it, a blind delete no writer told it of) reaches it then.
	VerifyEvery time.Duration
	// RepairRetry is how soon a pass follows one that left an object of
	// this node's short of copies (a repair failed: a candidate full or
	// cut off, etcd away), instead of waiting for MaintainEvery.
	RepairRetry time.Duration
	// RepairParallel is how many objects one pass repairs at once.
	RepairParallel int
	// RecentJoin: a member that joined (or came back) less than this ago
	// is asked for repair copies after settled members. A node that has
	// just restarted is the likeliest to go again (a crash loop, a flaky
	// host), and a copy moved onto it each time is lost each time.
	RecentJoin time.Duration
	// OrphanBatch is the most records the collector reads, judges and
	// asks Orphans about in one pass, taken in id order from where the
	// previous pass stopped: each question costs the agent reads of job
	// records in etcd, so a pass costs the same however many objects are
	// retained, and every object is judged within
	// ceil(objects/OrphanBatch) passes.
	OrphanBatch int
	// LostGrace is how long every holder of an object must have been
	// gone (not alive in gossip and not registered in etcd, as the
	// collector saw it on each of its passes) before the collector deletes
	// the record as lost. A partitioned or paused holder loses its
	// registration after a lease TTL but keeps its copy, and gets the
	// registration back when it heals; deleting the record at once would
	// make that copy unreachable for good. A holder that restarts without
	// its copies unlists itself from the records at once, so this wait
	// only delays the cleanup of records whose holders never come back.
	LostGrace time.Duration
	// ExpiryGrace is how long past its retention a record may outlive its
	// etcd lease (etcd extends leases on a leader change) before the
	// collector deletes it.
	ExpiryGrace time.Duration
	// InlineMax is the largest object a put sends to its remote holders
	// inside the store request (an inline put) rather than having each
	// pull it from the putter over the data plane, which costs a ticket
	// stream and a data connection per holder on top of the request. It
	// applies when the source is this node's own payload (a put, or a
	// repair by the object's first live holder); other copies are pulled.
	// 0 pulls every copy. MaxFrame must hold it with room for the rest of
	// the request.
	InlineMax int
	// MaxFrame bounds a store control frame, and so what one request can
	// make a holder allocate, inline data included: a longer frame is
	// refused before it is read. At least InlineMax plus the 16 KiB the
	// rest of a request may take.
	MaxFrame int
	// Registered, when set, lists the nodes registered in etcd, read from
	// etcd when called (not from a gossip view). The collector deletes an
	// object as lost only when none of its holders is registered, so a node
	// whose view is stale (cut off by a partition, or just healed) cannot
	// declare live copies lost. Nil trusts the members function alone.
	Registered func(ctx context.Context) (map[string]bool, error)
	// IsMember, when set, says whether a libp2p peer is a member of the
	// mesh, and so may send store requests: the mesh's rule is a
	// registration in etcd, whatever gossip says of its liveness (a peer
	// back from a pause is registered before gossip has it alive again,
	// and it is then the one repairing its objects). Nil admits the peers
	// of the member list.
	IsMember func(peerID string) bool
	// Logger receives the Store's logs, named "store".
	Logger *zap.Logger
	// Now is the clock; tests may set it.
	Now func() time.Time
	// VerifyHolder says whether a holder in an object's record is who it
	// claims: node is registered with peer id peerID, the producer of the
	// holder's ref. Reads (Nearest, Fetch) skip holders it refuses, so a
	// record forged in etcd cannot point them at another peer. nil trusts
	// every record (tests); the agent checks etcd registrations.
	VerifyHolder func(node, peerID string) bool
}

// DefaultConfig sets every field; callers fill Prefix, Node and capacities.
func DefaultConfig() Config {
	return Config{
		Prefix:         "/latentmesh/default",
		Replicas:       2,                // survives one holder's death
		StageTimeout:   2 * time.Minute,  // a put's copy plus a commit retried across an etcd hiccup
		RequestTimeout: 60 * time.Second, // copying 4 GiB at ~1 GB/s on a busy link
		MaintainEvery:  10 * time.Second, // a departure is kicked at once; this is the safety net
		RepairTimeout:  3 * time.Second,  // an answering holder copies a small object in milliseconds
		RepairRetry:    time.Second,      // a failed repair is tried again soon, not a period later
		VerifyEvery:    time.Hour,        // every write of a result tells its holders' markers; this is the safety net
		RepairParallel: 8,                // a departed holder's objects mend together
		RecentJoin:     30 * time.Second, // longer than a restart loop's period
		OrphanBatch:    500,              // at most 500 records and job records read a pass; 2,000 objects all judged in 40 s
		LostGrace:      5 * time.Minute,  // outlasts partitions and stalls a holder recovers from
		ExpiryGrace:    time.Minute,
		MemoWait:       10 * time.Second, // a text encoder takes milliseconds to a second
		EntryTTL:       2 * time.Second,  // a text every job asks for: one read per 2 s, not one per job
		// Result images and small latents (a few KiB to tens of KiB) go
		// inline; at 64 KiB copying through the stream still costs less
		// than a pull's extra round trips (BenchmarkStagePut).
		InlineMax: 64 << 10,
		MaxFrame:  128 << 10, // InlineMax twice over; a pull request is two refs and an id (under 16 KiB)
		Logger:    zap.NewNop(),
		Now:       time.Now,
	}
}

func (c Config) validate() (Config, error) {
	switch {
	case c.Node == "":
		return c, errors.New("cache: config: Node is empty")
	case strings.Contains(c.Node, "/"):
		return c, fmt.Errorf("cache: config: Node %q has a '/': it names the key prefix of its markers", c.Node)
	case c.Prefix == "" || c.Prefix[0] != '/':
		return c, fmt.Errorf("cache: config: prefix %q must start with /", c.Prefix)
	case c.MemoryCapacity < 0 || c.SpillCapacity < 0 || c.CacheCapacity < 0 || c.CacheEntries < 0:
		return c, errors.New("cache: config: capacities must not be negative")
	case c.SpillCapacity > 0 && c.SpillDir == "":
		return c, errors.New("cache: config: SpillCapacity needs a SpillDir")
	case c.Replicas < 1 || c.Replicas > 8:
		return c, fmt.Errorf("cache: config: Replicas %d not in [1,8]", c.Replicas)
	case c.StageTimeout <= 0 || c.RequestTimeout <= 0 || c.MaintainEvery <= 0 || c.VerifyEvery <= 0 || c.ExpiryGrace < 0 || c.LostGrace < 0 || c.MemoWait <= 0 || c.EntryTTL < 0:
		return c, errors.New("cache: config: timeouts must be positive (start from DefaultConfig)")
	case c.RepairTimeout <= 0 || c.RepairRetry <= 0 || c.RepairParallel < 1 || c.RecentJoin < 0:
		return c, errors.New("cache: config: RepairTimeout, RepairRetry and RepairParallel must be positive (start from DefaultConfig)")
	case c.OrphanBatch < 1:
		return c, fmt.Errorf("cache: config: OrphanBatch %d < 1", c.OrphanBatch)
	case c.MaxFrame < 1024:
		return c, fmt.Errorf("cache: config: MaxFrame %d < 1024", c.MaxFrame)
	case c.InlineMax < 0 || c.InlineMax > maxInline:
		return c, fmt.Errorf("cache: config: InlineMax %d not in [0,%d]", c.InlineMax, maxInline)
	case c.InlineMax > 0 && c.MaxFrame < c.InlineMax+requestRoom:
		return c, fmt.Errorf("cache: config: MaxFrame %d cannot hold InlineMax %d plus %d bytes of request", c.MaxFrame, c.InlineMax, requestRoom)
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c, nil
}
