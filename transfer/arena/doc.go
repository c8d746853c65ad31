// Package arena owns an agent's registered memory region: one memfd-backed,
// pre-faulted shared mapping per agent, carved into buffers by a thread-safe
// allocator. Engines write payloads into arena buffers and transports land
// incoming payloads straight in them, so payload bytes never pass through the
// Go heap and no transfer pays for a fresh mmap or for page faults.
//
// The memfd is sealed against shrinking and growing so a peer that maps it
// (see Map and package shm) can never be made to fault on a truncated file.
//
// Buffers carry a generation number, so a stale or forged Buf is rejected
// rather than freeing or pinning whatever now occupies its offset.
//
// Arena is used by the transfer data plane (transfer, transfer/shm) and by
// the store; it imports nothing from latentmesh.
package arena
