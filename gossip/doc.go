// Package gossip owns cluster membership for a latentmesh agent: who is in
// the mesh, where to reach them, and a fast, soft hint of their load.
//
// Two sources are merged into one Membership view. etcd is the durable truth:
// each agent registers a NodeRecord (JSON, readable with etcdctl) under
// <prefix>/nodes/<node-id> on its own lease, and a node whose record is gone
// is not a member. hashicorp/memberlist is the fast hint: it detects failures
// in seconds and carries a small NodeMeta (credits, queue depth, load) that
// changes far too often to write to etcd.
//
// The agent owns a Membership and reads the view from it; routing policy is
// fed from the view but never imports this package's network side. gossip
// imports no other latentmesh package.
package gossip
