package testbed

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	file string // the CA certificate, PEM
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func newTestCA(t *testing.T, dir, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	file := filepath.Join(dir, name+".crt")
	writePEM(t, file, "CERTIFICATE", der)
	return &testCA{cert: cert, key: key, file: file}
}

// issue signs a certificate for name (a server on 127.0.0.1 when server is
// set, else a client) and returns its cert and key files.
func (ca *testCA) issue(t *testing.T, dir, name string, server bool) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "EC PRIVATE KEY", kder)
	return certFile, keyFile
}

// securedEtcd is an etcd process that requires TLS client certificates and
// has auth enabled, set up as docs/etcd.md tells an operator: a role with
// read-write on one prefix only, an "agent" user holding it, and root.
type securedEtcd struct {
	*EtcdProcess
	dir                   string
	ca, rogue             *testCA
	clientCert, clientKey string           // signed by ca
	rogueCert, rogueKey   string           // signed by rogue: etcd refuses it
	admin                 EtcdClientConfig // TLS identity, no user
	agent                 EtcdClientConfig // the agent user, limited to the prefix
	password              string           // the agent user's
}

// startSecuredEtcd runs a secured etcd whose agent user may use prefix.
// It skips the test when there is no etcd binary and no way to install it.
func startSecuredEtcd(t *testing.T, ctx context.Context, prefix string) *securedEtcd {
	t.Helper()
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no etcd binary and not root to install it: %v", err)
		}
		t.Fatal(err)
	}
	s := &securedEtcd{dir: t.TempDir(), password: "agent-secret"}
	s.ca = newTestCA(t, s.dir, "mesh-ca")
	serverCert, serverKey := s.ca.issue(t, s.dir, "etcd-server", true)
	s.clientCert, s.clientKey = s.ca.issue(t, s.dir, "latentmesh-client", false)
	s.rogue = newTestCA(t, s.dir, "rogue-ca")
	s.rogueCert, s.rogueKey = s.rogue.issue(t, s.dir, "rogue-client", false)

	ecfg := DefaultEtcdProcessConfig()
	ecfg.Dir = s.dir
	ecfg.CertFile, ecfg.KeyFile, ecfg.TrustedCAFile = serverCert, serverKey, s.ca.file
	ecfg.Client = EtcdClientConfig{CertFile: s.clientCert, KeyFile: s.clientKey, CAFile: s.ca.file}
	var err error
	if s.EtcdProcess, err = StartEtcdProcess(ctx, ecfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	eps := s.Endpoints()
	if !strings.HasPrefix(eps[0], "https://") {
		t.Fatalf("endpoint %s is not TLS", eps[0])
	}

	// As an operator would with etcdctl: a role on the mesh's prefix only,
	// an agent user with it, then root, then auth on.
	s.admin = EtcdClientConfig{Endpoints: eps, CertFile: s.clientCert, KeyFile: s.clientKey, CAFile: s.ca.file}
	root, err := s.admin.New(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for _, step := range []func() error{
		func() error { _, err := root.RoleAdd(ctx, "latentmesh-agent"); return err },
		func() error {
			_, err := root.RoleGrantPermission(ctx, "latentmesh-agent", prefix+"/", clientv3.GetPrefixRangeEnd(prefix+"/"),
				clientv3.PermissionType(clientv3.PermReadWrite))
			return err
		},
		func() error { _, err := root.UserAdd(ctx, "agent", s.password); return err },
		func() error { _, err := root.UserGrantRole(ctx, "agent", "latentmesh-agent"); return err },
		func() error { _, err := root.UserAdd(ctx, "root", "root-secret"); return err },
		func() error { _, err := root.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := root.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	s.agent = s.admin
	s.agent.Username, s.agent.Password = "agent", s.password
	return s
}

// An agent runs against an etcd that requires TLS client certificates and
// has auth enabled, as a user whose role only reaches the mesh's prefix;
// a client whose certificate etcd does not trust, or that does not trust
// etcd's, is refused with an error that says which.
func TestAgentOnSecuredEtcd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const prefix = "/latentmesh/secure"
	sec := startSecuredEtcd(t, ctx, prefix)
	eps := sec.Endpoints()
	ca, rogue := sec.ca, sec.rogue
	clientCert, clientKey, rogueCert, rogueKey := sec.clientCert, sec.clientKey, sec.rogueCert, sec.rogueKey
	agentClient := sec.agent
	// Least privilege holds: the agent user cannot read outside its prefix.
	cli, err := agentClient.New(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Get(ctx, "/elsewhere"); !isEtcdErr(err, rpctypes.ErrPermissionDenied) {
		t.Fatalf("read outside the prefix: %v, want permission denied", err)
	}
	// The calls outside the key space that an agent makes work for it:
	// the alarm list (jobs.AlarmWatcher), and leases (registration,
	// retention) with keys under the prefix, revoked.
	if _, err := cli.AlarmList(ctx); err != nil {
		t.Fatalf("alarm list as the agent user: %v", err)
	}
	lease, err := cli.Grant(ctx, 5)
	if err != nil {
		t.Fatalf("lease grant as the agent user: %v", err)
	}
	if _, err := cli.KeepAliveOnce(ctx, lease.ID); err != nil {
		t.Fatalf("lease keepalive as the agent user: %v", err)
	}
	if _, err := cli.Put(ctx, prefix+"/nodes/x", "v", clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, lease.ID); err != nil {
		t.Fatalf("lease revoke as the agent user: %v", err)
	}
	cli.Close()

	cl := startCluster(t, Colocated, func(c *ClusterConfig) {
		c.EtcdEndpoints = eps
		c.EtcdClient = agentClient
		c.Agent.Prefix = prefix
	})
	a := cl.Agents[0]
	j, err := a.Submit(ctx, engine.Spec{Prompt: "behind TLS and auth", Seed: 1, Width: 64, Height: 64, Steps: 2}.WithDefaults(), jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	defer wcancel()
	done, err := a.Wait(wctx, j.ID)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v, %v", done, err)
	}
	if data, _, err := a.Result(ctx, j.ID); err != nil || len(data) == 0 {
		t.Fatalf("result: %d bytes, %v", len(data), err)
	}
	// Ready as that user (lease held, alarm poll answered).
	eventually(t, 10*time.Second, func() error {
		code, body, _ := getJSON(t, "http://"+a.AdminAddr()+"/readyz", nil)
		if code != 200 {
			return errorf("readyz %d %s", code, body)
		}
		return nil
	})

	// Refused, and saying why.
	for _, c := range []struct {
		name string
		cfg  EtcdClientConfig
		want string
	}{
		{"client certificate from another CA", EtcdClientConfig{CertFile: rogueCert, KeyFile: rogueKey, CAFile: ca.file}, "refused this client's certificate"},
		{"no client certificate", EtcdClientConfig{CAFile: ca.file}, "refused this client's certificate"},
		{"server certificate not from the CA", EtcdClientConfig{CertFile: clientCert, KeyFile: clientKey, CAFile: rogue.file}, "its certificate is not trusted"},
		{"plain http to a TLS etcd", EtcdClientConfig{Endpoints: []string{strings.Replace(eps[0], "https", "http", 1)}, CertFile: clientCert, KeyFile: clientKey, CAFile: ca.file}, "must be https://"},
	} {
		if c.cfg.Endpoints == nil {
			c.cfg.Endpoints = eps
		}
		cli, err := c.cfg.New(ctx)
		if err == nil {
			cli.Close()
			t.Fatalf("%s: connected", c.name)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Fatalf("%s: %v, want %q", c.name, err, c.want)
		}
		t.Logf("%s: %v", c.name, err)
	}
	// A wrong password connects but every request says so.
	bad := agentClient
	bad.Password = "guess"
	if cli, err := bad.New(ctx); err == nil {
		_, err = cli.Get(ctx, prefix+"/nodes/")
		cli.Close()
		if !isEtcdErr(err, rpctypes.ErrAuthFailed) {
			t.Fatalf("wrong password: %v", err)
		}
		t.Logf("wrong password: %v", err)
	} else if !strings.Contains(err.Error(), "authentication failed") {
		t.Fatalf("wrong password: %v", err)
	} else {
		t.Logf("wrong password: %v", err)
	}
}

func isEtcdErr(err, target error) bool {
	return err != nil && (errors.Is(err, target) || errors.Is(rpctypes.Error(err), target))
}
