package transfer

import (
	"context"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// newHost starts a TCP-only loopback libp2p host with everything optional off.
func newHost(t testing.TB) host.Host {
	t.Helper()
	h, err := NewHost("/ip4/127.0.0.1/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// testConfig is DefaultConfig with a test logger and short timeouts.
func testConfig(t testing.TB) Config {
	cfg := DefaultConfig()
	if tt, ok := t.(*testing.T); ok {
		cfg.Logger = zaptest.NewLogger(tt)
	}
	cfg.IOTimeout = 2 * time.Second
	return cfg
}

// startService starts a Service on a fresh host, closed at test end.
func startService(t testing.TB, cfg Config) *Service {
	t.Helper()
	return startServiceClock(t, cfg, time.Now)
}

func startServiceClock(t testing.TB, cfg Config, now func() time.Time) *Service {
	t.Helper()
	s, err := newService(cfg, newHost(t), now)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}
