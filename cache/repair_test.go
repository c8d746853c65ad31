package cache

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/network"

	"github.com/latentmesh/latentmesh/transfer"
)

// Repair asks settled members first, then those that joined lately (a
// node back from a crash), then suspect ones; within each group the
// object's rendezvous order holds.
func TestRepairCandidatesOrder(t *testing.T) {
	s := &Store{cfg: DefaultConfig()}
	now := time.Now()
	members := []Member{
		{Node: "settled-a", Free: 1 << 20}, {Node: "settled-b", Free: 1 << 20},
		{Node: "rejoined", Free: 1 << 20}, {Node: "suspect", Free: 1 << 20, Suspect: true},
		{Node: "full", Free: 10},
	}
	var r joins
	r.observe(members, now.Add(-time.Hour)) // the first pass: everyone settled
	r.observe(members[:2], now.Add(-time.Minute))
	joined := r.observe(members, now) // "rejoined" and the others came back just now
	if !joined["settled-a"].IsZero() || !joined["rejoined"].Equal(now) {
		t.Fatalf("joined %v", joined)
	}
	cands := s.repairCandidates(members, joined, now)("obj", 1000, map[string]bool{"settled-b": true})
	var got []string
	for _, m := range cands {
		got = append(got, m.Node)
	}
	want := []string{"settled-a", "rejoined", "suspect"} // settled-b holds it; full has no room
	if len(got) != len(want) {
		t.Fatalf("candidates %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("candidates %v, want %v", got, want)
		}
	}
}

// A repair whose first candidate takes the request and never answers (a
// paused peer still in the member list) moves on to the next after
// RepairTimeout, however long RequestTimeout is: one stuck peer costs an
// object a repair timeout, not a request timeout.
func TestRepairPastAStuckCandidate(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 4 << 20, tune: func(cfg *Config) {
		cfg.RequestTimeout = time.Minute
		cfg.RepairTimeout = 300 * time.Millisecond
	}})
	h, err := transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop); h.Close() })
	h.SetStreamHandler(ProtocolID, func(s network.Stream) { <-stop; s.Reset() })
	stuck := Member{Node: "stuck", PeerID: h.ID().String(), Free: 1 << 30}
	for _, a := range h.Addrs() {
		stuck.P2PAddrs = append(stuck.P2PAddrs, a.String())
	}
	ctx := testCtx(t)
	// An object whose holders leave one node, which the stuck peer
	// outranks as the next holder.
	var id string
	for i := 0; id == ""; i++ {
		cand := fmt.Sprintf("obj-%d", i)
		r := rank(append(c.members(), stuck), cand)
		// The put picks the first two nodes; the third is last among them.
		if i := slices.IndexFunc(r, func(m Member) bool { return m.Node == "stuck" }); i < 3 {
			id = cand // stuck outranks the third node
		}
	}
	data := pattern(objSize, 31)
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: id, Mode: Consume}, data)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.extra = []Member{stuck}
	c.mu.Unlock()
	now := c.killFirstHolder(t, ctx, rec) // waits 10 s at most, against a minute per request
	if slices.Contains(holderNodes(now), "stuck") {
		t.Fatalf("holders %v", holderNodes(now))
	}
}

// A pass decides what to repair from the records it follows, which for a
// result are its markers' thin copies; the record read before the repair
// may have changed since. One that no longer makes this node its first
// live holder (here: every holder it names is gone) is left alone, not
// repaired from a copy it does not name (which panicked: the pass indexed
// the live holders of the record read, and there were none).
func TestRepairJudgesTheRecordItReads(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 4 << 20})
	ctx := testCtx(t)
	s := c.nodes[0].s
	rec, err := s.PutBytes(ctx, PutSpec{ID: "judged", Mode: Pinned, Replicas: 2}, pattern(objSize, 7))
	if err != nil {
		t.Fatal(err)
	}
	// What the pass saw: a thin copy naming this node and a holder gone.
	thin, err := decodeThin([]byte(encodeThin(rec)))
	if err != nil {
		t.Fatal(err)
	}
	seen := &listed{Record: thin, thin: true}
	seen.Holders = []Holder{rec.Holders[0], {Node: "gone", Ref: transfer.Ref{ID: "x"}}}
	seen.Holders[0].Node = s.cfg.Node
	// What etcd holds by the time the repair reads it: only holders gone.
	now := rec
	now.Holders = []Holder{{Node: "gone", Ref: transfer.Ref{ID: "x"}}, {Node: "gone2", Ref: transfer.Ref{ID: "y"}}}
	if _, err := c.cli.Put(ctx, ObjectKey(c.prefix, rec.ID), encodeRecord(now)); err != nil {
		t.Fatal(err)
	}
	alive := map[string]bool{}
	for _, m := range c.members() {
		alive[m.Node] = true
	}
	if !s.repairsHere(seen, alive) {
		t.Fatal("the record the pass saw is not one this node repairs: the test sets up nothing")
	}
	if pending := s.repairAll(ctx, []*listed{seen}, c.members(), alive); pending {
		t.Errorf("a record this node no longer repairs left the pass pending")
	}
	resp, err := c.cli.Get(ctx, ObjectKey(c.prefix, rec.ID))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("record: %v", err)
	}
	got, err := decodeRecord(resp.Kvs[0].Value)
	if err != nil || !slices.Equal(holderNodes(got), []string{"gone", "gone2"}) {
		t.Fatalf("the record was rewritten to %v (%v); it is not this node's to repair", holderNodes(got), err)
	}
}
