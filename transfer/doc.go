// Package transfer owns the data plane: it keeps payloads a producer has
// published, authorises pulls with tickets issued over an authenticated libp2p
// control channel, and moves payload bytes straight into the consumer's
// destination slice over one of three transports, chosen per producer
// (TransportFor): shm between agents on one host (the producer's arena memfd,
// passed once over a Unix socket, then offsets; package shm), rdma between
// hosts that both have a device (one-sided READ into the consumer's
// registered arena; package rdma), else tcp over pooled, striped raw
// connections with per-block XXH3 checksums verified as each block lands,
// whose senders run Config.TCPCongestion.
//
// With Config.Arena set, a Service owns one arena (package arena): Alloc,
// Begin and the shm and rdma transports use it, and Stats reports its
// occupancy. Without one, payload memory is heap memory and pulls use tcp.
//
// The agent and the store use it; it knows nothing of either. libp2p carries
// identity and small msgpack control frames only: payload bytes never pass
// through libp2p streams or msgpack.
//
// A pull is two steps. The consumer asks the producer for a ticket over a
// libp2p stream on ProtocolID; the producer binds the ticket to the payload,
// the stream's authenticated remote peer and an expiry, and MACs it with a
// per-process secret. The consumer then dials the producer's data address,
// proves its peer identity once per connection by signing a fresh nonce, and
// sends {ticket, offset, length} requests; each is verified before a byte is
// sent.
package transfer
