package attack

import (
	"bytes"
	"compress/lzw"
	"go/parser"
	"go/token"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
)

func TestFramesAsFiled(t *testing.T) {
	// The sizes the issue reports, unlabeled.
	if n := len(PushPullHeader(-1)); n != 29 {
		t.Errorf("push/pull header is %d bytes, want 29", n)
	}
	if n := len(UserMsgHeader(1 << 40)); n != 22 {
		t.Errorf("user message header is %d bytes, want 22", n)
	}
	if n := len(Compressed(LZWZeros(37))); n < 190_000 || n > 210_000 {
		t.Errorf("lzw bomb is %d bytes, want about 198 KB", n)
	}
}

func TestLZWZerosDecodes(t *testing.T) {
	r := lzw.NewReader(bytes.NewReader(LZWZeros(2)), lzw.LSB, 8)
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	const perCycle = 7370880 // 1 + 2 + 3 + ... + 3839
	if len(b) != 2*perCycle || bytes.IndexFunc(b, func(r rune) bool { return r != 0 }) >= 0 {
		t.Fatalf("decoded %d bytes, want %d zeros", len(b), 2*perCycle)
	}
}

// gossip's tests import this package; it must stay below gossip.
func TestNoLatentmeshImports(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); strings.HasPrefix(path, "github.com/latentmesh/latentmesh/") {
				t.Errorf("%s imports %s", name, path)
			}
		}
	}
}

type msgs chan []byte

func (m msgs) NotifyMsg(b []byte)            { m <- append([]byte(nil), b...) }
func (msgs) NodeMeta(int) []byte             { return nil }
func (msgs) GetBroadcasts(int, int) [][]byte { return nil }
func (msgs) LocalState(bool) []byte          { return nil }
func (msgs) MergeRemoteState([]byte, bool)   {}

// A memberlist node holding the key decrypts what EncryptedStream and
// EncryptedPacket make: a user message by stream reaches its delegate, an
// alive message by packet puts a node in its list.
func TestEncryptedFramesDecrypt(t *testing.T) {
	key := bytes.Repeat([]byte{7}, 32)
	const label = "/latentmesh/attack-test"
	got := make(msgs, 1)
	cfg := memberlist.DefaultLocalConfig()
	cfg.Name, cfg.BindAddr, cfg.BindPort, cfg.AdvertisePort = "target", "127.0.0.1", 0, 0
	cfg.Label, cfg.SecretKey, cfg.Delegate = label, key, got
	cfg.LogOutput = io.Discard
	ml, err := memberlist.Create(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ml.Shutdown()
	addr := net.JoinHostPort(ml.LocalNode().Addr.String(), strconv.Itoa(int(ml.LocalNode().Port)))

	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c.Write(EncryptedStream(key, label, append(UserMsgHeader(5), "hello"...)))
	c.Close()
	select {
	case b := <-got:
		if string(b) != "hello" {
			t.Fatalf("delegate got %q", b)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the encrypted user message did not arrive")
	}

	u, err := net.Dial("udp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	self := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
	deadline := time.Now().Add(10 * time.Second)
	for ml.NumMembers() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the encrypted alive message was not taken")
		}
		u.Write(EncryptedPacket(key, label, AliveMsg("x", self, 1, nil)))
		time.Sleep(50 * time.Millisecond)
	}
}
