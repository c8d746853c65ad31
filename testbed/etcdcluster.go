package testbed

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// EtcdClusterConfig says how to run a multi-member etcd cluster as separate
// OS processes, each with etcd's default flags, so quorum loss, member
// restarts and leader elections are real.
type EtcdClusterConfig struct {
	// Binary is the etcd executable; "" looks up "etcd" on PATH.
	Binary string
	// Dir holds the members' data directories (removed on Close); "" means
	// the system's temporary directory.
	Dir string
	// Members is the cluster size (3 tolerates one member down).
	Members int
	// IP is the address every member listens on; "" means 127.0.0.1. Give
	// a Net's RootIP for agents in network namespaces to reach it.
	IP string
	// ExtraArgs are appended to every member's command line.
	ExtraArgs []string
	// StartTimeout bounds how long a start waits for the cluster to serve.
	StartTimeout time.Duration
	// Output also receives every member's output; may be nil.
	Output io.Writer
}

// DefaultEtcdClusterConfig is three members from PATH on loopback.
func DefaultEtcdClusterConfig() EtcdClusterConfig {
	return EtcdClusterConfig{
		Binary:       "",               // look up etcd on PATH
		Dir:          "",               // the system's temporary directory
		Members:      3,                // the smallest cluster that survives a member's loss
		IP:           "127.0.0.1",      // loopback
		ExtraArgs:    nil,              // etcd's defaults everywhere else
		StartTimeout: 60 * time.Second, // three cold starts and an election on 2 loaded cores
		Output:       nil,              // captured only; shown in errors
	}
}

// etcdMember is one member's fixed identity: it restarts with the same
// name, URLs and data directory, as a rebooted etcd host would.
type etcdMember struct {
	name      string
	dataDir   string
	clientURL string
	peerURL   string

	mu   sync.Mutex
	proc *Process // nil while the member is down
}

// EtcdCluster is a running multi-member etcd.
type EtcdCluster struct {
	cfg     EtcdClusterConfig
	bin     string
	dir     string
	initial string // --initial-cluster
	members []*etcdMember

	closeOnce sync.Once
	closeErr  error
}

// StartEtcdCluster starts cfg.Members etcd processes as one new cluster and
// waits until it serves a linearizable read.
func StartEtcdCluster(ctx context.Context, cfg EtcdClusterConfig) (_ *EtcdCluster, err error) {
	if cfg.Members < 1 || cfg.StartTimeout <= 0 {
		return nil, errors.New("testbed: etcd cluster Members and StartTimeout must be set (start from DefaultEtcdClusterConfig)")
	}
	if cfg.IP == "" {
		cfg.IP = "127.0.0.1"
	}
	bin := cfg.Binary
	if bin == "" {
		if bin, err = EtcdBinaryAvailable(); err != nil {
			return nil, err
		}
	}
	dir, err := os.MkdirTemp(cfg.Dir, "latentmesh-etcd-cluster-")
	if err != nil {
		return nil, fmt.Errorf("testbed: etcd cluster dir: %w", err)
	}
	c := &EtcdCluster{cfg: cfg, bin: bin, dir: dir}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	var initial []string
	for i := range cfg.Members {
		client, err := freePort(cfg.IP)
		if err != nil {
			return nil, err
		}
		peer, err := freePort(cfg.IP)
		if err != nil {
			return nil, err
		}
		m := &etcdMember{
			name:      fmt.Sprintf("etcd-%d", i),
			dataDir:   fmt.Sprintf("%s/etcd-%d", dir, i),
			clientURL: "http://" + client,
			peerURL:   "http://" + peer,
		}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"="+m.peerURL)
	}
	c.initial = strings.Join(initial, ",")
	for i := range c.members {
		if err := c.startMember(i, "new"); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancel()
	if err := c.WaitHealthy(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

// freePort returns ip:port for a port free a moment ago.
func freePort(ip string) (string, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return "", fmt.Errorf("testbed: pick a free port on %s: %w", ip, err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func (c *EtcdCluster) startMember(i int, state string) error {
	m := c.members[i]
	args := []string{
		"--name", m.name,
		"--data-dir", m.dataDir,
		"--listen-client-urls", m.clientURL,
		"--advertise-client-urls", m.clientURL,
		"--listen-peer-urls", m.peerURL,
		"--initial-advertise-peer-urls", m.peerURL,
		"--initial-cluster", c.initial,
		"--initial-cluster-state", state,
		"--initial-cluster-token", "latentmesh-testbed",
	}
	args = append(args, c.cfg.ExtraArgs...)
	cmd := exec.Command(c.bin, args...)
	cmd.Env = etcdEnv(os.Environ())
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p, err := StartCommand(m.name, cmd, c.cfg.Output)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.proc = p
	m.mu.Unlock()
	return nil
}

// Endpoints are every member's client URL.
func (c *EtcdCluster) Endpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.clientURL)
	}
	return eps
}

// Len is the number of members.
func (c *EtcdCluster) Len() int { return len(c.members) }

// Running reports whether member i's process is up (it may be paused).
func (c *EtcdCluster) Running(i int) bool {
	m := c.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc == nil {
		return false
	}
	select {
	case <-m.proc.done:
		return false
	default:
		return true
	}
}

// Kill sends member i SIGKILL; its data directory stays for Restart.
func (c *EtcdCluster) Kill(i int) {
	m := c.members[i]
	m.mu.Lock()
	p := m.proc
	m.proc = nil
	m.mu.Unlock()
	if p != nil {
		p.Kill()
	}
}

// Pause freezes member i (SIGSTOP); Resume continues it.
func (c *EtcdCluster) Pause(i int) error { return c.signal(i, (*Process).Pause) }

// Resume continues a paused member i (SIGCONT).
func (c *EtcdCluster) Resume(i int) error { return c.signal(i, (*Process).Resume) }

func (c *EtcdCluster) signal(i int, f func(*Process) error) error {
	m := c.members[i]
	m.mu.Lock()
	p := m.proc
	m.mu.Unlock()
	if p == nil {
		return fmt.Errorf("testbed: %s is not running", m.name)
	}
	return f(p)
}

// Restart starts a killed member i again from its data directory, as the
// same member; it rejoins the cluster on its own.
func (c *EtcdCluster) Restart(i int) error {
	if c.Running(i) {
		return fmt.Errorf("testbed: %s is still running", c.members[i].name)
	}
	return c.startMember(i, "existing")
}

// Leader returns the index of the member that reports itself leader.
func (c *EtcdCluster) Leader(ctx context.Context) (int, error) {
	cli, err := c.client()
	if err != nil {
		return -1, err
	}
	defer cli.Close()
	var last error
	for i, m := range c.members {
		if !c.Running(i) {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := cli.Status(sctx, m.clientURL)
		cancel()
		if err != nil {
			last = err
			continue
		}
		if st.Leader == st.Header.MemberId {
			return i, nil
		}
	}
	return -1, fmt.Errorf("testbed: no member reports itself leader (last error: %v)", last)
}

// WaitHealthy waits until a linearizable read succeeds through every
// running member.
func (c *EtcdCluster) WaitHealthy(ctx context.Context) error {
	backoff := 50 * time.Millisecond
	var last error
	for {
		if last = c.healthy(ctx); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("testbed: etcd cluster not healthy: %w (last: %v)\n%s", ctx.Err(), last, c.outputs())
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

func (c *EtcdCluster) healthy(ctx context.Context) error {
	for i, m := range c.members {
		if !c.Running(i) {
			continue
		}
		cli, err := NewEtcdClient([]string{m.clientURL}, nil)
		if err != nil {
			return err
		}
		gctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err = cli.Get(gctx, "latentmesh-etcd-ready")
		cancel()
		cli.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
	}
	return nil
}

func (c *EtcdCluster) client() (*clientv3.Client, error) {
	return NewEtcdClient(c.Endpoints(), nil)
}

// outputs is every member's output, for errors.
func (c *EtcdCluster) outputs() string {
	var b strings.Builder
	for _, m := range c.members {
		m.mu.Lock()
		p := m.proc
		m.mu.Unlock()
		if p != nil {
			out := p.Output()
			if len(out) > 4000 {
				out = "..." + out[len(out)-4000:]
			}
			fmt.Fprintf(&b, "--- %s ---\n%s\n", m.name, out)
		}
	}
	return b.String()
}

// Close stops every member and removes the data directories. Idempotent.
func (c *EtcdCluster) Close() error {
	c.closeOnce.Do(func() {
		var errs []error
		for _, m := range c.members {
			m.mu.Lock()
			p := m.proc
			m.proc = nil
			m.mu.Unlock()
			if p != nil {
				// Killed members and SIGTERM exits are both fine here.
				_ = p.Stop(etcdStopTimeout)
			}
		}
		if err := os.RemoveAll(c.dir); err != nil {
			errs = append(errs, fmt.Errorf("testbed: remove etcd cluster dir: %w", err))
		}
		c.closeErr = errors.Join(errs...)
	})
	return c.closeErr
}
