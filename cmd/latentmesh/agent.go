package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	s, code := loadAgentSettings("agent", args, os.Environ(), stderr, nil)
	if code >= 0 {
		return code
	}
	log, err := newLogger(s.logFormat, s.verbose, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: --log-format: %v\n", err)
		return 2
	}
	defer log.Sync()
	s.warnUnknownEnv(log)
	cfg, ecc, certs, err := s.build(log)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 2
	}
	stopReload := reloadOnHangup(ctx, certs, log)
	defer stopReload()
	cli, err := ecc.New(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: %v\n", err)
		return 1
	}
	defer cli.Close()
	// Fail fast and say so when etcd is not there; systemd restarts us.
	probe, cancelProbe := context.WithTimeout(ctx, 10*time.Second)
	_, err = cli.Get(probe, cfg.Prefix+"/nodes/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	cancelProbe()
	if err != nil {
		fmt.Fprintf(stderr, "latentmesh agent: cannot reach etcd at %s: %v\n", strings.Join(ecc.Endpoints, ","), err)
		return 1
	}
	a, err := agent.New(cfg, cli)
	if err != nil {
		log.Error("start failed", zap.Error(err))
		return 1
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = a.Start(startCtx)
	cancel()
	if err != nil {
		log.Error("join failed", zap.Error(err))
		a.Close()
		return 1
	}
	// Registered and in gossip: systemd may count the unit started.
	nctx, stopNotify := context.WithCancel(ctx)
	go notifyReady(nctx, log, a)
	select {
	case <-ctx.Done(): // SIGTERM or SIGINT: drain, then leave
	case <-a.Drained(): // drained through the admin endpoint
	}
	stopNotify()
	notifyStopping(log)
	log.Info("shutting down")
	// The drain's own deadline is DrainTimeout; requeuing what still runs
	// then takes an etcd write per task.
	dctx, cancelDrain := context.WithTimeout(context.Background(), cfg.DrainTimeout+cfg.EtcdTimeout)
	if err := a.Drain(dctx); err != nil {
		log.Warn("drain", zap.Error(err))
	}
	cancelDrain()
	if err := a.Close(); err != nil {
		log.Warn("close", zap.Error(err))
	}
	return 0
}

// readPassword reads the first line of file, the password of user. A
// password never comes on the command line, where ps shows it.
func readPassword(user, file string) (string, error) {
	if file == "" {
		if user != "" {
			return "", fmt.Errorf("--etcd-user needs --etcd-password-file")
		}
		return "", nil
	}
	if user == "" {
		return "", fmt.Errorf("--etcd-password-file needs --etcd-user")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("--etcd-password-file: %w", err)
	}
	pw, _, _ := strings.Cut(string(b), "\n")
	pw = strings.TrimSuffix(pw, "\r")
	if pw == "" {
		return "", fmt.Errorf("--etcd-password-file %s: empty password", file)
	}
	return pw, nil
}

// applyStoreFlags sets the Store's capacities and the transfer mode.
// defaultStateDir is where an agent keeps its state unless told: the
// directory systemd made for the unit (StateDirectory=), else
// /var/lib/latentmesh for root, else ~/.local/state/latentmesh.
func defaultStateDir() string {
	if d := os.Getenv("STATE_DIRECTORY"); d != "" {
		return strings.Split(d, ":")[0]
	}
	if os.Geteuid() == 0 {
		return "/var/lib/latentmesh"
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "state", "latentmesh")
	}
	return ""
}

func applyStoreFlags(cfg *agent.Config, capacity, spillDir, spillCap, mode string) error {
	if capacity != "" {
		n, err := bytesize.Parse(capacity)
		if err != nil {
			return fmt.Errorf("--store-capacity: %w", err)
		}
		cfg.StoreMemory = n
	}
	var n int64
	if spillCap != "" {
		var err error
		if n, err = bytesize.Parse(spillCap); err != nil {
			return fmt.Errorf("--store-spill-capacity: %w", err)
		}
	}
	if n > 0 && spillDir == "" && cfg.StateDir == "" {
		return fmt.Errorf("--store-spill-capacity needs --store-spill-dir or --state-dir")
	}
	cfg.Store.SpillDir, cfg.Store.SpillCapacity = spillDir, n
	m, err := jobs.ParseTransferMode(mode)
	if err != nil || m == "" {
		return fmt.Errorf("--transfer-mode %q: want p2p, store or auto", mode)
	}
	cfg.TransferMode = m
	return nil
}
