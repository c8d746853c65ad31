package main

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/httpapi"
)

// reloadOnHangup reads the agent's certificate again on each SIGHUP (a
// changed file is read at the next handshake anyway; SIGHUP is for the
// operator who wants it now, and to be told if it does not load). Without
// a certificate (certs nil) a SIGHUP is logged and ignored, so that
// `systemctl reload` never kills the agent. The returned func stops it and
// waits for it.
func reloadOnHangup(ctx context.Context, certs *httpapi.CertReloader, log *zap.Logger) (stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				if certs == nil {
					log.Info("SIGHUP: nothing to reload (no --tls-cert)")
				} else if err := certs.Reload(); err != nil {
					log.Warn("SIGHUP: certificate not reloaded; serving the previous pair", zap.Error(err))
				}
			}
		}
	})
	return func() {
		signal.Stop(hup)
		cancel()
		wg.Wait()
	}
}

// adminFlags are how the client commands (status, drain, store) reach an
// agent's admin endpoint: its URL, its token, and the CA of an HTTPS one.
type adminFlags struct {
	url, token, tokenFile, caFile string
}

func (f *adminFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.url, "admin", "http://127.0.0.1:9090", "the agent's admin `URL` (https:// when the agent has --tls-cert)")
	fs.StringVar(&f.token, "token", "", "admin bearer token, when the agent requires one (prefer --token-file)")
	fs.StringVar(&f.tokenFile, "token-file", "", "`FILE` holding the admin bearer token (first line)")
	fs.StringVar(&f.caFile, "ca-file", "", "CA `FILE` (PEM) that signed the agent's certificate (default: system roots)")
}

// client returns the token to send and an HTTP client that trusts the CA
// file; its transport is the caller's to close.
func (f *adminFlags) client() (string, *http.Client, error) {
	token, err := secret("token", f.token, f.tokenFile)
	if err != nil {
		return "", nil, err
	}
	tc, err := httpapi.ClientTLS(f.caFile)
	if err != nil {
		return "", nil, fmt.Errorf("--ca-file: %w", err)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = tc
	return token, &http.Client{Transport: tr}, nil
}
