// Package routing is latentmesh's scheduling policy as pure functions and
// plain data: queue ordering (priority class, enqueue time, aging), affinity
// hints with a steal grace, admission for the backpressure chain, placement
// by power of two choices, and the credit ledger of one agent's slots.
//
// It does no I/O and knows nothing of etcd, gossip or the network, so the
// agent and a simulator run the same code. Only agent and testbed import it.
package routing
