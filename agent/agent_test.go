package agent

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/transfer"
)

func TestParseRoles(t *testing.T) {
	tests := []struct {
		in      []string
		want    int
		wantErr bool
	}{
		{[]string{"encode", "denoise", "decode"}, 3, false},
		{[]string{"decode"}, 1, false},
		{[]string{"render"}, 0, true},
		{[]string{""}, 0, true},
		{nil, 0, true},
	}
	for _, tt := range tests {
		got, err := ParseRoles(tt.in)
		if (err != nil) != tt.wantErr || len(got) != tt.want {
			t.Errorf("ParseRoles(%q) = %v, %v", tt.in, got, err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := map[string]func(*Config){
		"no roles":   func(c *Config) { c.Roles = nil },
		"role twice": func(c *Config) { c.Roles = []jobs.Stage{jobs.Decode, jobs.Decode} },
		"no slots":   func(c *Config) { c.Slots = map[jobs.Stage]int{jobs.Encode: 1} },
		"zero slots": func(c *Config) { c.Slots[jobs.Denoise] = 0 },
		"no retries": func(c *Config) { c.TransientRetries = 0 },
		"no backoff": func(c *Config) { c.RetryBackoff = 0 },
	}
	for name, edit := range tests {
		c := DefaultConfig()
		c.Slots = map[jobs.Stage]int{jobs.Encode: 1, jobs.Denoise: 1, jobs.Decode: 1}
		edit(&c)
		if _, err := c.validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	c := DefaultConfig()
	c.Prefix = "/mesh/a"
	got, err := c.validate()
	if err != nil {
		t.Fatal(err)
	}
	// One prefix ties the layers together, and the slots map is a copy.
	if got.Gossip.Prefix != "/mesh/a" || got.Jobs.Prefix != "/mesh/a" {
		t.Fatalf("prefixes not propagated: %q %q", got.Gossip.Prefix, got.Jobs.Prefix)
	}
	got.Slots[jobs.Encode] = 99
	if c.Slots[jobs.Encode] == 99 {
		t.Fatal("validate shares the caller's slots map")
	}
}

func TestIdentityPersists(t *testing.T) {
	path := filepath.Join(t.TempDir(), "identity.key")
	a, err := loadIdentity(path)
	if err != nil {
		t.Fatal(err)
	}
	b, err := loadIdentity(path)
	if err != nil {
		t.Fatal(err)
	}
	if !a.Equals(b) {
		t.Fatal("second start got a different identity")
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("identity file mode: %v %v", fi, err)
	}
	if err := os.WriteFile(path, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadIdentity(path); err == nil {
		t.Fatal("corrupt identity accepted")
	}
	if k, err := loadIdentity(""); err != nil || k == nil {
		t.Fatalf("ephemeral identity: %v", err)
	}
}

func TestEarliest(t *testing.T) {
	a, b := time.Unix(10, 0), time.Unix(20, 0)
	for _, tt := range []struct{ x, y, want time.Time }{
		{time.Time{}, a, a}, {a, time.Time{}, a}, {a, b, a}, {b, a, a}, {time.Time{}, time.Time{}, time.Time{}},
	} {
		if got := earliest(tt.x, tt.y); !got.Equal(tt.want) {
			t.Errorf("earliest(%v, %v) = %v", tt.x, tt.y, got)
		}
	}
}

// startAgent starts an agent named node (DefaultLocalConfig) on an embedded
// etcd, all closed when the test ends.
func startAgent(t *testing.T, node string) (*Agent, *clientv3.Client, Config) {
	t.Helper()
	return startAgentWith(t, node, nil)
}

// embeddedEtcd starts an embedded etcd for the test and returns a client
// of it.
func embeddedEtcd(t *testing.T) *clientv3.Client {
	t.Helper()
	srv, err := etcdembed.Start(context.Background(), etcdembed.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// runAgent makes and starts an agent of cfg on cli, closed with the test.
func runAgent(t *testing.T, ctx context.Context, cli *clientv3.Client, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return a
}

// startAgentWith is startAgent with edit applied to the local config.
func startAgentWith(t *testing.T, node string, edit func(*Config)) (*Agent, *clientv3.Client, Config) {
	t.Helper()
	cli := embeddedEtcd(t)
	cfg := DefaultLocalConfig()
	cfg.NodeID = node
	if edit != nil {
		edit(&cfg)
	}
	a, err := New(cfg, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a, cli, cfg
}

// resyncHeld releases held payloads that have neither a record nor a running
// producer task (their release events were compacted away) and keeps the rest.
func TestResyncHeldReleasesOnlyOrphans(t *testing.T) {
	ctx := context.Background()
	a, cli, cfg := startAgent(t, "resync-1")

	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{64}}
	publish := func() string {
		ref, err := a.xfer.Publish(meta, make([]byte, 64))
		if err != nil {
			t.Fatal(err)
		}
		return ref.ID
	}
	orphan, recorded := publish(), publish()
	rec, _ := json.Marshal(jobs.PayloadRecord{Input: jobs.Input{Payload: recorded, Node: a.id}})
	if _, err := cli.Put(ctx, cfg.Prefix+"/payloads/"+a.id+"/"+recorded, string(rec)); err != nil {
		t.Fatal(err)
	}
	claim := &jobs.Claim{Task: jobs.Task{ID: "task-1"}}
	p, ref, err := a.begin(claim, meta)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Done()

	a.resyncHeld()
	held := map[string]bool{}
	for _, id := range a.xfer.HeldIDs() {
		held[id] = true
	}
	if held[orphan] || !held[recorded] || !held[ref.ID] {
		t.Fatalf("after resync: held %v; want %s (recorded) and %s (in flight), not %s", held, recorded, ref.ID, orphan)
	}
	a.untrack(claim)
	a.resyncHeld()
	if ids := a.xfer.HeldIDs(); len(ids) != 1 || ids[0] != recorded {
		t.Fatalf("after its task ended, the unrecorded payload should go: held %v", ids)
	}
}

// orphans names what a job will never use: everything of a failed or
// missing job, and of a succeeded one its unconsumed relays and its frame
// previews (a preview put by a stale attempt can land after the decode's
// commit deleted the others), never its result or a running job's objects.
func TestOrphansOfFinishedJobs(t *testing.T) {
	ctx := context.Background()
	a, cli, cfg := startAgent(t, "orphans-1")
	for id, st := range map[string]jobs.State{"aaaa": jobs.Succeeded, "bbbb": jobs.Running, "cccc": jobs.Failed} {
		if _, err := cli.Put(ctx, cfg.Prefix+"/jobs/"+id, `{"id":"`+id+`","state":"`+string(st)+`"}`); err != nil {
			t.Fatal(err)
		}
	}
	recs := []cache.Record{
		{ID: jobs.ResultID("aaaa"), Job: "aaaa", Mode: cache.Pinned},
		{ID: jobs.PreviewID("aaaa", 0), Job: "aaaa", Mode: cache.TTL},
		{ID: cache.JobObjectID("aaaa", "denoise.x"), Job: "aaaa", Mode: cache.Consume},
		{ID: jobs.PreviewID("bbbb", 3), Job: "bbbb", Mode: cache.TTL},
		{ID: cache.JobObjectID("bbbb", "denoise.x"), Job: "bbbb", Mode: cache.Consume},
		{ID: jobs.ResultID("cccc"), Job: "cccc", Mode: cache.Pinned},
		{ID: jobs.PreviewID("dddd", 0), Job: "dddd", Mode: cache.TTL},
		{ID: "embedding.1", Mode: cache.Cache},
	}
	got, err := a.orphans(ctx, recs)
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(got)
	want := []string{cache.JobObjectID("aaaa", "denoise.x"), jobs.PreviewID("aaaa", 0), jobs.ResultID("cccc"), jobs.PreviewID("dddd", 0)}
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Fatalf("orphans = %v, want %v", got, want)
	}
}

// An admin endpoint reachable from other hosts serves pprof and the
// mesh's status: the agent refuses to start it without a token.
func TestAdminBeyondLoopbackNeedsToken(t *testing.T) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:1"}, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	cfg := DefaultLocalConfig()
	cfg.HTTPListen = ""
	cfg.AdminListen = "0.0.0.0:0"
	a, err := New(cfg, cli)
	if err == nil {
		a.Close()
		t.Fatal("started an admin endpoint on 0.0.0.0 without a token")
	}
	if !strings.Contains(err.Error(), "beyond loopback") {
		t.Fatalf("%v", err)
	}
}

// lateEngine is the built-in engine as an external one that registers at
// the worst moment: right after the agent first read what it serves (the
// meta Start publishes), before anyone waits on Changed.
type lateEngine struct {
	builtinRunner
	mu         sync.Mutex
	registered bool
	changed    chan struct{}
}

func (l *lateEngine) Changed() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.changed
}

func (l *lateEngine) Models() map[string][]jobs.Stage {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.registered {
		l.registered = true // registers as this first answer is read
		close(l.changed)
		l.changed = make(chan struct{})
		return nil
	}
	return map[string][]jobs.Stage{"late-model": jobs.Stages()}
}

// Issue 20's startup race: an engine that registers within milliseconds of
// its agent starting must still be advertised.
func TestEngineRegisteredAtStartIsGossiped(t *testing.T) {
	a, _, _ := startAgent(t, "late-1")
	a.runner = &lateEngine{builtinRunner: builtinRunner{a.engine}, changed: make(chan struct{})}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	for !a.member.Self().Meta.Serves(string(jobs.Denoise), "late-model", engine.DefaultModel) {
		if ctx.Err() != nil {
			t.Fatalf("the engine's model was never gossiped: %+v", a.member.Self().Meta.Models)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// noSlotsEngine serves nothing yet: an external engine not registered.
type noSlotsEngine struct{ builtinRunner }

func (noSlotsEngine) Slots(jobs.Stage) int { return 0 }

// Status shows the credits the engine allows, not the agent's --slots
// alone (issue 20: an unregistered engine showed the agent's slots free).
func TestStatusCreditsAreTheEngines(t *testing.T) {
	a, _, _ := startAgent(t, "slots-1")
	st, err := a.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c := st.Credits[jobs.Denoise]; c.Total < 1 || c.Free != c.Total {
		t.Fatalf("built-in engine: denoise credits %+v, want the agent's slots, all free", c)
	}
	a.runner = noSlotsEngine{builtinRunner{a.engine}}
	if st, err = a.Status(context.Background()); err != nil {
		t.Fatal(err)
	}
	if c := st.Credits[jobs.Denoise]; c.Total != 0 || c.Free != 0 {
		t.Fatalf("engine with no slots: denoise credits %+v, want none", c)
	}
}

// The version names the commit a binary was built from when the toolchain
// stamped one, and whether its tree had changes.
func TestBuildVersion(t *testing.T) {
	if v := buildVersion(nil, false); v != release {
		t.Fatalf("no build info: %q, want %q", v, release)
	}
	info := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"}}}
	if v := buildVersion(info, true); v != release+"+0123456789ab.dirty" {
		t.Fatalf("devel build of a changed tree: %q", v)
	}
	info = &debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261202140516-b123d07abd3c+dirty"}, Settings: info.Settings}
	if v := buildVersion(info, true); v != info.Main.Version {
		t.Fatalf("build with a VCS pseudo-version: %q, want it alone", v)
	}
}
