// Package shm is the same-host transport of the data plane. Agents on one
// host exchange their arena memfds once, over a Unix socket with SCM_RIGHTS
// after checking the peer's credentials (SO_PEERCRED); from then on a handoff
// is just a Handle (arena id, offset, length, generation) and no payload byte
// crosses a socket.
//
// The producer runs a Server over its arena. A consumer Dials it, maps the
// producer's arena read-only, and then either reads a payload in place (View,
// which pins the buffer in the producer until Release) or copies it into its
// own arena with a parallel copy (CopyInto). Pins and releases travel as small
// fixed-size binary frames on the same Unix socket; a consumer that
// disconnects releases all its pins.
//
// shm builds on transfer/arena and is used by the transfer package; it knows
// nothing of tickets, agents or the control plane.
package shm
