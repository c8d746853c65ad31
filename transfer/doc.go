// Package transfer owns the data plane: it keeps payloads a producer has
// published, authorises pulls with tickets issued over an authenticated libp2p
// control channel, and moves payload bytes over pooled raw TCP connections
// straight into the consumer's destination slice.
//
// The agent and the store use it; it knows nothing of either. libp2p carries
// identity and small msgpack control frames only: payload bytes never pass
// through libp2p streams or msgpack. Same-host (shm) and RDMA transports live
// in the subpackages arena and rdma and plug in beside tcp later.
//
// A pull is two steps. The consumer asks the producer for a ticket over a
// libp2p stream on ProtocolID; the producer binds the ticket to the payload,
// the stream's authenticated remote peer and an expiry, and MACs it with a
// per-process secret. The consumer then dials the producer's data address,
// proves its peer identity once per connection by signing a fresh nonce, and
// sends {ticket, offset, length} requests; each is verified before a byte is
// sent.
package transfer
