package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

func runCmd(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string // in stderr
	}{
		{nil, 2, "usage: latentmesh"},
		{[]string{"paint"}, 2, `unknown command "paint"`},
		{[]string{"agent", "--roles", "paint"}, 2, `unknown role "paint"`},
		{[]string{"agent", "--slots", "encode=0"}, 2, "not in [1,1024]"},
		{[]string{"agent", "--sim-cost", "step=fast"}, 2, "bad duration"},
		{[]string{"agent", "--arena-size", "lots"}, 2, "--arena-size"},
		{[]string{"agent", "--gossip-keyring", "/nonexistent/keyring.json"}, 2, "--gossip-keyring"},
		{[]string{"agent", "--api-tokens", "/nonexistent"}, 2, "--api-tokens"},
		{[]string{"agent", "--api-rate", "-1"}, 2, "--api-rate must not be negative"},
		{[]string{"agent", "--etcd-user", "agent"}, 2, "--etcd-user needs --etcd-password-file"},
		{[]string{"agent", "--etcd-password-file", "/nonexistent"}, 2, "--etcd-password-file needs --etcd-user"},
		{[]string{"agent", "--etcd-user", "agent", "--etcd-password-file", "/nonexistent"}, 2, "no such file"},
		{[]string{"agent", "--etcd-cert", "/nonexistent.crt"}, 1, "needs both a cert and a key file"},
		{[]string{"agent", "--etcd-ca", "/nonexistent.crt"}, 1, "etcd CA"},
		{[]string{"agent", "--etcd-cert", "c", "--etcd-key", "k", "--etcd-endpoints", "http://127.0.0.1:1"}, 1, "etcd client certificate"},
	}
	for _, tt := range tests {
		code, _, stderr := runCmd(tt.args...)
		if code != tt.code || !strings.Contains(stderr, tt.want) {
			t.Errorf("%q: exit %d, stderr %q; want exit %d and %q", tt.args, code, stderr, tt.code, tt.want)
		}
	}
}

func TestVersionAndHelp(t *testing.T) {
	for _, arg := range []string{"version", "--version"} {
		if code, out, _ := runCmd(arg); code != 0 || !strings.Contains(out, agent.Version) {
			t.Fatalf("%s: %d %q", arg, code, out)
		}
	}
	if code, out, _ := runCmd("help"); code != 0 || !strings.Contains(out, "generate") || !strings.Contains(out, "latentmesh-dev") {
		t.Fatalf("help: %d %q", code, out)
	}
}

func TestStatus(t *testing.T) {
	st := agent.Status{
		Queues: map[jobs.Stage]agent.QueueInfo{jobs.Decode: {Queued: 3, Running: 1}},
		Peers:  []agent.PeerStatus{{ID: "dec-7", Roles: []string{"decode"}, Alive: true, Free: map[string]uint32{"decode": 2}}},
	}
	st.Node.ID = "enc-1"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/admin/status" || r.Header.Get("Authorization") != "Bearer s3cret" {
			http.Error(w, `{"error":{"message":"unauthorized"}}`, http.StatusUnauthorized)
			return
		}
		json.NewEncoder(w).Encode(st)
	}))
	defer srv.Close()
	code, out, errOut := runCmd("status", "--admin", srv.URL, "--token", "s3cret")
	if code != 0 || !strings.Contains(out, "node enc-1") || !strings.Contains(out, "decode=2") || !strings.Contains(out, "dec-7") {
		t.Fatalf("status: %d\n%s%s", code, out, errOut)
	}
	if code, _, errOut := runCmd("status", "--admin", srv.URL); code != 1 || !strings.Contains(errOut, "401") {
		t.Fatalf("status without token: %d %q", code, errOut)
	}
}

func TestReadPassword(t *testing.T) {
	f := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(f, []byte("s3cret\r\nignored\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if pw, err := readPassword("agent", f); err != nil || pw != "s3cret" {
		t.Fatalf("%q %v", pw, err)
	}
	os.WriteFile(f, []byte("\n"), 0o600)
	if _, err := readPassword("agent", f); err == nil {
		t.Fatal("empty password accepted")
	}
}
