// Package rdma is the RDMA transport of the data plane: one-sided RDMA READ
// from a producer's registered arena straight into the consumer's arena, over
// reliable-connected (RC) queue pairs whose addresses are exchanged on the
// authenticated control channel.
//
// The verbs code is cgo over libibverbs and is compiled only with the build tag
// `rdma` (and cgo). Everything else here is plain Go and always built: the
// public API, the Config, the connection-exchange messages (QPInfo, MemInfo),
// the read planner and per-chunk completion Tracker, the queue pair state
// machine and the read driver. On a build without the tag, or on a host without
// a usable device, Available reports false with a reason and Open returns an
// error wrapping ErrNoDevice; the caller logs that once and uses tcp.
//
// The package knows nothing of the rest of latentmesh: it does not import the
// transfer root, the arena or any higher layer. The transfer root package is
// its only intended user.
package rdma
