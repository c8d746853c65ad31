// Package cache is latentmesh's Store: an object store pooled over the
// agents, the RFC's Mooncake-style relay for latents, and the home of
// finished results, video previews and (later) cache entries.
//
// Every agent lends part of its registered arena (and optionally a spill
// directory) to the Store. An object is placed by rendezvous hashing over the
// live members with room and copied onto R of them; each copy is an ordinary
// transfer payload of its holder, so readers pull it over the data plane the
// mesh already has (shm on one host, rdma, else tcp). Holders take their
// copies the same way, by pulls along a chain (chain.go): the first pulls
// the putter's payload, each next one the copy before it, as its chunks
// land when that copy is staged in flight; a put returns at R copies, or,
// with PutSpec.FirstCopy, as soon as every copy is published in flight,
// its record then committed while the first copy lands and the put done
// when that copy is whole (Staged.FirstCopied). An object of at most
// Config.InlineMax bytes rides in the store request itself instead, and
// the holder checks it against the object's XXH3 before it stages it.
// The Store opens no data path of its own.
//
// Object metadata is a small JSON record at <prefix>/objects/<id> in etcd:
// size, checksum, holders, lease mode, owner job. Bytes never enter etcd. A
// put is two-phase: Stage copies the bytes onto the holders, then the record
// is written (by Commit, or inside a caller's own transaction through
// Staged.Op); until then no reader can find the object, and holders drop a
// staged copy whose record never appears. A FirstCopy put's record may
// name copies still filling: readers wait on each chunk's readiness, and a
// first copy that fails takes the record back. Lease modes say who frees an
// object: the consuming stage's fenced commit (Consume), time (TTL, via an
// etcd lease per retention bucket), nobody but an explicit delete or its
// retention (Pinned), or the holder's LRU eviction (Cache). Each holder of
// an object has a marker key, <prefix>/holders/<node>/<id>, written with
// the record that names it (marker.go); a Store watches its own markers
// and the key of each record they point to, and frees what is deleted, so
// a record's changes reach its holders, not every agent. The same watches
// keep an index of those records in the agent's memory (loaded when the
// markers are listed, at start and when etcd compacted their watch away or
// was replaced), and each agent's periodic maintenance pass works from it,
// reading none of its records from etcd: it reconciles the copies held
// with the records, and re-replicates objects that lost a holder. One agent
// at a time collects lost and expired objects and asks the agent about
// objects whose job may be gone, reading a bounded page of records a pass
// (OrphanBatch, in turn).
//
// cache sits beside transfer: it imports transfer and etcd, never agent.
// The agent (and agent/jobs, for record keys in its commits) use it.
package cache
