package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// everyKey is a config file value for each agent option, none of them the
// default; $D is the test's directory.
var everyKey = map[string]string{
	"etcd-endpoints":            "[http://10.0.0.1:2379, http://10.0.0.2:2379]",
	"etcd-cert":                 "$D/etcd.crt",
	"etcd-key":                  "$D/etcd.key",
	"etcd-ca":                   "$D/etcd-ca.pem",
	"etcd-user":                 "agent",
	"etcd-password-file":        "$D/etcd-password",
	"roles":                     "[denoise, decode]",
	"slots":                     "{denoise: 2, decode: 3}",
	"prefix":                    "/latentmesh/test",
	"node-id":                   "gpu-7",
	"state-dir":                 "$D/state",
	"identity":                  "$D/id.key",
	"http":                      "0.0.0.0:18080",
	"admin":                     "127.0.0.1:19090",
	"admin-token":               "s3cret",
	"admin-token-file":          "$D/admin-token",
	"api-tokens":                "$D/api-tokens",
	"api-rate":                  "2.5",
	"tls-cert":                  "$D/tls.crt",
	"tls-key":                   "$D/tls.key",
	"p2p-listen":                "/ip4/0.0.0.0/tcp/4001",
	"data-listen":               "0.0.0.0:7000",
	"data-advertise":            "10.0.0.7:7000",
	"gossip-bind":               "0.0.0.0:7946",
	"gossip-advertise":          "10.0.0.7:7946",
	"gossip-keyring":            "$D/keyring.json",
	"lease-ttl":                 "15s",
	"transport":                 "tcp",
	"tcp-congestion":            "bbr",
	"arena-size":                "2GiB",
	"store-capacity":            "256MiB",
	"store-spill-dir":           "$D/spill",
	"store-spill-capacity":      "8GiB",
	"store-stage-timeout":       "90s",
	"transfer-mode":             "store",
	"result-ttl":                "2h",
	"checkpoint-every":          "5",
	"checkpoint-ttl":            "3h",
	"kv-cache-bytes":            "8MiB",
	"cond-cache-bytes":          "16MiB",
	"job-retention":             "48h",
	"engine-socket":             "/run/latentmesh/engine.sock",
	"engine-batch-window":       "40ms",
	"scheduler":                 "fifo",
	"preempt-after":             "3s",
	"no-backpressure":           "true",
	"no-push":                   "true",
	"no-offers":                 "true",
	"backpressure-slack":        "7",
	"backpressure-per-producer": "3",
	"drain-timeout":             "45s",
	"sim-cost":                  "{encode: 5ms, step: 20ms, decode: 50ms}",
	"log-format":                "console",
	"verbose":                   "true",
}

func writeFile(t *testing.T, path, data string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// load reads settings as `latentmesh agent args...` would, with environ.
func load(t *testing.T, args, environ []string) *agentSettings {
	t.Helper()
	var stderr bytes.Buffer
	s, code := loadAgentSettings("agent", args, environ, &stderr, nil)
	if code >= 0 {
		t.Fatalf("load %q: exit %d: %s", args, code, stderr.String())
	}
	return s
}

// settingsText is the settings as text: every field, the option table
// and bookkeeping left out and pointers (loggers, the memberlist config,
// clocks, which no option sets) blanked, to compare two loads.
func settingsText(s *agentSettings) string {
	c := *s
	c.opts, c.source, c.unknownEnv = nil, nil, nil
	return regexp.MustCompile(`0x[0-9a-f]+`).ReplaceAllString(fmt.Sprintf("%+v", c), "ptr")
}

// A file with every key loads to settings none of which is the default;
// `config print` writes them out and loading what it wrote gives the same
// settings again.
func TestConfigRoundTrip(t *testing.T) {
	def := newAgentSettings()
	var names []string
	for _, o := range def.opts {
		names = append(names, o.name)
	}
	var keys []string
	for k := range everyKey {
		keys = append(keys, k)
	}
	slices.Sort(names)
	slices.Sort(keys)
	if !slices.Equal(names, keys) {
		t.Fatalf("everyKey covers %v; the options are %v", keys, names)
	}

	dir := t.TempDir()
	var file strings.Builder
	for _, o := range def.opts { // the table's order, as an operator would write it
		file.WriteString(o.name + ": " + strings.ReplaceAll(everyKey[o.name], "$D", dir) + "\n")
	}
	first := writeFile(t, filepath.Join(dir, "agent.yaml"), file.String())
	a := load(t, []string{"--config", first}, nil)
	for _, o := range a.opts {
		d, _ := def.opts.lookup(o.name)
		if o.value.String() == d.value.String() {
			t.Errorf("%s: %q is the default: the file did not set it", o.name, o.value.String())
		}
		if a.source[o.name] != first {
			t.Errorf("%s: set by %q, want the file", o.name, a.source[o.name])
		}
	}
	if got := a.cfg.Slots; got[jobs.Denoise] != 2 || got[jobs.Decode] != 3 || got[jobs.Encode] != 4 {
		t.Errorf("slots %v: want denoise=2 decode=3 and encode at its default 4", got)
	}

	var out, errOut bytes.Buffer
	if code := runConfigPrint([]string{"--config", first, "--show-secrets"}, nil, &out, &errOut); code != 0 {
		t.Fatalf("config print: exit %d: %s", code, errOut.String())
	}
	printed := writeFile(t, filepath.Join(dir, "printed.yaml"), out.String())
	b := load(t, []string{"--config", printed}, nil)
	for _, o := range a.opts {
		ob, _ := b.opts.lookup(o.name)
		if o.value.String() != ob.value.String() {
			t.Errorf("%s: %q printed and loaded again is %q", o.name, o.value.String(), ob.value.String())
		}
	}
	if ta, tb := settingsText(a), settingsText(b); ta != tb {
		t.Fatalf("printed and loaded again, the settings differ:\nfirst  %s\nsecond %s\nprinted:\n%s", ta, tb, out.String())
	}
	if !strings.Contains(out.String(), "roles: [denoise, decode] # from "+first) {
		t.Errorf("config print does not say where roles came from:\n%s", out.String())
	}

	// Without --show-secrets the token is left out, and said to be.
	out.Reset()
	if code := runConfigPrint([]string{"--config", first}, nil, &out, &errOut); code != 0 {
		t.Fatalf("config print: exit %d: %s", code, errOut.String())
	}
	if strings.Contains(out.String(), "s3cret") || !strings.Contains(out.String(), "admin-token is set and not printed") {
		t.Fatalf("config print shows the admin token, or does not say it left it out:\n%s", out.String())
	}
}

// Defaults < file < LATENTMESH_* variables < flags.
func TestConfigPrecedence(t *testing.T) {
	dir := t.TempDir()
	file := writeFile(t, filepath.Join(dir, "agent.yaml"), "roles: [encode]\nprefix: /from-file\nlease-ttl: 20s\nslots: {encode: 2}\n")
	env := []string{
		"LATENTMESH_PREFIX=/from-env",
		"LATENTMESH_ROLES=decode",
		"LATENTMESH_NODE_ID=", // empty: unset
		"LATENTMESH_BACKPRESSURE_SLAK=3",
		"LATENTMESH_FLAGS=--v", // the systemd unit's, not an option
		"HOME=/root",
	}
	s := load(t, []string{"--config", file, "--roles", "denoise", "--slots", "denoise=2"}, env)
	if got := (rolesValue{&s.cfg.Roles}).String(); got != "denoise" {
		t.Errorf("roles %q: the flag should win over the variable and the file", got)
	}
	if s.cfg.Prefix != "/from-env" {
		t.Errorf("prefix %q: the variable should win over the file", s.cfg.Prefix)
	}
	if s.cfg.Gossip.LeaseTTL != 20*time.Second {
		t.Errorf("lease-ttl %v: the file should win over the default", s.cfg.Gossip.LeaseTTL)
	}
	if s.cfg.NodeID != "" || s.cfg.DrainTimeout != newAgentSettings().cfg.DrainTimeout {
		t.Errorf("node-id %q, drain-timeout %v: want the defaults", s.cfg.NodeID, s.cfg.DrainTimeout)
	}
	// Slots merge per stage: the file's encode, the flag's denoise, the default decode.
	if got := s.slots.String(); got != "encode=2,denoise=2,decode=2" {
		t.Errorf("slots %q", got)
	}
	wantSource := map[string]string{"roles": "--roles", "prefix": "LATENTMESH_PREFIX", "lease-ttl": file, "slots": "--slots"}
	for k, v := range wantSource {
		if s.source[k] != v {
			t.Errorf("%s set by %q, want %q", k, s.source[k], v)
		}
	}
	if !slices.Equal(s.unknownEnv, []string{"LATENTMESH_BACKPRESSURE_SLAK"}) {
		t.Errorf("unknown variables %v, want the misspelt one only", s.unknownEnv)
	}
	// LATENTMESH_CONFIG names the file when --config does not.
	s = load(t, nil, []string{"LATENTMESH_CONFIG=" + file})
	if s.cfg.Prefix != "/from-file" {
		t.Errorf("prefix %q through LATENTMESH_CONFIG", s.cfg.Prefix)
	}
}

// Bad files and values are errors that say where.
func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name, file string
		env        []string
		want       string
	}{
		{"unknown key", "roles: [decode]\n\netcd-endpoint: http://x:2379\n", nil, `agent.yaml:3: unknown key "etcd-endpoint"`},
		{"twice", "prefix: /a\nprefix: /b\n", nil, `agent.yaml:2: key "prefix" given twice (first on line 1)`},
		{"list for a scalar", "prefix: [a, b]\n", nil, "agent.yaml:1: prefix: want a single value, got a sequence"},
		{"bad value", "lease-ttl: soon\n", nil, `agent.yaml:1: lease-ttl: want a duration such as 30s or 2h, got "soon"`},
		{"bad role", "roles: [encode, paint]\n", nil, `agent.yaml:1: roles: agent: unknown role "paint"`},
		{"not a mapping", "- roles\n", nil, "agent.yaml:1: want a mapping of settings"},
		{"two documents", "prefix: /a\n---\nprefix: /b\n", nil, "one YAML document expected"},
		{"bad yaml", "prefix: [a\n", nil, "agent.yaml"},
		{"bad variable", "", []string{"LATENTMESH_NO_PUSH=maybe"}, `LATENTMESH_NO_PUSH: want true or false, got "maybe"`},
	}
	for _, tt := range tests {
		file := writeFile(t, filepath.Join(dir, "agent.yaml"), tt.file)
		var stderr bytes.Buffer
		_, code := loadAgentSettings("agent", []string{"--config", file}, tt.env, &stderr, nil)
		if code != 2 || !strings.Contains(stderr.String(), tt.want) {
			t.Errorf("%s: exit %d, %q; want exit 2 and %q", tt.name, code, stderr.String(), tt.want)
		}
	}
	// A named file must exist; the default path need not.
	var stderr bytes.Buffer
	if _, code := loadAgentSettings("agent", []string{"--config", filepath.Join(dir, "missing.yaml")}, nil, &stderr, nil); code != 2 || !strings.Contains(stderr.String(), "no such file") {
		t.Errorf("missing --config file: exit %d, %q", code, stderr.String())
	}
	if err := newAgentSettings().opts.loadFile(filepath.Join(dir, "missing.yaml"), false, func(string) {}); err != nil {
		t.Errorf("a missing default file: %v, want none", err)
	}
	if err := newAgentSettings().opts.loadFile(writeFile(t, filepath.Join(dir, "empty.yaml"), "# nothing yet\n"), true, func(string) {}); err != nil {
		t.Errorf("a file of comments: %v", err)
	}
}

// A secret comes from its file, first line trimmed; given both ways it is
// an error. Advertise addresses are checked.
func TestConfigSecretsAndAdvertise(t *testing.T) {
	dir := t.TempDir()
	tokenFile := writeFile(t, filepath.Join(dir, "admin-token"), "  t0ken-from-file \nsecond line\n")
	log := zaptest.NewLogger(t)
	s := load(t, []string{"--admin-token-file", tokenFile, "--state-dir", ""}, nil)
	cfg, _, certs, err := s.build(log)
	if err != nil || cfg.AdminToken != "t0ken-from-file" || certs != nil || cfg.TLS != nil {
		t.Fatalf("admin-token-file: %q, %v (TLS %v)", cfg.AdminToken, err, cfg.TLS)
	}
	s = load(t, []string{"--admin-token-file", tokenFile, "--state-dir", ""}, []string{"LATENTMESH_ADMIN_TOKEN=inline"})
	if _, _, _, err := s.build(log); err == nil || !strings.Contains(err.Error(), "--admin-token and --admin-token-file both given") {
		t.Fatalf("both ways: %v", err)
	}
	empty := writeFile(t, filepath.Join(dir, "empty"), "\n")
	s = load(t, []string{"--admin-token-file", empty, "--state-dir", ""}, nil)
	if _, _, _, err := s.build(log); err == nil || !strings.Contains(err.Error(), "empty first line") {
		t.Fatalf("empty token file: %v", err)
	}

	bad := []struct {
		args []string
		want string
	}{
		{[]string{"--gossip-advertise", "gpu-7:7946"}, `--gossip-advertise "gpu-7:7946": want ip:port`},
		{[]string{"--gossip-advertise", "0.0.0.0:7946"}, "--gossip-advertise"},
		{[]string{"--gossip-advertise", "10.0.0.7"}, "--gossip-advertise"},
		{[]string{"--data-advertise", "10.0.0.7:0"}, `--data-advertise "10.0.0.7:0": want host:port`},
		{[]string{"--data-advertise", "[::]:7000"}, "--data-advertise"},
		{[]string{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key go together"},
		{[]string{"--tls-cert", filepath.Join(dir, "none.crt"), "--tls-key", filepath.Join(dir, "none.key")}, "no such file"},
	}
	for _, tt := range bad {
		s := load(t, append(tt.args, "--state-dir", ""), nil)
		if _, _, _, err := s.build(log); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: %v, want %q", tt.args, err, tt.want)
		}
	}
	s = load(t, []string{"--gossip-advertise", "10.0.0.7:0", "--data-advertise", "gpu-7.example:7000", "--state-dir", ""}, nil)
	cfg, _, _, err = s.build(log)
	if err != nil || cfg.Gossip.GossipAdvertise != "10.0.0.7:0" || cfg.Transfer.DataAdvertise != "gpu-7.example:7000" {
		t.Fatalf("advertise: %v %q %q", err, cfg.Gossip.GossipAdvertise, cfg.Transfer.DataAdvertise)
	}
}

// docs/config.md is what `config docs` writes.
func TestConfigDocsCurrent(t *testing.T) {
	var b bytes.Buffer
	writeConfigDocs(&b)
	have, err := os.ReadFile("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(have, b.Bytes()) {
		t.Fatal("docs/config.md is stale: run 'go generate ./cmd/latentmesh'")
	}
	for _, o := range newAgentSettings().opts {
		if !strings.Contains(b.String(), "| `"+o.name+"`") || !strings.Contains(b.String(), envName(o.name)) {
			t.Errorf("docs/config.md lacks %s", o.name)
		}
	}
}
