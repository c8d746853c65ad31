package httpapi

import (
	"net/http"
	"time"

	"go.uber.org/zap"
)

// ServerConfig bounds what one client can hold of a server: the time to
// send a request, to read an answer, to sit idle, the header size, and the
// number of requests served at once. Handlers that legitimately outlive
// WriteTimeout (long polls, event streams, synchronous generation) move
// their own connection's deadlines (http.ResponseController); every other
// handler is bounded by it.
type ServerConfig struct {
	ReadHeaderTimeout time.Duration // from accept (or the end of the last request) to the end of the headers
	ReadTimeout       time.Duration // the whole request, body included
	WriteTimeout      time.Duration // from the end of the headers to the end of the answer
	IdleTimeout       time.Duration // a keep-alive connection with no request in flight
	MaxHeaderBytes    int           // request line and headers
	// MaxInFlight caps the requests served at once; one more is answered
	// 503 overloaded with Retry-After at once. 0 means no cap.
	MaxInFlight int
}

// DefaultServerConfig returns a ServerConfig with every field set.
func DefaultServerConfig() ServerConfig {
	return ServerConfig{
		ReadHeaderTimeout: 5 * time.Second,  // headers are a few hundred bytes; a slowloris gets no more
		ReadTimeout:       15 * time.Second, // bodies are at most 64 KiB: seconds even on a bad link
		WriteTimeout:      30 * time.Second, // answers are small; a result is a few MiB at most
		IdleTimeout:       60 * time.Second, // keeps a polling client's connection, not a forgotten one
		MaxHeaderBytes:    16 << 10,         // a bearer token and the usual headers fit many times over
		MaxInFlight:       512,              // each in-flight request costs a goroutine and an etcd call or watch
	}
}

// withDefaults fills unset (zero or negative) fields from DefaultServerConfig.
func (c ServerConfig) withDefaults() ServerConfig {
	d := DefaultServerConfig()
	if c.ReadHeaderTimeout <= 0 {
		c.ReadHeaderTimeout = d.ReadHeaderTimeout
	}
	if c.ReadTimeout <= 0 {
		c.ReadTimeout = d.ReadTimeout
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = d.WriteTimeout
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	if c.MaxHeaderBytes <= 0 {
		c.MaxHeaderBytes = d.MaxHeaderBytes
	}
	if c.MaxInFlight < 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	return c
}

// NewServer returns an http.Server for h with sc's timeouts and header
// limit (unset fields take their defaults). The in-flight cap is applied by
// the handlers themselves (NewHandler, NewAdminHandler), which know it.
func NewServer(h http.Handler, sc ServerConfig, log *zap.Logger) *http.Server {
	sc = sc.withDefaults()
	if log == nil {
		log = zap.NewNop()
	}
	// What net/http logs (a client's bad TLS handshake, a timed-out read)
	// is a client's doing, not ours: kept for debugging only.
	errLog, _ := zap.NewStdLogAt(log.Named("http"), zap.DebugLevel) // fails only for levels above Fatal
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: sc.ReadHeaderTimeout,
		ReadTimeout:       sc.ReadTimeout,
		WriteTimeout:      sc.WriteTimeout,
		IdleTimeout:       sc.IdleTimeout,
		MaxHeaderBytes:    sc.MaxHeaderBytes,
		ErrorLog:          errLog,
	}
}

// limitInFlight answers 503 overloaded, without queueing, once n requests
// are being served. n <= 0 means no cap.
func limitInFlight(n int, m *Metrics, next http.Handler) http.Handler {
	if n <= 0 {
		return next
	}
	sem := make(chan struct{}, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case sem <- struct{}{}:
		default:
			e := apiErr(http.StatusServiceUnavailable, typeServer, CodeOverloaded,
				"this agent is serving %d requests already; retry shortly or use another agent", n)
			e.RetryAfter = 1
			writeError(w, e)
			if m != nil {
				m.observeRequest("overloaded", http.StatusServiceUnavailable)
			}
			return
		}
		defer func() { <-sem }()
		next.ServeHTTP(w, r)
	})
}

// holdOpen lets a handler that waits on purpose (a long poll, synchronous
// generation) answer up to d from now: it lifts the read deadline, which
// would otherwise fire mid-wait and cancel the request (the body, if any,
// is read by now), and moves the write deadline to d plus the usual
// WriteTimeout for the answer itself.
func (s *server) holdOpen(w http.ResponseWriter, d time.Duration) {
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Time{}) // ErrNotSupported under httptest's recorder
	_ = rc.SetWriteDeadline(time.Now().Add(d + s.cfg.Server.WriteTimeout))
}
