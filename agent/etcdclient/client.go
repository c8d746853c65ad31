package etcdclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Config is how latentmesh reaches etcd: the endpoints, and for a secured
// etcd the client certificate, the CA that signed etcd's server
// certificate, and a user. Every etcd client of latentmesh (the agent
// command, the testbed) is built from one, with New.
type Config struct {
	Endpoints []string
	// CertFile and KeyFile are a client certificate (PEM), for an etcd
	// started with --client-cert-auth; both or neither.
	CertFile, KeyFile string
	// CAFile verifies etcd's server certificate (PEM); "" uses the
	// system's roots. Any of the three files, or an https endpoint, turns
	// TLS on; an http endpoint with TLS files is refused, not downgraded.
	CAFile string
	// Username and Password authenticate to an etcd with auth enabled.
	Username, Password string
	// DialTimeout bounds the first connection (5 s if zero).
	DialTimeout time.Duration
	Logger      *zap.Logger
}

// Connect connects to endpoints without TLS or auth. Its message limits
// are generous, but nothing latentmesh writes needs them: files live in
// the Store, and a commit is a few KiB.
func Connect(endpoints []string, log *zap.Logger) (*clientv3.Client, error) {
	return Config{Endpoints: endpoints, Logger: log}.New(context.Background())
}

// TLS reports whether the config asks for TLS.
func (c Config) TLS() bool {
	if c.CertFile != "" || c.KeyFile != "" || c.CAFile != "" {
		return true
	}
	for _, ep := range c.Endpoints {
		if strings.HasPrefix(ep, "https://") {
			return true
		}
	}
	return false
}

// tlsConfig loads the certificate files.
func (c Config) tlsConfig() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if (c.CertFile == "") != (c.KeyFile == "") {
		return nil, errors.New("etcdclient: etcd client certificate needs both a cert and a key file")
	}
	if c.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("etcdclient: etcd client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("etcdclient: etcd CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("etcdclient: etcd CA %s: no PEM certificate in it", c.CAFile)
		}
		tc.RootCAs = pool
	}
	return tc, nil
}

// New connects. With TLS it first shakes hands with each endpoint that
// accepts a connection, so that a certificate etcd refuses, or one of
// etcd's that the CA does not vouch for, is an error that says so rather
// than requests timing out later (gRPC retries a failed handshake
// silently).
func (c Config) New(ctx context.Context) (*clientv3.Client, error) {
	log := c.Logger
	if log == nil {
		log = zap.NewNop()
	}
	if len(c.Endpoints) == 0 {
		return nil, errors.New("etcdclient: no etcd endpoints")
	}
	dial := c.DialTimeout
	if dial <= 0 {
		dial = 5 * time.Second
	}
	cc := clientv3.Config{
		Endpoints:          c.Endpoints,
		DialTimeout:        dial,
		MaxCallSendMsgSize: 64 << 20, // generous; commits are a few KiB
		MaxCallRecvMsgSize: 64 << 20, // a prefix read of many records
		Username:           c.Username,
		Password:           c.Password,
		Logger:             log.Named("etcdclient").WithOptions(zap.IncreaseLevel(zap.ErrorLevel)),
	}
	if c.TLS() {
		tc, err := c.tlsConfig()
		if err != nil {
			return nil, err
		}
		for _, ep := range c.Endpoints {
			if !strings.HasPrefix(ep, "https://") {
				return nil, fmt.Errorf("etcdclient: etcd endpoint %s: TLS is configured, so it must be https://", ep)
			}
			if err := checkTLS(ctx, ep, tc, dial); err != nil {
				return nil, err
			}
		}
		cc.TLS = tc
	}
	cli, err := clientv3.New(cc)
	if err != nil {
		return nil, fmt.Errorf("etcdclient: etcd client %v: %w", c.Endpoints, err)
	}
	return cli, nil
}

// checkTLS shakes hands with endpoint, then waits briefly for a TLS alert:
// under TLS 1.3 a server that refuses the client's certificate says so
// only after the client's handshake has completed. An endpoint that does
// not accept connections is left to the client's own retries.
func checkTLS(ctx context.Context, endpoint string, tc *tls.Config, timeout time.Duration) error {
	u, err := url.Parse(endpoint)
	if err != nil {
		return fmt.Errorf("etcdclient: etcd endpoint %q: %w", endpoint, err)
	}
	tc = tc.Clone()
	tc.ServerName = u.Hostname()
	tc.NextProtos = []string{"h2"}
	d := &tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: tc}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := d.DialContext(dctx, "tcp", u.Host)
	var certErr *tls.CertificateVerificationError
	switch {
	case errors.As(err, &certErr):
		return fmt.Errorf("etcdclient: etcd at %s: its certificate is not trusted (check the CA file): %w", endpoint, err)
	case err != nil && strings.Contains(err.Error(), "tls:"):
		return fmt.Errorf("etcdclient: etcd at %s: TLS handshake failed: %w", endpoint, err)
	case err != nil:
		return nil // not listening (yet): the client retries and says so
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	_, err = conn.Read(make([]byte, 1))
	var ne net.Error
	if err != nil && !(errors.As(err, &ne) && ne.Timeout()) && strings.Contains(err.Error(), "tls:") {
		return fmt.Errorf("etcdclient: etcd at %s refused this client's certificate (is it signed by etcd's --trusted-ca-file?): %w", endpoint, err)
	}
	return nil
}
