// Package etcdembed runs a single-member etcd inside the process: the default
// control plane for `latentmesh-dev demo`, `latentmesh-dev dev` and the
// tests, so a newcomer needs nothing but Go. The latentmesh binary never
// links it (cmd/latentmesh/deps_test.go). Production clusters point agents at an
// external etcd instead (`latentmesh agent --etcd-endpoints`).
package etcdembed

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Config says where the embedded etcd keeps its data and listens.
type Config struct {
	// Dir holds the data. "" means a fresh temporary directory, removed on Close.
	Dir string
	// ClientURL is where clients connect. Port 0 picks a free port.
	ClientURL string
	// MaxRequestBytes bounds one request. Nothing latentmesh writes is
	// large (files and latents are Store objects), so etcd's own default.
	MaxRequestBytes uint
	// CompactionRetention is how much history periodic auto-compaction keeps;
	// 0 disables auto-compaction.
	CompactionRetention time.Duration
	// QuotaBackendBytes is the database size at which etcd raises its NOSPACE
	// alarm and refuses every write but deletes; 0 means etcd's default (2 GiB).
	QuotaBackendBytes int64
	// Fsync keeps etcd's fsync of its log when Dir is "". A temporary
	// directory is removed on Close and read by nothing after this process,
	// so a crash loses it synced or not: fsync there protects no data, and
	// on the development machine it was half of every write's latency. A
	// Dir the caller names is always synced (etcd's default).
	Fsync bool
	// StartTimeout bounds how long Start waits for the member to be ready.
	StartTimeout time.Duration
	// Logger receives etcd's own logs (named "etcd") at LogLevel and above;
	// nil discards them.
	Logger *zap.Logger
	// LogLevel filters etcd's logs: it warns about every slow request and
	// logs benign errors on shutdown, so the default shows only panics.
	LogLevel zapcore.Level
}

// DefaultConfig is a loopback-only etcd in a temporary directory.
func DefaultConfig() Config {
	return Config{
		Dir:             "",                   // a temporary directory: tests and demos start clean
		ClientURL:       "http://127.0.0.1:0", // loopback only; a free port
		MaxRequestBytes: 1536 << 10,           // etcd's default: the mesh must run on one
		// Jobs, claims and progress are rewritten often: a short history keeps
		// the database small. A watch resumed from further back than this is
		// told it was compacted, and the agent resyncs it from a fresh read.
		CompactionRetention: 5 * time.Minute,
		QuotaBackendBytes:   0,                   // etcd's default, 2 GiB
		Fsync:               false,               // a temporary directory: nothing to protect
		StartTimeout:        30 * time.Second,    // a cold start on a loaded 2-core machine
		Logger:              nil,                 // etcd's logs discarded
		LogLevel:            zapcore.DPanicLevel, // start failures come back as errors anyway
	}
}

// Server is a running embedded etcd.
type Server struct {
	etcd    *embed.Etcd
	dir     string
	tempDir bool
}

// Start launches the member and waits until it serves clients.
func Start(ctx context.Context, cfg Config) (_ *Server, err error) {
	if cfg.MaxRequestBytes == 0 || cfg.StartTimeout <= 0 || cfg.ClientURL == "" {
		return nil, errors.New("etcdembed: ClientURL, MaxRequestBytes and StartTimeout must be set (start from DefaultConfig)")
	}
	if cfg.CompactionRetention < 0 || cfg.QuotaBackendBytes < 0 {
		return nil, fmt.Errorf("etcdembed: CompactionRetention %v and QuotaBackendBytes %d must not be negative", cfg.CompactionRetention, cfg.QuotaBackendBytes)
	}
	s := &Server{dir: cfg.Dir}
	if s.dir == "" {
		if s.dir, err = os.MkdirTemp("", "latentmesh-etcd-"); err != nil {
			return nil, fmt.Errorf("etcdembed: temp dir: %w", err)
		}
		s.tempDir = true
	}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	curl, err := url.Parse(cfg.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("etcdembed: client url: %w", err)
	}
	// The peer URL is never dialled by a one-member cluster; a free port keeps
	// several embedded servers (tests, demo) from colliding.
	purl, _ := url.Parse("http://127.0.0.1:0")

	ec := embed.NewConfig()
	ec.Name = "latentmesh"
	ec.Dir = s.dir
	ec.ListenClientUrls = []url.URL{*curl}
	ec.AdvertiseClientUrls = []url.URL{*curl}
	ec.ListenPeerUrls = []url.URL{*purl}
	ec.AdvertisePeerUrls = []url.URL{*purl}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	ec.MaxRequestBytes = cfg.MaxRequestBytes
	// A duration string ("5m0s"): a bare integer would be read as hours.
	ec.AutoCompactionMode = embed.CompactorModePeriodic
	ec.AutoCompactionRetention = cfg.CompactionRetention.String()
	ec.QuotaBackendBytes = cfg.QuotaBackendBytes
	ec.UnsafeNoFsync = s.tempDir && !cfg.Fsync
	ec.LogLevel = "error"
	if cfg.Logger != nil {
		ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(cfg.Logger.Named("etcd").WithOptions(zap.IncreaseLevel(cfg.LogLevel)))
	} else {
		ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	}

	if s.etcd, err = embed.StartEtcd(ec); err != nil {
		return nil, fmt.Errorf("etcdembed: start: %w", err)
	}
	timer := time.NewTimer(cfg.StartTimeout)
	defer timer.Stop()
	select {
	case <-s.etcd.Server.ReadyNotify():
	case err := <-s.etcd.Err():
		return nil, fmt.Errorf("etcdembed: %w", err)
	case <-timer.C:
		return nil, fmt.Errorf("etcdembed: not ready after %v", cfg.StartTimeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return s, nil
}

// Endpoints are the client URLs to give clientv3 or `latentmesh agent`.
func (s *Server) Endpoints() []string {
	var eps []string
	for _, l := range s.etcd.Clients {
		eps = append(eps, "http://"+l.Addr().String())
	}
	return eps
}

// RaftIndex returns the member's raft committed and applied indexes.
// Every write, lease grant and lease revocation is one raft entry, so the
// committed index's rise over a run counts its proposals (an election
// adds one more). It is in step with what clients see: the committed
// index rises before an entry is handed to be applied, while etcd's
// Prometheus gauge of it (etcd_server_proposals_committed_total) is set
// after, so a client could see a write applied that the gauge did not
// count yet.
func (s *Server) RaftIndex() (committed, applied uint64) {
	return s.etcd.Server.CommittedIndex(), s.etcd.Server.AppliedIndex()
}

// Close stops the member and removes a temporary data directory. Idempotent.
func (s *Server) Close() {
	if s.etcd != nil {
		s.etcd.Close()
		s.etcd = nil
	}
	if s.tempDir && s.dir != "" {
		os.RemoveAll(s.dir)
		s.dir = ""
	}
}
