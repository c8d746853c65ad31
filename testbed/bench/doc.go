// Package bench is latentmesh's benchmark harness, behind `latentmesh-dev bench`.
//
// RunTransfer measures the data plane: pulls of payloads of several sizes
// from a producer in another process, interleaved repetition by repetition
// with a baseline measured in the same run (raw TCP over plain Go sockets for
// tcp, memcpy for shm), so a noisy shared machine moves both alike and the
// ratio stays meaningful. RunOverlap measures what chunked transfer buys a
// decoder: time to first decoded frame and total time for a video latent
// pulled chunk by chunk while the producer is still writing it, against the
// same latent pulled whole and then decoded. RunStore measures the pooled
// Store (package cache) on an in-process mesh of Store nodes and an embedded
// etcd: a put chained onto R holders, until it returns (its first copy)
// against a p2p pull and until its R copies are complete against R pulls
// one after another, and a get from the nearest holder against a p2p pull,
// each interleaved, between the same services.
//
// The consumer (the calling process) re-executes a producer command (by
// default this binary's hidden `bench producer`), which runs ServeProducer and
// takes requests as JSON lines on stdin. Only cmd/latentmesh-dev and tests use
// this package.
package bench
