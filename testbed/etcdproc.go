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
)

// EtcdProcessConfig says how to run an external etcd. Every etcd flag not
// listed here keeps etcd's default (request limit, quota, compaction), so a
// test on it holds for an operator's plain etcd too.
type EtcdProcessConfig struct {
	// Binary is the etcd executable; "" looks up "etcd" on PATH.
	Binary string
	// Dir is where the data directory is created (removed on Close);
	// "" means the system's temporary directory.
	Dir string
	// Name is the member's --name.
	Name string
	// ExtraArgs are appended to the command line, e.g.
	// "--quota-backend-bytes=16777216".
	ExtraArgs []string
	// StartTimeout bounds how long StartEtcdProcess waits for it to serve.
	StartTimeout time.Duration
	// Output also receives etcd's output (it is always captured); may be nil.
	Output io.Writer
	// CertFile and KeyFile, when set, serve clients over TLS (https URLs);
	// with TrustedCAFile, etcd also requires client certificates signed by
	// it (--client-cert-auth).
	CertFile, KeyFile, TrustedCAFile string
	// Client is how StartEtcdProcess checks that etcd serves (its Endpoints
	// are filled in): the client certificate for a TLS etcd.
	Client EtcdClientConfig
}

// DefaultEtcdProcessConfig is etcd from PATH with its default flags.
func DefaultEtcdProcessConfig() EtcdProcessConfig {
	return EtcdProcessConfig{
		Binary:       "",                // look up etcd on PATH
		Dir:          "",                // the system's temporary directory
		Name:         "latentmesh-etcd", // shows up in member lists and alarms
		ExtraArgs:    nil,               // etcd's defaults everywhere else
		StartTimeout: 30 * time.Second,  // a cold start on a loaded 2-core machine
		Output:       nil,               // captured only; shown in start errors
	}
}

// etcdStartAttempts bounds retries when a port picked as free was taken
// before etcd bound it.
const etcdStartAttempts = 3

// etcdStopTimeout is how long Stop waits after SIGTERM before SIGKILL.
const etcdStopTimeout = 10 * time.Second

// EtcdProcess is an external single-member etcd running as its own OS
// process on loopback.
type EtcdProcess struct {
	proc      *Process
	dataDir   string
	endpoints []string

	closeOnce sync.Once
	closeErr  error
}

// EtcdBinaryAvailable returns the path of the etcd executable on PATH, or an
// error saying how to install it.
func EtcdBinaryAvailable() (string, error) {
	path, err := exec.LookPath("etcd")
	if err != nil {
		return "", fmt.Errorf("testbed: etcd not found on PATH (scripts/install-deps.sh installs Debian's etcd-server): %w", err)
	}
	return path, nil
}

// StartEtcdProcess runs etcd and waits until it answers a Get.
func StartEtcdProcess(ctx context.Context, cfg EtcdProcessConfig) (_ *EtcdProcess, err error) {
	if cfg.Name == "" || cfg.StartTimeout <= 0 {
		return nil, errors.New("testbed: etcd process Name and StartTimeout must be set (start from DefaultEtcdProcessConfig)")
	}
	bin := cfg.Binary
	if bin == "" {
		if bin, err = EtcdBinaryAvailable(); err != nil {
			return nil, err
		}
	}
	dataDir, err := os.MkdirTemp(cfg.Dir, "latentmesh-etcd-")
	if err != nil {
		return nil, fmt.Errorf("testbed: etcd data dir: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dataDir)
		}
	}()

	ctx, cancel := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		e, err := startEtcdOnce(ctx, bin, dataDir, cfg)
		if err == nil {
			return e, nil
		}
		if attempt == etcdStartAttempts || !errors.Is(err, errPortTaken) {
			return nil, err
		}
		// A failed first start may leave a member directory that names the
		// old peer URL; start the next attempt from an empty directory.
		if err := os.RemoveAll(dataDir); err != nil {
			return nil, fmt.Errorf("testbed: etcd data dir: %w", err)
		}
		if err := os.Mkdir(dataDir, 0o700); err != nil {
			return nil, fmt.Errorf("testbed: etcd data dir: %w", err)
		}
	}
}

// errPortTaken marks a start that failed because a port picked as free was
// taken by someone else meanwhile.
var errPortTaken = errors.New("testbed: etcd port taken")

func startEtcdOnce(ctx context.Context, bin, dataDir string, cfg EtcdProcessConfig) (*EtcdProcess, error) {
	client, err := freeLoopbackPort()
	if err != nil {
		return nil, err
	}
	peer, err := freeLoopbackPort()
	if err != nil {
		return nil, err
	}
	clientURL, peerURL := "http://"+client, "http://"+peer
	var tlsArgs []string
	if cfg.CertFile != "" {
		clientURL = "https://" + client
		tlsArgs = []string{"--cert-file", cfg.CertFile, "--key-file", cfg.KeyFile}
		if cfg.TrustedCAFile != "" {
			tlsArgs = append(tlsArgs, "--trusted-ca-file", cfg.TrustedCAFile, "--client-cert-auth")
		}
	}
	args := []string{
		"--name", cfg.Name,
		"--data-dir", dataDir,
		"--listen-client-urls", clientURL,
		"--advertise-client-urls", clientURL,
		"--listen-peer-urls", peerURL,
		"--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", cfg.Name + "=" + peerURL,
	}
	args = append(args, tlsArgs...)
	args = append(args, cfg.ExtraArgs...)
	cmd := exec.Command(bin, args...)
	cmd.Env = etcdEnv(os.Environ())
	// Die with the test binary, whatever way it ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p, err := StartCommand("etcd", cmd, cfg.Output)
	if err != nil {
		return nil, err
	}
	e := &EtcdProcess{proc: p, dataDir: dataDir, endpoints: []string{clientURL}}
	if err := e.waitServing(ctx, cfg.Client); err != nil {
		p.Kill()
		if strings.Contains(p.Output(), "address already in use") {
			return nil, fmt.Errorf("%w: %w", errPortTaken, err)
		}
		return nil, err
	}
	return e, nil
}

// etcdEnv drops ETCD_* variables, which etcd reads as flags, so the
// process runs with its defaults whatever the caller's environment holds.
// ETCD_UNSUPPORTED_ARCH is kept: etcd 3.4 needs it to start on arm64.
func etcdEnv(env []string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if strings.HasPrefix(kv, "ETCD_") && !strings.HasPrefix(kv, "ETCD_UNSUPPORTED_ARCH=") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// freeLoopbackPort returns 127.0.0.1:port for a port free a moment ago.
func freeLoopbackPort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("testbed: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// waitServing polls with a Get until etcd answers, it exits or ctx ends.
func (e *EtcdProcess) waitServing(ctx context.Context, cc EtcdClientConfig) error {
	cc.Endpoints = e.endpoints
	cli, err := cc.New(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	// A Get in flight ends as soon as etcd exits, not at its own timeout.
	pollCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-e.proc.done:
			cancel()
		case <-pollCtx.Done():
		}
	}()
	backoff := 50 * time.Millisecond
	for {
		getCtx, getCancel := context.WithTimeout(pollCtx, time.Second)
		_, err := cli.Get(getCtx, "latentmesh-etcd-ready")
		getCancel()
		if err == nil {
			return nil
		}
		timer := time.NewTimer(backoff)
		select {
		case <-timer.C:
		case <-e.proc.done:
			timer.Stop()
			return fmt.Errorf("testbed: etcd exited (%v) before serving %v; output:\n%s", e.proc.err, e.endpoints, e.proc.Output())
		case <-ctx.Done():
			timer.Stop()
			return fmt.Errorf("testbed: etcd not serving %v: %w (last: %v); output:\n%s", e.endpoints, ctx.Err(), err, e.proc.Output())
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// Endpoints are the client URLs to give clientv3 or `latentmesh agent`.
func (e *EtcdProcess) Endpoints() []string { return append([]string(nil), e.endpoints...) }

// DataDir is the member's --data-dir; it is removed on Close.
func (e *EtcdProcess) DataDir() string { return e.dataDir }

// Kill sends SIGKILL and waits for the process to be gone.
func (e *EtcdProcess) Kill() { e.proc.Kill() }

// Pause freezes etcd (SIGSTOP): its connections stay open and every request
// hangs, as with an overloaded or hung etcd, until Resume.
func (e *EtcdProcess) Pause() error { return e.proc.Pause() }

// Resume continues a paused etcd (SIGCONT).
func (e *EtcdProcess) Resume() error { return e.proc.Resume() }

// Stop sends SIGTERM and waits for etcd to exit (SIGKILL after a timeout).
// Exiting on the SIGTERM is a clean stop.
func (e *EtcdProcess) Stop() error {
	err := e.proc.Stop(etcdStopTimeout)
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGTERM {
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("testbed: stop etcd: %w; output:\n%s", err, e.proc.Output())
	}
	return nil
}

// Close stops etcd and removes its data directory. Idempotent: later calls
// return the first call's error.
func (e *EtcdProcess) Close() error {
	e.closeOnce.Do(func() {
		err := e.Stop()
		if rerr := os.RemoveAll(e.dataDir); rerr != nil {
			err = errors.Join(err, fmt.Errorf("testbed: remove etcd data dir: %w", rerr))
		}
		e.closeErr = err
	})
	return e.closeErr
}
