package cache

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// durableFiles lists a node's durable copies on disk.
func durableFiles(t *testing.T, n *node) []string {
	t.Helper()
	fs, err := filepath.Glob(filepath.Join(n.spill, n.name, "*"+durableExt))
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// readFrom reads id from holder's copy alone, as any reader would pull it.
func readFrom(t *testing.T, c *cluster, reader *node, id, holder string) ([]byte, error) {
	t.Helper()
	ctx := testCtx(t)
	rec, err := reader.s.Lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	only := rec
	only.Holders = nil
	for _, h := range rec.Holders {
		if h.Node == holder {
			only.Holders = append(only.Holders, h)
		}
	}
	if len(only.Holders) == 0 {
		return nil, fmt.Errorf("%s is not named in %v", holder, holderNodes(rec))
	}
	buf := make([]byte, rec.Size)
	return buf, reader.s.Fetch(ctx, only, buf)
}

// A pinned object is written through to each holder's disk tier; a holder
// killed and restarted finds its copy, verifies it and is named in the
// record again under its new ref, and serves the same bytes. Both holders
// restarted one after the other: the object is never lost.
func TestDurableCopySurvivesRestarts(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 2, mem: 1 << 20, disk: 1 << 20})
	ctx := testCtx(t)
	data := pattern(100_000, 7) // above InlineMax: pulled by the second holder
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: "result", Mode: Pinned}, data)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Holders) != 2 {
		t.Fatalf("holders %v", holderNodes(rec))
	}
	for _, h := range rec.Holders {
		if h.Tier != Disk {
			t.Fatalf("holder %s tier %s, want disk (written through)", h.Node, h.Tier)
		}
	}
	for _, n := range c.nodes {
		if fs := durableFiles(t, n); len(fs) != 1 {
			t.Fatalf("%s: durable files %v", n.name, fs)
		}
	}
	for _, name := range []string{"n0", "n1"} {
		c.kill(name)
		n := c.restart(name)
		eventually(t, 10*time.Second, name+" named again", func() error {
			got, err := readFrom(t, c, n, "result", name)
			if err != nil {
				return err
			}
			if !bytes.Equal(got, data) {
				return errors.New("bytes differ")
			}
			if st := n.s.LocalStats(); st.Reannounced != 1 || st.Recovered != 0 || st.Staged != 0 {
				return fmt.Errorf("stats %+v", st)
			}
			return nil
		})
	}
	rec, err = c.nodes[0].s.Lookup(ctx, "result")
	if err != nil || len(rec.Holders) != 2 {
		t.Fatalf("record after both restarts: %v %v", holderNodes(rec), err)
	}
	// Deleted while a holder is down: the copy it finds at restart is
	// nobody's, and goes.
	c.kill("n1")
	if err := c.nodes[0].s.Delete(ctx, "result"); err != nil {
		t.Fatal(err)
	}
	n1 := c.restart("n1")
	eventually(t, 10*time.Second, "an unwanted recovered copy freed", func() error {
		if fs := durableFiles(t, n1); len(fs) != 0 {
			return fmt.Errorf("durable files %v", fs)
		}
		if st := n1.s.LocalStats(); st.Copies != 0 || st.DiskUsed != 0 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// The only holder of a durable copy restarts: the object is served again
// once it is back, with no other copy anywhere.
func TestOnlyHolderRestarts(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 1 << 20, disk: 1 << 20})
	data := pattern(5000, 9) // small: the put is local
	if _, err := c.nodes[0].s.PutBytes(testCtx(t), PutSpec{ID: "only", Mode: Pinned}, data); err != nil {
		t.Fatal(err)
	}
	c.kill("n0")
	n := c.restart("n0")
	eventually(t, 10*time.Second, "served after the restart", func() error {
		got, _, err := n.s.ReadAll(testCtx(t), "only")
		if err != nil {
			return err
		}
		if !bytes.Equal(got, data) {
			return errors.New("bytes differ")
		}
		return nil
	})
}

// A durable copy whose bytes changed on disk, or whose sidecar is missing,
// is removed at start instead of being served.
func TestDurableCopyCheckedAtStart(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 1, mem: 1 << 20, disk: 1 << 20})
	ctx := testCtx(t)
	for _, id := range []string{"flipped", "no-sidecar"} {
		if _, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: id, Mode: Pinned}, pattern(5000, 3)); err != nil {
			t.Fatal(err)
		}
	}
	c.kill("n0")
	for _, f := range durableFiles(t, c.node("n0")) {
		switch base := filepath.Base(f); {
		case bytes.HasPrefix([]byte(base), []byte("flipped")):
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			b[100] ^= 0xff
			if err := os.WriteFile(f, b, 0o600); err != nil {
				t.Fatal(err)
			}
		default:
			if err := os.Remove(f[:len(f)-len(durableExt)] + sidecarExt); err != nil {
				t.Fatal(err)
			}
		}
	}
	n := c.restart("n0")
	if st := n.s.LocalStats(); st.Copies != 0 || st.DiskUsed != 0 {
		t.Fatalf("bad copies recovered: %+v", st)
	}
	if fs := durableFiles(t, n); len(fs) != 0 {
		t.Fatalf("bad copies left on disk: %v", fs)
	}
	eventually(t, 10*time.Second, "records of lost copies gone", func() error {
		for _, id := range []string{"flipped", "no-sidecar"} {
			if _, err := n.s.Lookup(ctx, id); !errors.Is(err, ErrNotFound) {
				return fmt.Errorf("%s: %v", id, err)
			}
		}
		return nil
	})
}

// Keep, before a commit that waited, names only the staged copies that are
// still held, restarts their timeouts, and fails once none is left.
func TestStagedKeep(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 1 << 20})
	ctx := testCtx(t)
	st, err := c.nodes[0].s.StageBytes(ctx, PutSpec{ID: "waited", Mode: Consume}, pattern(5000, 4))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Record.Holders) != 2 {
		t.Fatalf("staged on %v", holderNodes(st.Record))
	}
	gone, kept := st.Record.Holders[0], st.Record.Holders[1]
	c.node(gone.Node).s.dropStaged("waited", gone.Ref.ID)
	if err := st.Keep(ctx); err != nil {
		t.Fatal(err)
	}
	if got := holderNodes(st.Record); len(got) != 1 || got[0] != kept.Node {
		t.Fatalf("kept %v, want [%s]", got, kept.Node)
	}
	if err := st.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got, _, err := c.nodes[0].s.ReadAll(ctx, "waited")
	if err != nil || !bytes.Equal(got, pattern(5000, 4)) {
		t.Fatalf("read after a pruned commit: %v", err)
	}

	st2, err := c.nodes[0].s.StageBytes(ctx, PutSpec{ID: "all-gone", Mode: Consume}, pattern(5000, 5))
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range st2.Record.Holders {
		c.node(h.Node).s.dropStaged("all-gone", h.Ref.ID)
	}
	if err := st2.Keep(ctx); !errors.Is(err, ErrNotFound) {
		t.Fatalf("keep with every copy gone = %v, want ErrNotFound", err)
	}
}

// A staged copy past its timeout is kept when etcd has a record naming it,
// although the index has not seen that record: a put committed late
// (across an outage, after a reclaim) keeps its copies, and the holder
// follows that record from then on.
func TestLateCommitKeepsStagedCopy(t *testing.T) {
	s, x := bareStore(t, 1<<20)
	s.cli = testClient(t)
	s.cfg.Prefix = fmt.Sprintf("/latecommit/%d", prefixSeq.Add(1))
	now := time.Now()
	s.cfg.Now = func() time.Time { return now }
	c := holdCopy(t, s, x, "late", pattern(4096, 3))
	st := &Staged{s: s, Record: Record{ID: "late", Size: 4096, Mode: Pinned, Replicas: 1,
		Holders: []Holder{{Node: s.cfg.Node, Tier: Memory, Ref: c.ref}}}}
	// Committed by a putter elsewhere, as Commit does.
	if _, err := s.cli.Txn(testCtx(t)).Then(st.ops()...).Commit(); err != nil {
		t.Fatal(err)
	}
	now = now.Add(s.cfg.StageTimeout + time.Millisecond)
	s.checkUnnamed(testCtx(t), reconcileList(s, 1)) // the index lags: no record in it
	if st := s.LocalStats(); st.Copies != 1 || st.Staged != 0 {
		t.Fatalf("a copy committed late was dropped or left staged: %+v", st)
	}
	// The record is followed from then on: its deletion frees the copy.
	if _, err := s.cli.Delete(testCtx(t), ObjectKey(s.cfg.Prefix, "late")); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the copy freed with its record", func() error {
		if st := s.LocalStats(); st.Copies != 0 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// A result put by a node with a disk tier, onto holders that have none,
// gets one more copy on the putter's disk: it is durable before its job
// says succeeded.
func TestDurablePutAddsADiskCopy(t *testing.T) {
	c := newCluster(t, clusterConfig{nodes: 3, mem: 1 << 20, tune: func(cfg *Config) {
		if cfg.Node == "n0" {
			cfg.SpillDir, cfg.SpillCapacity = t.TempDir(), 1<<20
		}
	}})
	ctx := testCtx(t)
	// An id whose two rendezvous holders are not n0.
	var id string
	for i := 0; id == ""; i++ {
		cand := fmt.Sprintf("res-%d", i)
		if r := rank(c.members(), cand); r[0].Node != "n0" && r[1].Node != "n0" {
			id = cand
		}
	}
	rec, err := c.nodes[0].s.PutBytes(ctx, PutSpec{ID: id, Mode: Pinned}, pattern(5000, 8))
	if err != nil {
		t.Fatal(err)
	}
	disk := 0
	for _, h := range rec.Holders {
		if h.Tier == Disk {
			disk++
			if h.Node != "n0" {
				t.Errorf("disk copy on %s, which has no disk", h.Node)
			}
		}
	}
	if disk != 1 || len(rec.Holders) != 3 {
		t.Fatalf("holders %+v: want the two chosen in memory and one on n0's disk", rec.Holders)
	}
}
