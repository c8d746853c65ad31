package testbed

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// A mesh with every secret an operator is told to set works end to end:
// etcd with client TLS, client-certificate auth and users, gossip
// encryption, API tokens. A node with the wrong gossip key, or with an etcd
// certificate the CA did not sign, is refused and a log line says why.
func TestSecuredMeshEndToEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sec := startSecuredEtcd(t, ctx, "/latentmesh/default")
	cli, err := sec.agent.New(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := newMesh(t)
	m.endpoint, m.cli = sec.Endpoints()[0], cli

	dir := t.TempDir()
	pwFile, tokFile := filepath.Join(dir, "etcd-password"), filepath.Join(dir, "api-tokens")
	const alice, bob, admin = "alice-token-0123456789", "bob-token-0123456789ab", "admin-token-0123456789"
	for file, content := range map[string]string{
		pwFile:  sec.password + "\n",
		tokFile: alice + "\n" + bob + "\nadmin:" + admin + "\n",
	} {
		if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	etcdFlags := func(cert, key, ca string) []string {
		return []string{"--etcd-cert", cert, "--etcd-key", key, "--etcd-ca", ca,
			"--etcd-user", "agent", "--etcd-password-file", pwFile}
	}
	m.args = append(etcdFlags(sec.clientCert, sec.clientKey, sec.ca.file), "--api-tokens", tokFile, "--arena-size", "64MiB")

	_, enc := m.agent("enc-s", "encode")
	_, den := m.agent("den-s", "denoise")
	_, dec := m.agent("dec-s", "decode")
	recs := []string{enc.ID, den.ID, dec.ID}
	for _, r := range []string{enc.AdminAddr, den.AdminAddr, dec.AdminAddr} {
		eventually(t, 30*time.Second, func() error { return peersAlive(ctx, r, admin, recs) })
	}

	// A job with a token: the engine's bytes.
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr, Token: alice}
	spec := engine.Spec{Prompt: "behind every lock", Seed: 3, Width: 64, Height: 64, Steps: 3}.WithDefaults()
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: spec.Prompt, Seed: ptr(spec.Seed), Width: ptr(64), Height: ptr(64), Steps: ptr(3)})
	if err != nil {
		t.Fatal(err)
	}
	done, err := c.Wait(ctx, job.ID, time.Minute)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v, %v", done, err)
	}
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, spec)) {
		t.Fatal("result differs from the engine's")
	}
	// Without a token: 401. With another client's token: 404, as for a job
	// that does not exist. With an admin token: the job.
	for _, tc := range []struct {
		token string
		want  int
	}{{"", http.StatusUnauthorized}, {"not-a-token-at-all-000", http.StatusUnauthorized}, {bob, http.StatusNotFound}, {admin, http.StatusOK}} {
		for _, path := range []string{"/v1/jobs/" + job.ID, "/v1/jobs/" + job.ID + "/result"} {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+dec.HTTPAddr+path, nil)
			if tc.token != "" {
				req.Header.Set("Authorization", "Bearer "+tc.token)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("GET %s with token %q: %d, want %d", path, tc.token, resp.StatusCode, tc.want)
			}
		}
	}
	if _, err := (&httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}).Submit(ctx, httpapi.JobRequest{Prompt: "no token"}); err == nil {
		t.Error("a job submitted without a token was accepted")
	}

	// The wrong gossip key: the agent registers (its etcd credentials are
	// good) but no one gossips with it, and both sides say why.
	wrong, _ := m.agent("wrongkey-s", "decode", "--gossip-keyring", writeGossipKeyring(t))
	line, err := wrong.WaitFor(ctx, regexp.MustCompile(`.*gossip join refused.*wrong gossip key.*`))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("wrong-key agent: %s", line)
	refused := regexp.MustCompile(`.*gossip message refused.*wrong gossip key.*`)
	eventually(t, 30*time.Second, func() error {
		for _, p := range m.procs {
			if line := refused.FindString(p.Output()); p.Name != "wrongkey-s" && line != "" {
				t.Logf("%s: %s", p.Name, line)
				return nil
			}
		}
		return errorf("no agent logged refusing the wrong key's messages")
	})
	for _, r := range []string{enc.AdminAddr, den.AdminAddr, dec.AdminAddr} {
		st, err := adminStatusAs(ctx, r, admin)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range st.Peers {
			if p.ID == "wrongkey-s" && p.Alive {
				t.Errorf("%s sees the wrong-key agent alive", st.Node.ID)
			}
		}
	}

	// An etcd certificate from another CA, and a CA that did not sign
	// etcd's: the agent exits non-zero naming the TLS failure.
	for _, tc := range []struct {
		name  string
		flags []string
		want  string
	}{
		{"rogue-cert", etcdFlags(sec.rogueCert, sec.rogueKey, sec.ca.file), "refused this client's certificate"},
		{"rogue-ca", etcdFlags(sec.clientCert, sec.clientKey, sec.rogue.file), "its certificate is not trusted"},
	} {
		p, err := StartProcess(tc.name, binary, nil, append([]string{"agent", "--etcd-endpoints", m.endpoint,
			"--roles", "encode", "--node-id", tc.name, "--http", "127.0.0.1:0", "--admin", "127.0.0.1:0",
			"--gossip-keyring", m.keyring, "--log-format", "console", "--state-dir", ""}, tc.flags...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Stop(10 * time.Second) }) // it exits by itself; not one of the mesh's
		select {
		case <-p.done:
		case <-ctx.Done():
			t.Fatalf("%s: still running; output:\n%s", tc.name, p.Output())
		}
		if _, err := p.Exited(); err == nil || !strings.Contains(p.Output(), tc.want) {
			t.Errorf("%s: exit %v, output:\n%s\nwant %q", tc.name, err, p.Output(), tc.want)
		}
		t.Logf("%s: %v: %s", tc.name, p.err, strings.TrimSpace(p.Output()))
	}
}
