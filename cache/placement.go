package cache

import (
	"slices"

	"github.com/zeebo/xxh3"
)

// RendezvousScore is node's rendezvous weight for key: every node
// computes the same order for a key without coordination, and a member
// joining or leaving moves only the keys it wins or held. The Store
// places objects by it; the agent chooses a stage's orphan sweeper by it.
func RendezvousScore(node, key string) uint64 {
	return xxh3.HashString(node + "\x00" + key)
}

// rank orders members by rendezvous weight for key, highest first.
func rank(members []Member, key string) []Member {
	out := slices.Clone(members)
	slices.SortFunc(out, func(a, b Member) int {
		sa, sb := RendezvousScore(a.Node, key), RendezvousScore(b.Node, key)
		switch {
		case sa > sb:
			return -1
		case sa < sb:
			return 1
		}
		return 0
	})
	return out
}

// place lists the members that may take an object of size bytes, in the
// order the put tries them: by rendezvous weight among those with room,
// leaving out nodes in exclude.
func place(members []Member, key string, size int64, exclude map[string]bool) []Member {
	var out []Member
	for _, m := range rank(members, key) {
		if !exclude[m.Node] && m.Free >= size {
			out = append(out, m)
		}
	}
	return out
}

// collectorKey is the rendezvous key that elects the member collecting
// orphans: one member at a time, with no election round trips.
const collectorKey = "collector"
