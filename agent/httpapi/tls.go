package httpapi

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"go.uber.org/zap"
)

// CertReloader serves one certificate and key pair, read from files, on
// the client API and the admin endpoint, and reads them again when either
// file changes: every handshake stats both (size, modification time, and
// inode, so a renamed-in or re-linked file counts, as certbot and
// Kubernetes secrets replace theirs), and Reload reads them whatever the
// stats say (SIGHUP). A pair that does not load (a half-written file, a
// key that does not match its certificate) is logged and the pair in use
// is kept; it is tried again once the files change again.
type CertReloader struct {
	certFile, keyFile string
	log               *zap.Logger

	mu   sync.Mutex // guards the fields below
	cert *tls.Certificate
	seen [2]os.FileInfo // the files as they were at the last attempt to load them
}

// NewCertReloader loads certFile and keyFile (PEM) and returns a reloader
// serving them; a pair that does not load is an error.
func NewCertReloader(certFile, keyFile string, log *zap.Logger) (*CertReloader, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("httpapi: TLS needs both a certificate and a key file")
	}
	if log == nil {
		log = zap.NewNop()
	}
	r := &CertReloader{certFile: certFile, keyFile: keyFile, log: log.Named("tls")}
	if err := r.Reload(); err != nil {
		return nil, err
	}
	return r, nil
}

// ServerConfig is a TLS configuration that serves the reloader's pair
// (TLS 1.2 at least).
func (r *CertReloader) ServerConfig() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: r.GetCertificate}
}

// Reload reads the pair now. On error the pair in use stays.
func (r *CertReloader) Reload() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.loadLocked(r.stat())
}

// GetCertificate is tls.Config.GetCertificate: the pair in use, read
// again first when a file changed since it was last read.
func (r *CertReloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	st := r.stat()
	r.mu.Lock()
	defer r.mu.Unlock()
	if changed(r.seen, st) {
		if err := r.loadLocked(st); err != nil {
			r.log.Warn("certificate files changed but do not load; serving the previous pair", zap.Error(err))
		}
	}
	return r.cert, nil
}

func (r *CertReloader) stat() [2]os.FileInfo {
	var st [2]os.FileInfo
	for i, f := range []string{r.certFile, r.keyFile} {
		st[i], _ = os.Stat(f) // a missing file is a change; loading it says why
	}
	return st
}

// loadLocked reads the pair; st is what the files looked like just before,
// remembered so that a pair that failed is not read again until it changes.
func (r *CertReloader) loadLocked(st [2]os.FileInfo) error {
	r.seen = st
	cert, err := tls.LoadX509KeyPair(r.certFile, r.keyFile)
	if err != nil {
		return fmt.Errorf("httpapi: TLS certificate %s, key %s: %w", r.certFile, r.keyFile, err)
	}
	r.cert = &cert
	if leaf := cert.Leaf; leaf != nil {
		r.log.Info("certificate loaded", zap.String("file", r.certFile),
			zap.String("subject", leaf.Subject.String()), zap.Strings("dns", leaf.DNSNames),
			zap.Time("not_after", leaf.NotAfter))
	}
	return nil
}

func changed(a, b [2]os.FileInfo) bool {
	for i := range a {
		if a[i] == nil || b[i] == nil {
			if a[i] != b[i] {
				return true
			}
			continue
		}
		if !os.SameFile(a[i], b[i]) || a[i].Size() != b[i].Size() || !a[i].ModTime().Equal(b[i].ModTime()) {
			return true
		}
	}
	return false
}

// maxCAFile bounds a CA bundle read by ClientTLS: the system bundle is
// about 200 KiB.
const maxCAFile = 4 << 20

// ClientTLS is the TLS configuration of a client of an agent's HTTPS
// endpoints: caFile (PEM) holds the certificates that may sign the agent's
// (a self-signed agent certificate is its own CA); "" trusts the system
// roots.
func ClientTLS(caFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile == "" {
		return c, nil
	}
	f, err := os.Open(caFile)
	if err != nil {
		return nil, fmt.Errorf("httpapi: CA file: %w", err)
	}
	defer f.Close()
	pem, err := io.ReadAll(io.LimitReader(f, maxCAFile+1))
	if err != nil {
		return nil, fmt.Errorf("httpapi: CA file %s: %w", caFile, err)
	}
	if len(pem) > maxCAFile {
		return nil, fmt.Errorf("httpapi: CA file %s is over %d bytes", caFile, maxCAFile)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("httpapi: CA file %s holds no PEM certificate", caFile)
	}
	c.RootCAs = pool
	return c, nil
}
