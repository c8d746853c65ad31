package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/gossip"
)

// testCert writes a self-signed certificate for 127.0.0.1 with the given
// serial, and its key, to certFile and keyFile (renamed into place, as
// certificate tools replace theirs), and returns the certificate's PEM.
func testCert(t *testing.T, serial int64, certFile, keyFile string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "latentmesh agent"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true, IsCA: true, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	for path, data := range map[string][]byte{keyFile: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), certFile: certPEM} {
		if err := os.WriteFile(path+".new", data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".new", path); err != nil {
			t.Fatal(err)
		}
	}
	return certPEM
}

// lockedBuffer is an io.Writer two goroutines may share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// `latentmesh agent --tls-cert --tls-key` serves its client API and admin
// endpoint over HTTPS; generate and status reach them with --ca-file; a
// certificate replaced on disk is served from the next handshake, with no
// restart.
func TestAgentServesTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts an etcd and an agent")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	etcd, err := etcdembed.Start(ctx, etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	cli := etcd.Client(nil)
	defer cli.Close()

	dir := t.TempDir()
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.pem")
	cert1 := testCert(t, 1, certFile, keyFile)
	tokenFile := writeFile(t, filepath.Join(dir, "admin-token"), "adm1n\n")
	const prefix = "/tlstest"
	config := writeFile(t, filepath.Join(dir, "agent.yaml"), strings.Join([]string{
		"etcd-endpoints: [" + etcd.Endpoints()[0] + "]",
		"prefix: " + prefix,
		"http: 127.0.0.1:0",
		"admin: 127.0.0.1:0",
		"state-dir: ''",
		"arena-size: 64MiB",
		"tls-cert: " + certFile,
		"tls-key: " + keyFile,
		"admin-token-file: " + tokenFile,
		"log-format: console",
	}, "\n")+"\n")

	var agentOut lockedBuffer
	exited := make(chan int, 1)
	agentCtx, stopAgent := context.WithCancel(ctx)
	defer stopAgent()
	go func() { exited <- run(agentCtx, []string{"agent", "--config", config}, &agentOut, &agentOut) }()
	rec := waitRegistered(t, ctx, cli, prefix, exited, &agentOut)

	// The client trusts only the first certificate for now.
	if err := os.WriteFile(caFile, cert1, 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCmd("status", "--admin", "https://"+rec.AdminAddr, "--ca-file", caFile, "--token-file", tokenFile)
	if code != 0 || !strings.Contains(out, "node "+rec.ID) {
		t.Fatalf("status over HTTPS: exit %d\n%s%s", code, out, errOut)
	}
	if code, _, errOut := runCmd("status", "--admin", "https://"+rec.AdminAddr, "--token-file", tokenFile); code != 1 || !strings.Contains(errOut, "certificate") {
		t.Fatalf("status without the CA: exit %d %q, want a certificate error", code, errOut)
	}
	if code, _, errOut := runCmd("status", "--admin", "http://"+rec.AdminAddr, "--token-file", tokenFile); code != 1 || !strings.Contains(errOut, "400") {
		t.Fatalf("plain HTTP to the TLS endpoint: exit %d %q, want the server's 400", code, errOut)
	}
	png := filepath.Join(dir, "fox.png")
	code, out, errOut = runCmd("generate", "--server", "https://"+rec.HTTPAddr, "--ca-file", caFile,
		"--prompt", "a red fox", "--size", "64x64", "--steps", "2", "-o", png)
	if code != 0 {
		t.Fatalf("generate over HTTPS: exit %d\n%s%s", code, out, errOut)
	}
	if b, err := os.ReadFile(png); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG")) {
		t.Fatalf("generate wrote %d bytes (%v), want a PNG", len(b), err)
	}

	// Replace the certificate: the next handshake on either endpoint gets it.
	cert2 := testCert(t, 2, certFile, keyFile)
	if err := os.WriteFile(caFile, append(append([]byte{}, cert1...), cert2...), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, addr := range []string{rec.AdminAddr, rec.HTTPAddr} {
		if s := servedSerial(t, addr, caFile); s != 2 {
			t.Fatalf("%s serves serial %d after the files were replaced, want 2", addr, s)
		}
	}
	if code, out, errOut := runCmd("status", "--admin", "https://"+rec.AdminAddr, "--ca-file", caFile, "--token-file", tokenFile); code != 0 {
		t.Fatalf("status after the certificate changed: exit %d\n%s%s", code, out, errOut)
	}

	stopAgent()
	select {
	case code := <-exited:
		if code != 0 {
			t.Fatalf("agent exit %d:\n%s", code, agentOut.String())
		}
	case <-ctx.Done():
		t.Fatalf("agent did not stop:\n%s", agentOut.String())
	}
}

// waitRegistered waits for the agent's node record under prefix.
func waitRegistered(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix string, exited <-chan int, out *lockedBuffer) gossip.NodeRecord {
	t.Helper()
	key := prefix + "/nodes/"
	resp, err := cli.Get(ctx, key, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wch := cli.Watch(wctx, key, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	kvs := resp.Kvs
	for {
		for _, kv := range kvs {
			var rec gossip.NodeRecord
			if err := json.Unmarshal(kv.Value, &rec); err != nil {
				t.Fatalf("node record %s: %v", kv.Key, err)
			}
			if rec.AdminAddr != "" && rec.HTTPAddr != "" {
				return rec
			}
		}
		kvs = nil
		select {
		case w, ok := <-wch:
			if !ok || w.Err() != nil {
				t.Fatalf("watch: %v", w.Err())
			}
			for _, ev := range w.Events {
				if ev.Type == clientv3.EventTypePut {
					kvs = append(kvs, ev.Kv)
				}
			}
		case code := <-exited:
			t.Fatalf("agent exited %d before registering:\n%s", code, out.String())
		case <-ctx.Done():
			t.Fatalf("agent did not register:\n%s", out.String())
		}
	}
}

// servedSerial is the serial of the certificate addr presents in a new
// handshake, verified against caFile.
func servedSerial(t *testing.T, addr, caFile string) int64 {
	t.Helper()
	pool := x509.NewCertPool()
	b, err := os.ReadFile(caFile)
	if err != nil || !pool.AppendCertsFromPEM(b) {
		t.Fatalf("CA file: %v", err)
	}
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Int64()
}
