// Package routing is latentmesh's scheduling policy as pure functions and
// plain data: queue ordering (priority class, aging, earliest deadline, or
// plain FIFO), preemption of batch work for waiting interactive work, affinity
// hints with a steal grace, admission for the backpressure chain (per-producer
// quotas of a downstream budget), placement
// by power of two choices, and the credit ledger of one agent's slots.
//
// It does no I/O and knows nothing of etcd, gossip or the network, so the
// agent and a simulator run the same code. Only agent and testbed import it.
package routing
