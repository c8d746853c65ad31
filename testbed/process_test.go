package testbed

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/gossip"
)

// binary is cmd/latentmesh, built once for the multi-process tests, and
// devBinary cmd/latentmesh-dev beside it (dev, bench producer).
var binary, devBinary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "latentmesh-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Generous: in CI this build runs beside the race builds and tests of
	// every other package, on two cores.
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	binary, err = BuildBinary(ctx, dir)
	devBinary = DevBinary(binary)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// eventually retries cond until it returns nil or timeout passes.
func eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	backoff := 20 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not true after %v: %v", timeout, err)
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// mesh is `latentmesh-dev dev --agents 0` (or an external etcd) plus agent
// processes.
type mesh struct {
	t        *testing.T
	endpoint string
	cli      *clientv3.Client
	procs    []*Process
	keyring  string   // gossip keyring file every agent gets, as in a deployment
	args     []string // more flags every agent gets (etcd credentials, tokens)
	state    string   // each agent's --state-dir is <state>/<node id>: a restart keeps it
}

func startMesh(t *testing.T) *mesh { return startMeshAt(t, "127.0.0.1") }

// startMeshAt runs etcd listening on ip.
func startMeshAt(t *testing.T, ip string) *mesh {
	t.Helper()
	return startMeshListen(t, ip+":0")
}

// startMeshListen runs etcd listening on addr (host:port).
func startMeshListen(t *testing.T, addr string) *mesh {
	t.Helper()
	dev, err := StartProcess("dev", devBinary, nil, "dev", "--agents", "0", "--etcd-listen", addr)
	if err != nil {
		t.Fatal(err)
	}
	m := newMesh(t, dev)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if m.endpoint, err = dev.WaitFor(ctx, regexp.MustCompile(`etcd endpoint: (\S+)`)); err != nil {
		t.Fatal(err)
	}
	if m.cli, err = NewEtcdClient([]string{m.endpoint}, nil); err != nil {
		t.Fatal(err)
	}
	return m
}

// newMesh is a mesh of procs (those already running) with a fresh gossip
// key; the caller sets endpoint and cli.
func newMesh(t *testing.T, procs ...*Process) *mesh {
	t.Helper()
	m := &mesh{t: t, procs: procs, keyring: writeGossipKeyring(t), state: t.TempDir()}
	t.Cleanup(m.stop)
	return m
}

// writeGossipKeyring writes a keyring file holding one fresh key.
func writeGossipKeyring(t *testing.T) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "gossip-keyring.json")
	key := make([]byte, 32)
	rand.Read(key)
	if err := os.WriteFile(file, fmt.Appendf(nil, "[%q]", base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

func (m *mesh) stop() {
	for i := len(m.procs) - 1; i >= 0; i-- {
		if err := m.procs[i].Stop(10 * time.Second); err != nil {
			m.t.Logf("%s: %v; output:\n%s", m.procs[i].Name, err, m.procs[i].Output())
		}
	}
	if m.cli != nil {
		m.cli.Close()
	}
}

// outputs is every process's output, for a failure message.
func (m *mesh) outputs() string {
	var b bytes.Buffer
	for _, p := range m.procs {
		fmt.Fprintf(&b, "--- %s ---\n%s\n", p.Name, p.Output())
	}
	return b.String()
}

// meshAdminToken guards the admin endpoints of agents on a Net's hosts.
const meshAdminToken = "testbed-admin-token-0123456789"

// agent starts `latentmesh agent` with one role and waits for its record.
func (m *mesh) agent(id, role string, extra ...string) (*Process, gossip.NodeRecord) {
	m.t.Helper()
	return m.agentOn(nil, id, role, extra...)
}

// agentOn is agent on host h of a Net, listening on h's address; nil h is
// this machine's loopback.
func (m *mesh) agentOn(h *Host, id, role string, extra ...string) (*Process, gossip.NodeRecord) {
	m.t.Helper()
	ip := "127.0.0.1"
	if h != nil {
		ip = h.IP
	}
	if m.state == "" {
		m.t.Fatal("mesh without a state directory: build it with newMesh") // else agents would write beside the tests
	}
	args := append([]string{binary, "agent", "--etcd-endpoints", m.endpoint, "--roles", role, "--node-id", id,
		"--http", ip + ":0", "--admin", ip + ":0", "--lease-ttl", "2s", "--log-format", "console",
		"--gossip-keyring", m.keyring, "--state-dir", filepath.Join(m.state, id)}, append(append([]string(nil), m.args...), extra...)...)
	if h != nil {
		args = append(args, "--p2p-listen", "/ip4/"+ip+"/tcp/0", "--data-listen", ip+":0", "--gossip-bind", ip+":0",
			"--admin-token", meshAdminToken) // an admin endpoint beyond loopback needs one
	}
	cmd := exec.Command(args[0], args[1:]...)
	if h != nil {
		cmd = h.Command(args...)
	}
	p, err := StartCommand(id, cmd, nil)
	if err != nil {
		m.t.Fatal(err)
	}
	m.procs = append(m.procs, p)
	var rec gossip.NodeRecord
	eventually(m.t, 30*time.Second, func() error {
		resp, err := m.cli.Get(context.Background(), "/latentmesh/default/nodes/"+id)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return fmt.Errorf("%s not registered; output:\n%s", id, p.Output())
		}
		return json.Unmarshal(resp.Kvs[0].Value, &rec)
	})
	return p, rec
}

// A mesh of separate processes serves `latentmesh generate`, and the file is
// the same one the in-process engine makes for that request.
func TestProcessMeshServesGenerate(t *testing.T) {
	m := startMesh(t)
	_, enc := m.agent("enc-p", "encode")
	m.agent("den-p", "denoise")
	m.agent("dec-p", "decode")

	out := filepath.Join(t.TempDir(), "fox.png")
	cmd := exec.Command(binary, "generate", "--server", "http://"+enc.HTTPAddr, "--prompt", "a red fox",
		"--seed", "42", "--size", "128x96", "--steps", "8", "-o", out)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("generate: %v\n%s", err, b)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	spec := engine.Spec{Prompt: "a red fox", Seed: 42, Width: 128, Height: 96, Steps: 8}.WithDefaults()
	checkImage(t, got, spec)
	if want := referenceOutput(t, spec); !bytes.Equal(got, want) {
		t.Fatal("mesh output differs from the engine run in one process")
	}

	// A bad request gets a clear error and a non-zero exit.
	cmd = exec.Command(binary, "generate", "--server", "http://"+enc.HTTPAddr, "--prompt", "x", "--size", "7x7", "-o", out)
	if b, err := cmd.CombinedOutput(); err == nil || !bytes.Contains(b, []byte("width")) {
		t.Fatalf("bad size: err=%v output=%s", err, b)
	}
}

// referenceOutput runs the three stages directly on one engine.
func referenceOutput(t *testing.T, s engine.Spec) []byte {
	t.Helper()
	e, err := engine.New(engine.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := e.Generate(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// kill -9 of the decode agent while it runs a task: once its lease expires
// another decode agent takes the task, and the job completes with exactly one
// committed result.
func TestKillDecodeAgentMidTask(t *testing.T) {
	m := startMesh(t)
	_, enc := m.agent("enc-k", "encode")
	m.agent("den-k", "denoise")
	// The first decode agent takes a minute per decode: it will be killed mid-task.
	slow, _ := m.agent("dec-slow", "decode", "--sim-cost", "decode=60s")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	w, h, steps := 96, 64, 6
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a lighthouse", Width: &w, Height: &h, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool { return p.Stage == jobs.Decode && p.Node == "dec-slow" })
	slow.Kill()
	m.agent("dec-new", "decode")

	m.waitRedecoded(ctx, c, job.ID, "dec-new")
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	checkImage(t, data, engine.Spec{Prompt: "a lighthouse", Width: w, Height: h, Frames: 1})
	// No payload record leaked: the latent was released by the commit.
	left, err := m.cli.Get(ctx, "/latentmesh/default/payloads/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if left.Count != 0 {
		t.Fatalf("%d payload records left after the job", left.Count)
	}
}

// waitSucceededAt waits up to a minute, through the client API, for job
// id to end, and fails the test unless it succeeded.
func waitSucceededAt(t *testing.T, ctx context.Context, c *httpapi.Client, id string) jobs.Job {
	t.Helper()
	var done jobs.Job
	eventually(t, 60*time.Second, func() error {
		var err error
		if done, err = c.Get(ctx, id); err != nil {
			return err
		}
		if !done.State.Terminal() {
			return fmt.Errorf("job %s still %s", id, done.State)
		}
		return nil
	})
	if done.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", done.State, done.Error)
	}
	return done
}

// waitRedecoded waits for job id to end, and checks that it succeeded with
// its decode committed by node on a second attempt and exactly one result:
// every part written once (etcd's per-key version counts writes since
// creation) and nothing else under the job's results.
func (m *mesh) waitRedecoded(ctx context.Context, c *httpapi.Client, id, node string) jobs.Job {
	t := m.t
	t.Helper()
	done := waitSucceededAt(t, ctx, c, id)
	if dec := done.Stages[jobs.Decode]; dec.Node != node || dec.Attempt != 2 {
		t.Fatalf("decode stage = %+v, want committed by %s on attempt 2", dec, node)
	}
	m.checkResultOnce(ctx, done)
	return done
}

// checkResultOnce checks that the job's result object was recorded by the
// commit that finished the job (one transaction, so the record's creation
// is the job record's last write), not by a stale or repeated decode.
func (m *mesh) checkResultOnce(ctx context.Context, job jobs.Job) {
	t := m.t
	t.Helper()
	resp, err := m.cli.Txn(ctx).Then(
		clientv3.OpGet("/latentmesh/default/jobs/"+job.ID),
		clientv3.OpGet(cache.ObjectKey("/latentmesh/default", job.Result.Object)),
	).Commit()
	if err != nil {
		t.Fatal(err)
	}
	jk, ok := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
	if len(jk) != 1 || len(ok) != 1 {
		t.Fatalf("job record (%d) or result object record (%d) missing", len(jk), len(ok))
	}
	if ok[0].CreateRevision != jk[0].ModRevision {
		t.Fatalf("result record created at revision %d, job finished at %d: not by the finishing commit", ok[0].CreateRevision, jk[0].ModRevision)
	}
}

func errorf(format string, a ...any) error { return fmt.Errorf(format, a...) }

// Pause returns once every thread of the process is stopped, and Resume
// lets them run again.
func TestPauseWaitsForEveryThread(t *testing.T) {
	p, err := StartProcess("sleeper", "/bin/sh", nil, "-c", "while :; do :; done")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Kill() })
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	if stopped, err := allThreadsStopped(p.cmd.Process.Pid); err != nil || !stopped {
		t.Fatalf("after Pause: stopped %v, %v", stopped, err)
	}
	if err := p.Resume(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() error {
		if stopped, err := allThreadsStopped(p.cmd.Process.Pid); err != nil || stopped {
			return fmt.Errorf("after Resume: stopped %v, %v", stopped, err)
		}
		return nil
	})
}
