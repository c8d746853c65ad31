// Package attack builds the hostile inputs the hostile-input tests send to a
// running node: memberlist frames that declare absurd lengths, compression
// bombs, deep msgpack, and those frames encrypted with a mesh's gossip key
// so that they reach memberlist's decoders rather than its decrypt check.
//
// It is for tests only (gossip's and testbed's) and imports nothing of
// latentmesh, so the lowest layer's tests may use it.
package attack
