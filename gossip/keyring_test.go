package gossip

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/testbed/attack"
)

func newKey(t *testing.T) []byte {
	t.Helper()
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		t.Fatal(err)
	}
	return k
}

// writeKeyring replaces the keyring file at path the way an orchestrator
// updates a mounted secret: a new file renamed over the old.
func writeKeyring(t *testing.T, path string, keys ...[]byte) {
	t.Helper()
	list := make([]string, len(keys))
	for i, k := range keys {
		list[i] = base64.StdEncoding.EncodeToString(k)
	}
	b, err := json.Marshal(list)
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestParseKeyring(t *testing.T) {
	k16 := base64.StdEncoding.EncodeToString(make([]byte, 16))
	k32 := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{1}, 32))
	for _, tc := range []struct {
		file string
		keys int // 0: invalid
	}{
		{`["` + k32 + `"]`, 1},
		{`["` + k32 + `", "` + k16 + `"]`, 2},
		{``, 0},
		{`[]`, 0},
		{`"` + k32 + `"`, 0},
		{`{"keys": ["` + k32 + `"]}`, 0},
		{`["not base64!"]`, 0},
		{`["` + base64.StdEncoding.EncodeToString(make([]byte, 20)) + `"]`, 0},
		{`["` + k32 + `", "` + k32 + `"]`, 0},
	} {
		keys, err := parseKeyring([]byte(tc.file))
		switch {
		case tc.keys == 0 && !errors.Is(err, ErrInvalidKeyring):
			t.Errorf("%.40q: err %v, want ErrInvalidKeyring", tc.file, err)
		case tc.keys > 0 && (err != nil || len(keys) != tc.keys):
			t.Errorf("%.40q: %d keys, %v; want %d", tc.file, len(keys), err, tc.keys)
		}
	}
	if _, _, err := readKeyring(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, ErrInvalidKeyring) {
		t.Errorf("missing file: %v", err)
	}
}

func TestInstallKeys(t *testing.T) {
	k1, k2, k3 := newKey(t), newKey(t), newKey(t)
	kr, err := memberlist.NewKeyring(nil, k1)
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range [][][]byte{
		{k1, k2},     // add k2
		{k2, k1},     // make it primary
		{k2},         // drop k1
		{k3, k2},     // add and use at once
		{k1, k3, k2}, // reorder with a new primary
		{k1},         // drop two
	} {
		if err := installKeys(kr, step); err != nil {
			t.Fatal(err)
		}
		got := kr.GetKeys()
		if !bytes.Equal(got[0], step[0]) || len(got) != len(step) {
			t.Fatalf("installed %d keys with primary %s, want %d with %s",
				len(got), fingerprint(got[0]), len(step), fingerprint(step[0]))
		}
		for _, k := range step {
			if !slices.ContainsFunc(got, func(g []byte) bool { return bytes.Equal(g, k) }) {
				t.Fatalf("key %s missing", fingerprint(k))
			}
		}
	}
}

// outsider is a bare memberlist node, not registered in etcd, that tries to
// join addr with the given keys and label.
func outsider(t *testing.T, name, label, addr string, keys ...[]byte) (joined int, err error) {
	t.Helper()
	mc := DefaultLocalConfig().Memberlist
	mc.Name = name
	mc.BindAddr, mc.BindPort = "127.0.0.1", 0
	mc.Label = label
	mc.LogOutput = io.Discard
	if len(keys) > 0 {
		kr, err := memberlist.NewKeyring(keys[1:], keys[0])
		if err != nil {
			t.Fatal(err)
		}
		mc.Keyring, mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = kr, true, true
	}
	ml, err := memberlist.Create(mc)
	if err != nil {
		t.Fatal(err)
	}
	defer ml.Shutdown()
	return ml.Join([]string{addr})
}

// TestKeyringKeepsOutsiders: with a keyring, nodes without the mesh's key
// and label cannot join, and forged clear-text alive and dead messages
// about a member change nothing. Without a keyring both worked: an
// unregistered memberlist node joined, and an alive message at incarnation
// 2^32-1 with forged meta, or a dead message at it, stuck, because the
// member's refutation wraps to 0.
func TestKeyringKeepsOutsiders(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	key := newKey(t)
	file := filepath.Join(t.TempDir(), "keyring.json")
	writeKeyring(t, file, key)
	core, logs := observer.New(zap.InfoLevel)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, func(c *Config) {
		c.KeyringFile = file
		c.Logger = zap.New(core)
		// The test counts memberlist's refusals line by line; the outsiders'
		// join attempts before the forged messages must not use up the
		// limit (TestLogLimiter and TestLogBridgeBoundsLines test the limit).
		c.LogLimit = 1 << 20
	})
	b := startNode(t, cli, prefix, "b", []string{RoleDecode}, func(c *Config) { c.KeyringFile = file })
	eventually(t, 10*time.Second, func() error { return checkView(a, "a", "b") })
	addr := a.Self().Record.GossipAddr

	for _, tc := range []struct {
		name, label string
		keys        [][]byte
	}{
		{"no key", prefix, nil},
		{"another key", prefix, [][]byte{newKey(t)}},
		{"another label", "/other-mesh", [][]byte{key}},
	} {
		n, err := outsider(t, "outsider", tc.label, addr, tc.keys...)
		if err == nil || n != 0 {
			t.Errorf("outsider with %s joined %d nodes (err %v)", tc.name, n, err)
		}
	}
	if p, ok := a.Peer("outsider"); ok {
		t.Errorf("a knows the outsider: %+v", p)
	}

	events, unsubscribe := a.Subscribe()
	defer unsubscribe()
	bAddr, err := net.ResolveUDPAddr("udp", b.Self().Record.GossipAddr)
	if err != nil {
		t.Fatal(err)
	}
	forged, err := EncodeMeta(NodeMeta{Version: MetaVersion, Roles: []string{RoleDecode}, Free: StageCredits{Decode: 9999}})
	if err != nil {
		t.Fatal(err)
	}
	// Labeled like the mesh's own packets: the label is no secret.
	sendPacket(t, addr, attack.Labeled(prefix, attack.AliveMsg("b", bAddr, 1<<32-1, forged)))
	sendPacket(t, addr, attack.Labeled(prefix, attack.DeadMsg("b", "a", 1<<32-1)))
	sendStream(t, addr, attack.Labeled(prefix, append(attack.PushPullHeader(1),
		attack.MP{}.Fixmap(3).Str("Name").Str("b").Str("Incarnation").Uint32(1<<32-1).Str("State").Int(2)...)))
	// memberlist saw and dropped all three.
	eventually(t, 5*time.Second, func() error {
		refused := logs.FilterMessage("gossip message refused")
		packets := refused.Filter(func(e observer.LoggedEntry) bool {
			return strings.Contains(e.ContextMap()["memberlist"].(string), "Decrypt packet failed")
		}).Len()
		streams := refused.Filter(func(e observer.LoggedEntry) bool {
			return e.ContextMap()["reason"] == "not encrypted, and this node's gossip is"
		}).Len()
		if packets < 2 || streams < 1 {
			return fmt.Errorf("memberlist logged %d dropped packets and %d dropped streams", packets, streams)
		}
		return nil
	})
	// A real change from b still arrives, and nothing forged came before it.
	if err := b.UpdateMeta(NodeMeta{Roles: []string{RoleDecode}, Free: StageCredits{Decode: 2}}); err != nil {
		t.Fatal(err)
	}
	for {
		ev := waitEvent(t, events, EventUpdated, "b", 5*time.Second)
		if ev.Peer.Meta.Free.Decode == 2 {
			break
		}
		if ev.Peer.Meta.Free.Decode == 9999 {
			t.Fatal("a took the forged meta")
		}
	}
	for len(events) > 0 {
		if ev := <-events; ev.Peer.Record.ID == "b" && (ev.Type == EventDead || ev.Type == EventSuspect) {
			t.Fatalf("a saw b %v", ev.Type)
		}
	}
	if err := checkView(a, "a", "b"); err != nil {
		t.Fatal(err)
	}
}

// TestKeyringRotation rotates the mesh's key without a restart, one node's
// file at a time, the way an operator would: add the new key, make it
// primary, drop the old one. Gossip keeps flowing at every step, and at the
// end the old key no longer gets anyone in.
func TestKeyringRotation(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	dir := t.TempDir()
	oldKey, nextKey := newKey(t), newKey(t)
	files := map[string]string{"a": filepath.Join(dir, "a.json"), "b": filepath.Join(dir, "b.json")}
	nodes := map[string]*Membership{}
	for _, id := range []string{"a", "b"} {
		writeKeyring(t, files[id], oldKey)
		nodes[id] = startNode(t, cli, prefix, id, nil, func(c *Config) { c.KeyringFile = files[id] })
	}
	a, b := nodes["a"], nodes["b"]
	eventually(t, 10*time.Second, func() error { return checkView(a, "a", "b") })

	credits := uint32(0)
	gossipFlows := func(step string) {
		t.Helper()
		credits++
		for _, m := range []*Membership{a, b} {
			if err := m.UpdateMeta(NodeMeta{Free: StageCredits{Encode: credits}}); err != nil {
				t.Fatal(err)
			}
		}
		eventually(t, 5*time.Second, func() error {
			pa, _ := b.Peer("a")
			pb, _ := a.Peer("b")
			if pa.Meta.Free.Encode != credits || pb.Meta.Free.Encode != credits {
				return fmt.Errorf("%s: b sees a's credits %d, a sees b's %d, want %d",
					step, pa.Meta.Free.Encode, pb.Meta.Free.Encode, credits)
			}
			return nil
		})
	}
	installed := func(m *Membership, keys ...[]byte) {
		t.Helper()
		eventually(t, 5*time.Second, func() error {
			got := m.keyring.GetKeys()
			if len(got) != len(keys) || !bytes.Equal(got[0], keys[0]) {
				return fmt.Errorf("%s holds %d keys, primary %s", m.Self().Record.ID, len(got), fingerprint(got[0]))
			}
			return nil
		})
	}

	for _, step := range []struct {
		name string
		keys [][]byte
	}{
		{"new key added", [][]byte{oldKey, nextKey}},
		{"new key primary", [][]byte{nextKey, oldKey}},
		{"old key dropped", [][]byte{nextKey}},
	} {
		for _, id := range []string{"a", "b"} {
			writeKeyring(t, files[id], step.keys...)
			installed(nodes[id], step.keys...)
			gossipFlows(step.name + " on " + id)
		}
	}

	// A broken file is reported and changes nothing.
	if err := os.WriteFile(files["a"], []byte(`["half a key`), 0o600); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * a.cfg.KeyringCheck)
	installed(a, nextKey)
	gossipFlows("broken file on a")

	if n, err := outsider(t, "old-key", prefix, a.Self().Record.GossipAddr, oldKey); err == nil {
		t.Fatalf("a node with the retired key joined %d", n)
	}
	if n, err := outsider(t, "new-key", prefix, a.Self().Record.GossipAddr, nextKey); err != nil || n != 1 {
		// It reaches memberlist, which is all the key decides; not being
		// registered in etcd, it is not admitted as a member.
		t.Fatalf("a node with the current key could not reach a: %d, %v", n, err)
	}
	if p, ok := a.Peer("new-key"); ok && p.Alive {
		t.Fatal("an unregistered node became a member")
	}
}
