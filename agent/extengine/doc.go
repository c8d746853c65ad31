// Package extengine connects the agent to an external engine process: a
// worker written in any language (sdk/python is one) that serves stages of
// one or more models over a Unix socket, with tensors in the agent's arena.
//
// The protocol (docs/engine-protocol.md) is length-prefixed msgpack: the
// engine registers its models, the agent answers with its arena's memfd
// (SCM_RIGHTS, once), then sends tasks that name input and output regions
// by offset; the engine reports progress, finishes or fails each task, and
// stops a cancelled one at its next step boundary. Both sides heartbeat.
//
// Protocol v2, negotiated in register and welcome (an engine of either
// version works with an agent of either), adds two features the agent
// grants per session: step checkpoints (a denoise's sampler state inline
// and its latent in a lent arena buffer; resumes; a stop at a checkpoint)
// and a tensor cache the engine reads and fills through lent regions.
// Checkpoint is the checkpoint as this package hands it on, with a CRC'd
// binary encoding the agent stores as an engine.Checkpoint's state.
//
// The agent owns everything else (claims, fencing, credits, transfers,
// commits); this package only runs one stage call at a time per task on
// whatever engine is connected, and says when none is. The agent and the
// `latentmesh engine check` conformance run use it; it imports nothing of
// the agent.
package extengine
