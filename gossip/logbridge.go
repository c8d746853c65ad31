package gossip

import (
	"bytes"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// logBridge routes memberlist's standard-library log lines into zap, picks
// out the one line that says this node suspects a peer, and bounds how many
// lines reach the log: memberlist logs a line for every bad packet, and
// packets are what an attacker on the gossip port controls.
type logBridge struct {
	m     *Membership
	log   *zap.Logger
	limit logLimiter
}

func newLogBridge(m *Membership) *logBridge {
	return &logBridge{
		m:     m,
		log:   m.log.Named("memberlist"),
		limit: logLimiter{limit: m.cfg.LogLimit, every: m.cfg.LogLimitEvery, now: time.Now},
	}
}

var suspectPrefix = []byte("memberlist: Suspect ")

// refusals are memberlist's words for a message it dropped before decoding
// it, and what they mean to an operator. memberlist's own lines ("Decrypt
// packet failed: no installed keys could decrypt the message from=...")
// read as internal errors; a node started with the wrong --gossip-keyring
// shows up only as these.
var refusals = []struct {
	text   []byte
	reason string
}{
	{[]byte("no installed keys could decrypt the message"), "wrong gossip key: none of this node's keys decrypts it"},
	{[]byte("remote state is not encrypted"), "not encrypted, and this node's gossip is"},
	{[]byte("unsupported encryption version"), "not encrypted (or corrupt), and this node's gossip is"},
	{[]byte("payload is too small to decrypt"), "not encrypted (or truncated), and this node's gossip is"},
	{[]byte("remote state is encrypted and encryption is not configured"), "encrypted, and this node has no gossip key"},
	{[]byte("with unacceptable label"), "another mesh's label (etcd prefix)"},
}

var fromMarker = []byte("from=")

// refusal returns why memberlist dropped the message msg reports, and who
// sent it, or ok false when msg is not such a line.
func refusal(msg []byte) (reason, from string, ok bool) {
	for _, r := range refusals {
		if bytes.Contains(msg, r.text) {
			if i := bytes.LastIndex(msg, fromMarker); i >= 0 {
				from = string(bytes.TrimSpace(msg[i+len(fromMarker):]))
			}
			return r.reason, from, true
		}
	}
	return "", "", false
}

func (b *logBridge) Write(p []byte) (int, error) {
	if b.m.ctx.Err() != nil {
		// Closing: memberlist's in-flight probes outlive Shutdown by a moment
		// and only report the sockets we just closed. Their owner (a test's
		// logger, say) may already be gone.
		return len(p), nil
	}
	line := bytes.TrimSpace(p)
	level, msg := zapcore.InfoLevel, line
	if len(line) > 0 && line[0] == '[' {
		if i := bytes.IndexByte(line, ']'); i > 0 {
			switch string(line[1:i]) {
			case "DEBUG":
				level = zapcore.DebugLevel
			case "WARN":
				level = zapcore.WarnLevel
			case "ERR", "ERROR":
				level = zapcore.ErrorLevel
			}
			msg = bytes.TrimSpace(line[i+1:])
		}
	}
	if rest, ok := bytes.CutPrefix(msg, suspectPrefix); ok {
		if name, _, ok := bytes.Cut(rest, []byte(" has failed")); ok {
			b.m.suspected(string(name))
		}
	}
	if !b.log.Core().Enabled(level) {
		return len(p), nil // not counted against the limit
	}
	ok, held := b.limit.allow()
	if held > 0 {
		b.logHeld(held)
	}
	if !ok {
		return len(p), nil
	}
	if reason, from, refused := refusal(msg); refused {
		// A copy: memberlist's logger reuses p for its next line, and a
		// core may keep fields after Write returns (zap's observer does).
		b.log.Warn("gossip message refused", zap.String("from", from), zap.String("reason", reason),
			zap.String("memberlist", string(msg)))
	} else if ce := b.log.Check(level, string(msg)); ce != nil {
		ce.Write()
	}
	return len(p), nil
}

// flush logs the count of lines held back in the current interval; Close
// calls it so a flood that ended is still reported.
func (b *logBridge) flush() {
	if held := b.limit.take(); held > 0 {
		b.logHeld(held)
	}
}

func (b *logBridge) logHeld(n int) {
	b.log.Warn("memberlist log lines suppressed", zap.Int("lines", n), zap.Duration("interval", b.limit.every))
}

// logLimiter lets limit lines through per interval of length every,
// counting the rest.
type logLimiter struct {
	limit int
	every time.Duration
	now   func() time.Time

	// mu guards the fields below.
	mu      sync.Mutex
	start   time.Time // of the current interval
	n       int       // lines let through in it
	dropped int       // lines held back in it
}

// allow reports whether a line may be written now, and how many lines were
// held back in an interval that has just ended (to be reported first).
func (l *logLimiter) allow() (ok bool, held int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if now.Sub(l.start) >= l.every {
		held = l.dropped
		l.start, l.n, l.dropped = now, 0, 0
	}
	if l.n < l.limit {
		l.n++
		return true, held
	}
	l.dropped++
	return false, held
}

// take returns and clears the count of lines held back so far.
func (l *logLimiter) take() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.dropped
	l.dropped = 0
	return n
}
