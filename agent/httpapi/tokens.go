package httpapi

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/latentmesh/latentmesh/agent/jobs"
)

// minTokenLen refuses tokens short enough to guess.
const minTokenLen = 16

// Tokens are the bearer tokens the client API accepts. A job records the
// hash of the token that created it and is visible only to that token and
// to admin tokens. Build with ParseTokens or LoadTokens.
type Tokens struct {
	byHash map[string]bool // token hash -> admin
}

// LoadTokens reads a token file (see ParseTokens).
func LoadTokens(path string) (*Tokens, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("httpapi: tokens: %w", err)
	}
	defer f.Close()
	t, err := ParseTokens(f)
	if err != nil {
		return nil, fmt.Errorf("httpapi: tokens %s: %w", path, err)
	}
	return t, nil
}

// ParseTokens reads one token per line; "admin:" before a token makes it
// an admin token. Blank lines and lines starting with # are skipped.
// Tokens shorter than 16 bytes, or containing spaces, are refused.
func ParseTokens(r io.Reader) (*Tokens, error) {
	t := &Tokens{byHash: map[string]bool{}}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		tok, admin := strings.CutPrefix(line, "admin:")
		if len(tok) < minTokenLen || strings.ContainsAny(tok, " \t") {
			return nil, fmt.Errorf("line %d: a token needs at least %d bytes and no spaces", n, minTokenLen)
		}
		t.byHash[TokenHash(tok)] = admin
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(t.byHash) == 0 {
		return nil, fmt.Errorf("no tokens")
	}
	return t, nil
}

// TokenHash is what a job records of the token that created it.
func TokenHash(token string) string {
	h := sha256.Sum256([]byte(token))
	return hex.EncodeToString(h[:])
}

// HasAdmin reports whether any token is an admin token.
func (t *Tokens) HasAdmin() bool {
	for _, admin := range t.byHash {
		if admin {
			return true
		}
	}
	return false
}

// lookup returns the caller a presented token stands for.
func (t *Tokens) lookup(token string) (caller, bool) {
	h := TokenHash(token)
	admin, ok := t.byHash[h]
	return caller{owner: h, admin: admin}, ok
}

// caller is who sent a request, when tokens are on.
type caller struct {
	owner string // TokenHash of the caller's token
	admin bool
}

type callerKey struct{}

func callerOf(ctx context.Context) (caller, bool) {
	c, ok := ctx.Value(callerKey{}).(caller)
	return c, ok
}

// bearer returns the request's bearer token.
func bearer(r *http.Request) (string, bool) {
	v, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	v = strings.TrimSpace(v)
	return v, ok && v != ""
}

// authenticate admits requests that carry a known bearer token (401
// otherwise) and limits each token to its rate (429 with Retry-After).
func authenticate(t *Tokens, perSec float64, burst int, m *Metrics, next http.Handler) http.Handler {
	var mu sync.Mutex // guards limiters
	limiters := map[string]*rate.Limiter{}
	limiter := func(owner string) *rate.Limiter {
		mu.Lock()
		defer mu.Unlock()
		l, ok := limiters[owner] // bounded: one per token in the file
		if !ok {
			l = rate.NewLimiter(rate.Limit(perSec), burst)
			limiters[owner] = l
		}
		return l
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := bearer(r)
		c, known := t.lookup(tok)
		if !ok || !known {
			w.Header().Set("WWW-Authenticate", `Bearer realm="latentmesh"`)
			writeError(w, apiErr(http.StatusUnauthorized, typeAuth, CodeUnauthorized, "missing or unknown bearer token"))
			if m != nil {
				m.observeRequest("unauthorized", http.StatusUnauthorized)
			}
			return
		}
		if perSec > 0 {
			res := limiter(c.owner).ReserveN(time.Now(), 1)
			if d := res.Delay(); d > 0 {
				res.Cancel() // a refused request spends no token
				e := apiErr(http.StatusTooManyRequests, typeServer, CodeRateLimited,
					"this token is limited to %g requests a second; retry in %v", perSec, d.Round(time.Millisecond))
				e.RetryAfter = int(math.Ceil(d.Seconds()))
				writeError(w, e)
				if m != nil {
					m.observeRequest("rate_limited", http.StatusTooManyRequests)
				}
				return
			}
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, c)))
	})
}

// mayAccess reports whether the request's caller may see job: always
// without tokens; else an admin, or the token that created it.
func mayAccess(r *http.Request, job jobs.Job) bool {
	c, ok := callerOf(r.Context())
	return !ok || c.admin || (job.Owner != "" && job.Owner == c.owner)
}

// owner is what a job submitted by this request records.
func owner(r *http.Request) string {
	c, _ := callerOf(r.Context())
	return c.owner
}
