package gossip

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// Config configures a Membership. Start from DefaultConfig (or
// DefaultLocalConfig in tests); New validates and copies it.
type Config struct {
	// Prefix is the etcd key prefix of this mesh; records live under
	// Prefix+"/nodes/". Meshes sharing an etcd use different prefixes.
	Prefix string
	// LeaseTTL is the registration lease TTL, rounded up to whole seconds
	// (etcd's unit). A crashed node's record, and its claims, vanish this
	// long after it stops renewing.
	LeaseTTL time.Duration
	// GossipBind is the memberlist listen address (TCP and UDP, same port),
	// ip:port. Port 0 picks a free port, reported in NodeRecord.GossipAddr.
	GossipBind string
	// GossipAdvertise is the ip:port peers dial, when it differs from the
	// bind address (NAT, 0.0.0.0 binds). Empty: memberlist derives it; a
	// port of 0 means the bound port.
	GossipAdvertise string
	// Memberlist tunes failure detection and gossip. gossip owns Name,
	// BindAddr/Port, AdvertiseAddr/Port, Label (set to Prefix), the
	// encryption fields (from KeyringFile), the delegates and the logger and
	// overwrites them; the delegate, Keyring and SecretKey fields must be
	// left nil.
	Memberlist *memberlist.Config
	// KeyringFile is the path of this mesh's gossip keys: a JSON list of
	// base64 strings, each 16, 24 or 32 bytes (AES-128, -192 or -256), the
	// first of which encrypts; every key decrypts. With a keyring, memberlist
	// drops any packet or stream that is not encrypted and authenticated by
	// one of the keys. Empty: gossip is in clear, and whoever reaches the
	// gossip port can forge any member's meta and declare members dead.
	KeyringFile string
	// KeyringCheck is how often KeyringFile is read again; a change is
	// applied to the running keyring (see docs/ARCHITECTURE.md for the
	// rotation steps). A bad file is logged and the keys in use are kept.
	KeyringCheck time.Duration
	// LogLimit and LogLimitEvery bound memberlist's log lines: at most
	// LogLimit lines per LogLimitEvery are written, and the number of lines
	// held back is logged once the interval is over. Each bad packet makes
	// memberlist log a line, so without a bound anyone who can reach the
	// gossip port could flood the log.
	LogLimit      int
	LogLimitEvery time.Duration
	// Logger receives the package's logs, named "gossip", and memberlist's.
	Logger *zap.Logger
	// RevokeDeadPeers makes this node revoke the etcd lease of a peer that
	// memberlist declares dead, releasing its claims before the TTL runs
	// out. A false death (partition) costs the peer its claims, so it is off
	// by default.
	RevokeDeadPeers bool
	// EventBuffer is the channel size of each Subscribe; events beyond it
	// are dropped and counted rather than blocking memberlist.
	EventBuffer int
	// RequestTimeout bounds each etcd request (grant, put, get, revoke).
	RequestTimeout time.Duration
	// UpdateTimeout bounds how long a meta update waits for memberlist to
	// broadcast it.
	UpdateTimeout time.Duration
	// LeaveTimeout bounds the graceful memberlist leave in Close.
	LeaveTimeout time.Duration
	// RetryMin and RetryMax bound the backoff between failed attempts to
	// register or to re-establish the watch.
	RetryMin, RetryMax time.Duration
	// SessionHeartbeat, when set, hears the etcd session goroutine beat
	// and wait (a watchdog's view of it); nil: nobody watches.
	SessionHeartbeat Heartbeat
}

// DefaultConfig is for a LAN deployment.
func DefaultConfig() Config {
	ml := memberlist.DefaultLANConfig()
	// A crashed agent restarting under the same id on a new port is let
	// back in after this, instead of being refused as an address conflict
	// until the dead entry is reaped.
	ml.DeadNodeReclaimTime = 10 * time.Second
	return Config{
		Prefix:          "/latentmesh/default",  // the DESIGN.md layout
		LeaseTTL:        10 * time.Second,       // claims free within 10 s of a crash; keepalive every ~3 s
		GossipBind:      "127.0.0.1:0",          // safe default; agents set a routable ip:port
		GossipAdvertise: "",                     // derived from the bind address
		Memberlist:      ml,                     // memberlist's LAN tuning: failure detection in a few seconds
		Logger:          zap.NewNop(),           // silent unless the agent injects one
		RevokeDeadPeers: false,                  // a false death would void a live peer's claims
		EventBuffer:     256,                    // a burst of a whole small mesh changing at once
		RequestTimeout:  5 * time.Second,        // several raft rounds on a loaded etcd
		UpdateTimeout:   2 * time.Second,        // a few gossip rounds; a newer update follows anyway
		LeaveTimeout:    2 * time.Second,        // leave is a courtesy; the lease revoke is the truth
		RetryMin:        100 * time.Millisecond, // most failures are a leader election: retry soon
		RetryMax:        5 * time.Second,        // at most one attempt per 5 s against a sick etcd
		KeyringFile:     "",                     // no keys: the operator must create and distribute them
		KeyringCheck:    10 * time.Second,       // a rotation step is live everywhere within 10 s
		LogLimit:        20,                     // a burst of real trouble is all there
		LogLimitEvery:   10 * time.Second,       // then at most 2 lines a second, with a count
	}
}

// DefaultLocalConfig is DefaultConfig tuned for loopback tests: memberlist's
// local config with fast probes, and the shortest practical lease.
func DefaultLocalConfig() Config {
	c := DefaultConfig()
	ml := memberlist.DefaultLocalConfig()
	ml.ProbeInterval = 200 * time.Millisecond // detect a dead peer in about a second
	ml.ProbeTimeout = 100 * time.Millisecond  // loopback RTT is microseconds
	ml.GossipInterval = 50 * time.Millisecond // meta updates spread within ~100 ms
	ml.SuspicionMult = 2                      // short suspicion before dead
	ml.TCPTimeout = 500 * time.Millisecond    // joins to a vanished peer fail fast
	ml.PushPullInterval = 2 * time.Second     // anti-entropy often enough for short tests
	ml.GossipToTheDeadTime = 2 * time.Second
	ml.DeadNodeReclaimTime = time.Second
	c.Memberlist = ml
	c.LeaseTTL = 2 * time.Second // etcd's minimum TTL is about 1.5 s
	c.RequestTimeout = 2 * time.Second
	c.UpdateTimeout = 500 * time.Millisecond
	c.LeaveTimeout = 500 * time.Millisecond
	c.RetryMin = 20 * time.Millisecond
	c.RetryMax = 500 * time.Millisecond
	c.KeyringCheck = 50 * time.Millisecond
	return c
}

// validate checks c and returns a copy safe to keep: the memberlist config
// is copied so the caller's can be reused.
func (c Config) validate() (Config, error) {
	bad := func(format string, args ...any) (Config, error) {
		return Config{}, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	c.Prefix = strings.TrimRight(c.Prefix, "/")
	if c.Prefix == "" || !strings.HasPrefix(c.Prefix, "/") {
		return bad("prefix %q must start with '/' and not be the root", c.Prefix)
	}
	if len(c.Prefix) > memberlist.LabelMaxSize {
		return bad("prefix is %d bytes; as the gossip label it may have at most %d", len(c.Prefix), memberlist.LabelMaxSize)
	}
	if c.LeaseTTL < time.Second {
		return bad("lease ttl %v below 1s", c.LeaseTTL)
	}
	if _, _, err := splitIPPort(c.GossipBind); err != nil {
		return bad("gossip bind: %v", err)
	}
	if c.GossipAdvertise != "" {
		if _, _, err := splitIPPort(c.GossipAdvertise); err != nil {
			return bad("gossip advertise: %v", err)
		}
	}
	if c.Memberlist == nil {
		return bad("memberlist config is nil")
	}
	ml := *c.Memberlist
	if ml.Delegate != nil || ml.Events != nil || ml.Ping != nil || ml.Alive != nil ||
		ml.Merge != nil || ml.Conflict != nil {
		return bad("memberlist delegates are owned by gossip and must be nil")
	}
	if ml.Keyring != nil || ml.SecretKey != nil {
		return bad("memberlist keys come from KeyringFile; Keyring and SecretKey must be nil")
	}
	c.Memberlist = &ml
	if c.Logger == nil {
		return bad("logger is nil (use zap.NewNop())")
	}
	if c.EventBuffer < 1 {
		return bad("event buffer %d below 1", c.EventBuffer)
	}
	if c.LogLimit < 1 {
		return bad("log limit %d below 1", c.LogLimit)
	}
	for name, d := range map[string]time.Duration{
		"request timeout": c.RequestTimeout, "update timeout": c.UpdateTimeout,
		"leave timeout": c.LeaveTimeout, "retry min": c.RetryMin, "retry max": c.RetryMax,
		"keyring check": c.KeyringCheck, "log limit interval": c.LogLimitEvery,
	} {
		if d <= 0 {
			return bad("%s %v must be positive", name, d)
		}
	}
	if c.RetryMax < c.RetryMin {
		return bad("retry max %v below retry min %v", c.RetryMax, c.RetryMin)
	}
	return c, nil
}

// leaseTTLSeconds is LeaseTTL rounded up to whole seconds.
func (c Config) leaseTTLSeconds() int64 {
	return int64((c.LeaseTTL + time.Second - 1) / time.Second)
}

// splitIPPort parses ip:port; memberlist needs a literal IP, not a name.
func splitIPPort(addr string) (net.IP, int, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, 0, err
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return nil, 0, fmt.Errorf("%q is not an IP address", host)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 0 || p > 65535 {
		return nil, 0, fmt.Errorf("bad port %q", port)
	}
	return ip, p, nil
}
