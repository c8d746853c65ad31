package testbed

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/gossip"
)

// HostAgentConfig says how to run one `latentmesh agent` process on a Net's
// host, listening on the host's address, as on a machine of its own.
type HostAgentConfig struct {
	Binary     string   // the latentmesh executable
	Host       *Host    // where it runs
	NodeID     string   // kept across restarts
	Roles      []string // stages it serves
	Endpoints  []string // etcd client URLs, reachable from the host
	Prefix     string   // etcd key prefix of the mesh ("" = the default)
	Keyring    string   // gossip keyring file every agent of the mesh shares
	AdminToken string   // needed on an admin endpoint beyond loopback
	// Identity is the libp2p key file: a restarted agent keeps its peer
	// id, as a rebooted machine with a persistent key would.
	Identity string
	// StateDir is the agent's --state-dir: its key, node id and the
	// Store's disk tier, kept across restarts as a node's disk would be.
	// "" runs it with no state directory (a new node each start, but for
	// Identity and NodeID).
	StateDir string
	Extra    []string  // further agent flags
	Output   io.Writer // also receives the agent's output; may be nil
}

// HostAgent is an agent process on a Net's host that can be killed,
// paused and started again under the same node id.
type HostAgent struct {
	cfg HostAgentConfig
	cli *clientv3.Client

	mu sync.Mutex
	// mu guards the fields below.
	proc *Process
	rec  gossip.NodeRecord // its latest registration
}

// NewHostAgent prepares an agent; Start runs it. cli reads its
// registration.
func NewHostAgent(cfg HostAgentConfig, cli *clientv3.Client) (*HostAgent, error) {
	if cfg.Binary == "" || cfg.Host == nil || cfg.NodeID == "" || len(cfg.Roles) == 0 || len(cfg.Endpoints) == 0 {
		return nil, errors.New("testbed: host agent needs Binary, Host, NodeID, Roles and Endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = agent.DefaultConfig().Prefix
	}
	cfg.Roles = append([]string(nil), cfg.Roles...)
	cfg.Extra = append([]string(nil), cfg.Extra...)
	return &HostAgent{cfg: cfg, cli: cli}, nil
}

// ID is the agent's node id.
func (a *HostAgent) ID() string { return a.cfg.NodeID }

// Roles are the stages the agent serves.
func (a *HostAgent) Roles() []string { return a.cfg.Roles }

// Host is where the agent runs.
func (a *HostAgent) Host() *Host { return a.cfg.Host }

// Record is the agent's latest registration (zero before Start returns).
func (a *HostAgent) Record() gossip.NodeRecord {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.rec
}

func (a *HostAgent) args() []string {
	ip := a.cfg.Host.IP
	args := []string{a.cfg.Binary, "agent",
		"--etcd-endpoints", strings.Join(a.cfg.Endpoints, ","),
		"--prefix", a.cfg.Prefix,
		"--roles", strings.Join(a.cfg.Roles, ","),
		"--node-id", a.cfg.NodeID,
		"--http", ip + ":0", "--admin", ip + ":0",
		"--p2p-listen", "/ip4/" + ip + "/tcp/0", "--data-listen", ip + ":0", "--gossip-bind", ip + ":0",
		"--log-format", "console",
	}
	if a.cfg.Keyring != "" {
		args = append(args, "--gossip-keyring", a.cfg.Keyring)
	}
	if a.cfg.AdminToken != "" {
		args = append(args, "--admin-token", a.cfg.AdminToken)
	}
	if a.cfg.Identity != "" {
		args = append(args, "--identity", a.cfg.Identity)
	}
	args = append(args, "--state-dir", a.cfg.StateDir)
	return append(args, a.cfg.Extra...)
}

// Start runs the agent (again, after Kill) and waits until it has
// registered in etcd: a registration written after the start, so a
// previous incarnation's record, still on its lease, does not count.
func (a *HostAgent) Start(ctx context.Context) error {
	a.mu.Lock()
	if a.proc != nil && !a.proc.exited() {
		a.mu.Unlock()
		return fmt.Errorf("testbed: agent %s is running", a.cfg.NodeID)
	}
	a.mu.Unlock()
	key := a.cfg.Prefix + "/nodes/" + a.cfg.NodeID
	before, err := a.cli.Get(ctx, key)
	if err != nil {
		return fmt.Errorf("testbed: agent %s: read registration: %w", a.cfg.NodeID, err)
	}
	argv := a.args()
	cmd := a.cfg.Host.Command(argv...)
	// ip netns exec, unshare and sh all exec, so the process is the agent;
	// it dies with us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p, err := StartCommand(a.cfg.NodeID, cmd, a.cfg.Output)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.proc = p
	a.mu.Unlock()
	backoff := 50 * time.Millisecond
	for {
		resp, err := a.cli.Get(ctx, key)
		if err == nil && len(resp.Kvs) == 1 && resp.Kvs[0].ModRevision > before.Header.Revision {
			var rec gossip.NodeRecord
			if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
				return fmt.Errorf("testbed: agent %s: registration: %w", a.cfg.NodeID, err)
			}
			a.mu.Lock()
			a.rec = rec
			a.mu.Unlock()
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("testbed: agent %s exited (%v) before registering; output:\n%s", a.cfg.NodeID, p.err, tail(p.Output(), 4000))
		case <-ctx.Done():
			return fmt.Errorf("testbed: agent %s did not register: %w; output:\n%s", a.cfg.NodeID, ctx.Err(), tail(p.Output(), 4000))
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func (a *HostAgent) process() *Process {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.proc
}

// Running reports whether the agent's process is up (it may be paused).
func (a *HostAgent) Running() bool {
	p := a.process()
	return p != nil && !p.exited()
}

// Kill sends the agent SIGKILL and waits for it to be gone.
func (a *HostAgent) Kill() {
	if p := a.process(); p != nil {
		p.Kill()
	}
}

// Pause stops the agent with SIGSTOP.
func (a *HostAgent) Pause() error {
	if p := a.process(); p != nil {
		return p.Pause()
	}
	return fmt.Errorf("testbed: agent %s not started", a.cfg.NodeID)
}

// Resume continues a paused agent (SIGCONT).
func (a *HostAgent) Resume() error {
	if p := a.process(); p != nil {
		return p.Resume()
	}
	return fmt.Errorf("testbed: agent %s not started", a.cfg.NodeID)
}

// Stop ends the agent with SIGTERM, or SIGKILL after timeout.
func (a *HostAgent) Stop(timeout time.Duration) error {
	if p := a.process(); p != nil {
		return p.Stop(timeout)
	}
	return nil
}

// Output is what the current incarnation printed.
func (a *HostAgent) Output() string {
	if p := a.process(); p != nil {
		return p.Output()
	}
	return ""
}

// Status reads the agent's admin status.
func (a *HostAgent) Status(ctx context.Context) (agent.Status, error) {
	var st agent.Status
	err := AdminGet(ctx, a.Record().AdminAddr, a.cfg.AdminToken, "/v1/admin/status", &st)
	return st, err
}

// AdminGet reads path from an agent's admin endpoint at addr (host:port)
// into out, with token as its bearer token ("" for none).
func AdminGet(ctx context.Context, addr, token, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("testbed: %s%s: %s: %s", addr, path, resp.Status, strings.TrimSpace(string(b)))
	}
	return json.NewDecoder(resp.Body).Decode(out)
}
