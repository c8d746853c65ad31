package httpapi

import (
	"context"
	"crypto/subtle"
	"net/http"
	"net/http/pprof"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/httpapi/statuspage"
)

// AdminConfig configures the admin endpoint. Nil funcs and a nil Metrics
// handler leave their endpoint out (404), except Live and Ready, which
// report ok when nil.
type AdminConfig struct {
	Live   func() error                           // /livez: the process can make progress
	Ready  func() error                           // /readyz: the agent should get traffic
	Status func(ctx context.Context) (any, error) // /v1/admin/status, served as JSON
	// Store serves /v1/admin/store[?job=ID][&objects=true]: the Store's
	// summary (a job's objects only, with job), with the records listed
	// when objects is true.
	Store func(ctx context.Context, job string, objects bool) (any, error)
	// Jobs serves /v1/admin/jobs[?limit=N]: the last jobs the agent saw,
	// newest first, at most N (default 20, at most MaxAdminJobs).
	Jobs func(ctx context.Context, limit int) (any, error)
	// Drain serves POST /v1/admin/drain[?wait=true]: the agent stops
	// taking work and leaves once its running tasks are done or requeued.
	// With wait it returns when the drain has finished (the process then
	// exits), else at once (202).
	Drain   func(ctx context.Context, wait bool) error
	Metrics http.Handler // /metrics, e.g. Metrics.Handler()
	Token   string       // when set, every path but /livez needs "Authorization: Bearer <Token>"
	// Tokens' admin tokens are accepted too (and alone turn the check on).
	Tokens *Tokens
	// Server holds the timeouts and in-flight cap; see DefaultAdminServerConfig.
	Server ServerConfig
	Logger *zap.Logger
}

// MaxAdminJobs is the most jobs /v1/admin/jobs lists; defaultAdminJobs
// how many without ?limit.
const (
	MaxAdminJobs     = 64
	defaultAdminJobs = 20
)

// DefaultAdminServerConfig is DefaultServerConfig with room for CPU
// profiles and traces: net/http/pprof refuses a profile as long as the
// server's WriteTimeout, and operators commonly take 30 s ones.
func DefaultAdminServerConfig() ServerConfig {
	c := DefaultServerConfig()
	c.WriteTimeout = 2 * time.Minute // a 30 s or 60 s profile, then writing it
	c.MaxInFlight = 32               // one operator and a scraper or two
	return c
}

// NewAdminHandler returns the admin endpoint: probes, metrics, status, the
// status page under /ui/ (package statuspage) and net/http/pprof under
// /debug/pprof/, all on a private mux.
func NewAdminHandler(cfg AdminConfig) http.Handler {
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	log = log.Named("admin")

	mux := http.NewServeMux()
	handle := func(pattern string, h http.Handler) {
		mux.Handle(pattern, instrument(log, nil, pattern, h))
	}
	handle("GET /livez", probe(cfg.Live))
	// The status page's own files carry no data: they load without the
	// token, then ask for it and send it with every read.
	handle("GET /ui/", http.StripPrefix("/ui", statuspage.Handler()))
	handle("GET /{$}", http.RedirectHandler("/ui/", http.StatusFound))
	// Everything below may need the token.
	auth := func(h http.Handler) http.Handler { return requireToken(cfg.Token, cfg.Tokens, h) }
	handle("GET /readyz", auth(probe(cfg.Ready)))
	if cfg.Metrics != nil {
		handle("GET /metrics", auth(cfg.Metrics))
	}
	if cfg.Status != nil {
		handle("GET /v1/admin/status", auth(statusHandler(log, cfg.Status)))
	}
	if cfg.Store != nil {
		handle("GET /v1/admin/store", auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			q := r.URL.Query()
			job := q.Get("job")
			if job != "" && !validID(job) {
				writeError(w, apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"job", "job: %q is not a job id", job))
				return
			}
			objects, _ := strconv.ParseBool(q.Get("objects"))
			statusHandler(log, func(ctx context.Context) (any, error) { return cfg.Store(ctx, job, objects) }).ServeHTTP(w, r)
		})))
	}
	if cfg.Jobs != nil {
		handle("GET /v1/admin/jobs", auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			limit := defaultAdminJobs
			if v := r.URL.Query().Get("limit"); v != "" {
				n, err := strconv.Atoi(v)
				if err != nil || n < 1 || n > MaxAdminJobs {
					writeError(w, apiErr(http.StatusBadRequest, typeInvalidRequest, codeInvalidFieldPrefix+"limit", "limit: %q is not a number in [1,%d]", v, MaxAdminJobs))
					return
				}
				limit = n
			}
			statusHandler(log, func(ctx context.Context) (any, error) { return cfg.Jobs(ctx, limit) }).ServeHTTP(w, r)
		})))
	}
	if cfg.Drain != nil {
		handle("POST /v1/admin/drain", auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			wait, _ := strconv.ParseBool(r.URL.Query().Get("wait"))
			if err := cfg.Drain(r.Context(), wait); err != nil {
				writeError(w, apiErr(http.StatusServiceUnavailable, typeServer, CodeUnavailable, "drain: %v", err))
				return
			}
			if !wait {
				writeJSON(w, http.StatusAccepted, map[string]string{"state": "draining"})
				return
			}
			writeJSON(w, http.StatusOK, map[string]string{"state": "drained"})
		})))
	}
	handle("/debug/pprof/", auth(http.HandlerFunc(pprof.Index)))
	handle("/debug/pprof/cmdline", auth(http.HandlerFunc(pprof.Cmdline)))
	handle("/debug/pprof/profile", auth(http.HandlerFunc(pprof.Profile)))
	handle("/debug/pprof/symbol", auth(http.HandlerFunc(pprof.Symbol)))
	handle("/debug/pprof/trace", auth(http.HandlerFunc(pprof.Trace)))
	handle("/", auth(http.HandlerFunc(notFound)))
	sc := cfg.Server
	if sc == (ServerConfig{}) {
		sc = DefaultAdminServerConfig()
	}
	return limitInFlight(sc.withDefaults().MaxInFlight, nil, mux)
}

// probe answers 200 "ok" while check passes and 503 with its reason when
// it does not.
func probe(check func() error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if check != nil {
			if err := check(); err != nil {
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = w.Write([]byte(err.Error() + "\n"))
				return
			}
		}
		_, _ = w.Write([]byte("ok\n"))
	})
}

func statusHandler(log *zap.Logger, status func(context.Context) (any, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
		defer cancel()
		v, err := status(ctx)
		if err != nil {
			log.Warn("status", zap.Error(err))
			writeError(w, apiErr(http.StatusServiceUnavailable, typeServer, CodeUnavailable, "status: %v", err))
			return
		}
		writeJSON(w, http.StatusOK, v)
	})
}

// requireToken passes requests carrying the bearer token or one of tokens'
// admin tokens; with neither set it lets everything through.
func requireToken(token string, tokens *Tokens, next http.Handler) http.Handler {
	if tokens != nil && !tokens.HasAdmin() {
		tokens = nil
	}
	if token == "" && tokens == nil {
		return next
	}
	want := []byte(token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, ok := bearer(r)
		admin := false
		if ok && tokens != nil {
			c, known := tokens.lookup(got)
			admin = known && c.admin
		}
		if !ok || (!admin && (token == "" || subtle.ConstantTimeCompare([]byte(got), want) != 1)) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="latentmesh-admin"`)
			writeError(w, apiErr(http.StatusUnauthorized, typeAuth, CodeUnauthorized, "missing or wrong bearer token"))
			return
		}
		next.ServeHTTP(w, r)
	})
}
