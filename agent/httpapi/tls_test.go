package httpapi

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
)

// selfSigned returns a PEM certificate for 127.0.0.1 and localhost with
// the given serial, and its PEM key.
func selfSigned(t *testing.T, serial int64) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial),
		Subject:               pkix.Name{CommonName: "latentmesh test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		DNSNames:              []string{"localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// replaceFile puts data at path the way certificate tools do: written
// beside it, then renamed over it.
func replaceFile(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// A server on the reloader serves HTTPS with the files' pair, and the
// pair that replaced it from the next handshake on, with no restart; a
// replacement that does not load leaves the last good pair served.
func TestCertReloaderServesReplacedCert(t *testing.T) {
	dir := t.TempDir()
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "ca.pem")
	cert1, key1 := selfSigned(t, 1)
	cert2, key2 := selfSigned(t, 2)
	replaceFile(t, certFile, cert1)
	replaceFile(t, keyFile, key1)
	replaceFile(t, caFile, append(append([]byte{}, cert1...), cert2...)) // the client trusts both

	r, err := NewCertReloader(certFile, keyFile, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }), DefaultServerConfig(), nil)
	srv.TLSConfig = r.ServerConfig()
	served := make(chan error, 1)
	go func() { served <- srv.ServeTLS(ln, "", "") }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve: %v", err)
		}
	})

	tc, err := ClientTLS(caFile)
	if err != nil {
		t.Fatal(err)
	}
	// A connection per request: each one is a handshake.
	tr := &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	url := "https://" + ln.Addr().String() + "/"
	servedSerial := func() int64 {
		t.Helper()
		resp, err := (&http.Client{Transport: tr}).Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
			t.Fatalf("body %q", b)
		}
		if resp.ProtoMajor != 2 {
			t.Errorf("served %s, want HTTP/2 offered", resp.Proto)
		}
		return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
	}
	if s := servedSerial(); s != 1 {
		t.Fatalf("served serial %d, want 1", s)
	}

	replaceFile(t, keyFile, key2)
	replaceFile(t, certFile, cert2)
	if s := servedSerial(); s != 2 {
		t.Fatalf("after replacing the files: serial %d, want 2", s)
	}

	replaceFile(t, certFile, []byte("-----BEGIN CERTIFICATE-----\ntruncated"))
	if s := servedSerial(); s != 2 {
		t.Fatalf("after a broken replacement: serial %d, want the last good pair (2)", s)
	}
	if err := r.Reload(); err == nil || !strings.Contains(err.Error(), certFile) {
		t.Fatalf("Reload of a broken pair: %v, want an error naming %s", err, certFile)
	}
	if s := servedSerial(); s != 2 {
		t.Fatalf("after a failed Reload: serial %d, want 2", s)
	}

	// Without the CA the client refuses the self-signed certificate.
	plain := &http.Transport{TLSClientConfig: &tls.Config{}, DisableKeepAlives: true}
	if _, err := (&http.Client{Transport: plain}).Get(url); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a client without the CA: %v, want a certificate error", err)
	}
}

func TestTLSFileErrors(t *testing.T) {
	dir := t.TempDir()
	cert, _ := selfSigned(t, 1)
	_, otherKey := selfSigned(t, 2)
	certFile, keyFile := filepath.Join(dir, "c.pem"), filepath.Join(dir, "k.pem")
	replaceFile(t, certFile, cert)
	replaceFile(t, keyFile, otherKey)
	if _, err := NewCertReloader(certFile, keyFile, nil); err == nil || !strings.Contains(err.Error(), "private key does not match") {
		t.Fatalf("mismatched key: %v", err)
	}
	if _, err := NewCertReloader(certFile, "", nil); err == nil || !strings.Contains(err.Error(), "both") {
		t.Fatalf("no key file: %v", err)
	}
	if _, err := ClientTLS(filepath.Join(dir, "missing.pem")); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("missing CA file: %v", err)
	}
	if _, err := ClientTLS(keyFile); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Fatalf("a key as CA file: %v", err)
	}
	if c, err := ClientTLS(""); err != nil || c.RootCAs != nil {
		t.Fatalf("no CA file: %v, %v (want system roots)", c, err)
	}
}
