package testbed

import (
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// testWriter sends log lines to t.Log until the test's cleanups have run.
// Libraries (memberlist, grpc) may log from timers a moment after Close;
// zaptest would panic on those lines, this drops them.
type testWriter struct {
	mu   sync.Mutex // guards done, and orders Write against the end of the test
	t    testing.TB
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

func (w *testWriter) Sync() error { return nil }

// testLogger logs at info level to the test. Register it before anything
// that logs, so its cleanup runs last.
func testLogger(t testing.TB) *zap.Logger {
	w := &testWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	enc := zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig())
	return zap.New(zapcore.NewCore(enc, w, zap.InfoLevel))
}
