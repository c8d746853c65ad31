package main

import (
	"bufio"
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/testbed"
)

// The units in scripts/, as systemd reads them.
var units = []struct {
	file, instance string // instance: the name to verify a template as
}{
	{"latentmesh-agent.service", "latentmesh-agent.service"},
	{"latentmesh-agent@.service", "latentmesh-agent@0.service"},
	{"latentmesh-engine@.service", "latentmesh-engine@0.service"},
}

// installedBinary is where the units expect the binary.
const installedBinary = "/usr/local/bin/latentmesh"

// needTool returns the path of a tool scripts/install-deps.sh installs:
// missing is a failure as root (CI), a skip otherwise.
func needTool(t *testing.T, name, pkg string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("%s not found (Debian's %s; scripts/install-deps.sh installs it as root)", name, pkg)
		}
		t.Fatalf("%s not found: scripts/install-deps.sh installs Debian's %s", name, pkg)
	}
	return path
}

// buildAgent builds this command into a temporary directory.
func buildAgent(t *testing.T, tags ...string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "latentmesh")
	args := []string{"build", "-o", out}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	if b, err := exec.Command("go", append(args, ".")...).CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	return out
}

// unitFile reads scripts/<name>.
func unitFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "scripts", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// unitSeconds is the value of a seconds setting (TimeoutStopSec=60) of a unit.
func unitSeconds(t *testing.T, unit, key string) time.Duration {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(unit))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), key+"="); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("%s=%q: want whole seconds", key, v)
			}
			return time.Duration(n) * time.Second
		}
	}
	t.Fatalf("the unit sets no %s=", key)
	return 0
}

// verifyUnits copies the units into dir, their ExecStart pointed at bin,
// and runs systemd-analyze verify on each (templates as an instance). It
// returns what verify said about them: verify exits 0 on unknown keys and
// bad values and only warns, so a unit is accepted when nothing is said.
func verifyUnits(t *testing.T, analyze, bin, dir string, edit func(name, text string) string) map[string]string {
	t.Helper()
	for _, u := range units {
		text := strings.ReplaceAll(unitFile(t, u.file), installedBinary, bin)
		if edit != nil {
			text = edit(u.file, text)
		}
		if err := os.WriteFile(filepath.Join(dir, u.file), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	said := map[string]string{}
	for _, u := range units {
		cmd := exec.Command(analyze, "verify", "--man=no", u.instance)
		// The directory first, then the usual path (the trailing colon):
		// the engine's BindsTo= names the agent's instance.
		cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+dir+":")
		out, err := cmd.CombinedOutput()
		var lines []string
		for line := range strings.SplitSeq(string(out), "\n") {
			if strings.Contains(line, "latentmesh") {
				lines = append(lines, line)
			}
		}
		if err != nil {
			lines = append(lines, "exit: "+err.Error())
		}
		if len(lines) > 0 {
			said[u.file] = strings.Join(lines, "\n")
		}
	}
	return said
}

// systemd-analyze verify accepts every unit as shipped, pointed at the
// built binary (it checks that ExecStart exists and is executable); it is
// not fooled: a unit with an unknown key is refused. systemd-sysusers
// creates the user they run as, and the agent units' stop timeout
// outlasts the agent's drain.
func TestSystemdUnitsVerify(t *testing.T) {
	analyze := needTool(t, "systemd-analyze", "systemd")
	sysusers := needTool(t, "systemd-sysusers", "systemd")
	bin := buildAgent(t)
	dir := t.TempDir()
	if said := verifyUnits(t, analyze, bin, dir, nil); len(said) > 0 {
		for file, s := range said {
			t.Errorf("systemd-analyze verify %s:\n%s", file, s)
		}
	}
	broken := verifyUnits(t, analyze, bin, t.TempDir(), func(name, text string) string {
		return strings.Replace(text, "[Install]", "Watchdog=30\n[Install]", 1)
	})
	for _, u := range units {
		if !strings.Contains(broken[u.file], "Watchdog") {
			t.Errorf("verify said nothing of an unknown key in %s: %q", u.file, broken[u.file])
		}
	}
	missing := verifyUnits(t, analyze, filepath.Join(t.TempDir(), "absent"), t.TempDir(), nil)
	if !strings.Contains(missing["latentmesh-agent.service"], "not executable") {
		t.Errorf("verify said nothing of an absent ExecStart binary: %q", missing["latentmesh-agent.service"])
	}

	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	conf, err := filepath.Abs(filepath.Join("..", "..", "scripts", "latentmesh.sysusers"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(sysusers, "--root", root, conf).CombinedOutput(); err != nil {
		t.Fatalf("systemd-sysusers: %v\n%s", err, out)
	}
	passwd, err := os.ReadFile(filepath.Join(root, "etc", "passwd"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^latentmesh:x:\d+:\d+:[^:]*:/var/lib/latentmesh:/usr/sbin/nologin$`).Match(passwd) {
		t.Errorf("systemd-sysusers made no latentmesh system user:\n%s", passwd)
	}

	def := agent.DefaultConfig()
	drain := def.DrainTimeout + def.EtcdTimeout + 5*time.Second // Close's shutdown: leave and revoke
	for _, file := range []string{"latentmesh-agent.service", "latentmesh-agent@.service"} {
		unit := unitFile(t, file)
		if stop := unitSeconds(t, unit, "TimeoutStopSec"); stop <= drain {
			t.Errorf("%s: TimeoutStopSec=%v does not outlast the drain (%v): systemd would SIGKILL a draining agent", file, stop, drain)
		}
		if wd := unitSeconds(t, unit, "WatchdogSec"); wd <= 0 {
			t.Errorf("%s: WatchdogSec=%v", file, wd)
		}
		for _, want := range []string{"Type=notify", "User=latentmesh", "ProtectSystem=strict", "NoNewPrivileges=yes", "CapabilityBoundingSet=CAP_IPC_LOCK", "LimitMEMLOCK=infinity"} {
			if !strings.Contains(unit, "\n"+want+"\n") {
				t.Errorf("%s lacks %s", file, want)
			}
		}
	}
	for _, u := range units {
		cmd := exec.Command(analyze, "security", "--offline=yes", "--no-pager", u.instance)
		cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+dir+":")
		out, err := cmd.CombinedOutput()
		m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`).FindSubmatch(out)
		if err != nil || m == nil {
			t.Errorf("systemd-analyze security %s: %v\n%s", u.instance, err, out)
			continue
		}
		// systemd rates 0-10, 10 being a unit with no hardening at all.
		if exposure, _ := strconv.ParseFloat(string(m[1]), 64); exposure >= 4 {
			t.Errorf("systemd-analyze security %s: exposure %s, want under 4 (OK)", u.file, m[1])
		}
		t.Logf("systemd-analyze security %s: exposure %s", u.file, m[1])
	}
}

// The agent binary under systemd's protocol, as the unit runs it
// (WatchdogSec= shortened to 3 s): READY=1 first, once registered;
// WATCHDOG=1 pings while healthy and through an etcd outage (etcd frozen
// with SIGSTOP for longer than the lease TTL); none once its encode pull
// loop is wedged (a test build's hook, liveness_testhooks.go, holds it as a
// call that never returns); pings again once it is released; STOPPING=1 on
// SIGTERM, and exit 0 within the unit's TimeoutStopSec.
func TestSystemdUnitLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the agent and runs it against an external etcd for about a minute")
	}
	stopTimeout := unitSeconds(t, unitFile(t, "latentmesh-agent.service"), "TimeoutStopSec")
	if _, err := testbed.EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("%v (run it as root)", err)
		}
		t.Fatal(err)
	}
	ecfg := testbed.DefaultEtcdProcessConfig()
	ecfg.Dir = t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	etcd, err := testbed.StartEtcdProcess(ctx, ecfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { etcd.Close() })
	cli, err := clientv3.New(clientv3.Config{Endpoints: etcd.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	bin := buildAgent(t, "latentmesh_testhooks")

	const watchdogSec = 3 * time.Second
	sock := listenNotify(t)
	cmd := exec.Command(bin, "agent",
		"--etcd-endpoints", strings.Join(etcd.Endpoints(), ","), "--node-id", "systemd-1",
		"--state-dir", filepath.Join(t.TempDir(), "state"), "--http", "127.0.0.1:0", "--admin", "127.0.0.1:0",
		"--p2p-listen", "/ip4/127.0.0.1/tcp/0", "--data-listen", "127.0.0.1:0", "--gossip-bind", "127.0.0.1:0",
		"--arena-size", "64MiB", "--lease-ttl", "2s")
	cmd.Env = append(os.Environ(),
		"NOTIFY_SOCKET="+sock.path,
		"WATCHDOG_USEC="+strconv.FormatInt(watchdogSec.Microseconds(), 10),
		"TESTHOOK_WEDGE_LOOP=pull encode")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p, err := testbed.StartCommand("agent", cmd, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nagent output:\n%s", append(args, p.Output())...)
	}

	ready, before := sock.next(t, "READY=1", time.Minute)
	if len(before) > 0 {
		fail("notifications before READY=1: %q", states(before))
	}
	if resp, err := cli.Get(ctx, "/latentmesh/default/nodes/systemd-1"); err != nil || len(resp.Kvs) != 1 {
		fail("READY=1 before the node was registered: %v %v", resp, err)
	}
	httpAddr, err := p.WaitFor(ctx, regexp.MustCompile(`"msg":"agent started".*?"http":"([^"]+)"`))
	if err != nil {
		t.Fatal(err)
	}
	adminAddr, err := p.WaitFor(ctx, regexp.MustCompile(`"msg":"agent started".*?"admin":"([^"]+)"`))
	if err != nil {
		t.Fatal(err)
	}

	// pinging checks that pings came no further apart than systemd allows
	// over a window, the first within it of since.
	pinging := func(what string, since time.Time, ns []notification) {
		t.Helper()
		last, pings, longest := since, 0, time.Duration(0)
		defer func() {
			t.Logf("%s: %d watchdog pings, at most %v apart", what, pings, longest.Round(time.Millisecond))
		}()
		for _, n := range ns {
			if hasState(n.state, "STATUS=wedged") {
				fail("%s: %q", what, n.state)
			}
			if !hasState(n.state, "WATCHDOG=1") {
				continue
			}
			if gap := n.at.Sub(last); gap > watchdogSec {
				fail("%s: no watchdog ping for %v (WatchdogSec %v): systemd would abort the agent", what, gap, watchdogSec)
			}
			longest = max(longest, n.at.Sub(last))
			last, pings = n.at, pings+1
		}
		if pings < 2 {
			fail("%s: %d watchdog pings, want them every %v", what, pings, watchdogSec/2)
		}
	}
	pinging("healthy", ready.at, sock.during(2*watchdogSec))

	// An etcd outage longer than the lease TTL: the keepalives go
	// unanswered, the session asks etcd again and again; nothing is wedged.
	pausedAt := time.Now()
	if err := etcd.Pause(); err != nil {
		t.Fatal(err)
	}
	outage := sock.during(8 * time.Second)
	if err := etcd.Resume(); err != nil {
		t.Fatal(err)
	}
	pinging("etcd frozen", pausedAt, outage)
	if !strings.Contains(p.Output(), "lease keepalive ended") {
		fail("the agent did not notice the outage (no lost keepalive in its log)")
	}
	readyz := func() bool {
		resp, err := http.Get("http://" + adminAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}
	for deadline := time.Now().Add(time.Minute); !readyz(); {
		if time.Now().After(deadline) {
			fail("agent not ready again a minute after etcd came back")
		}
		sock.during(200 * time.Millisecond) // pings meanwhile are as expected
	}

	// Wedge the encode pull loop at its next beat, which a job wakes it for.
	toggle := func(want string) {
		t.Helper()
		if err := syscall.Kill(p.Pid(), syscall.SIGUSR1); err != nil {
			t.Fatal(err)
		}
		if _, err := p.WaitFor(ctx, regexp.MustCompile("testhook: pull encode "+want)); err != nil {
			t.Fatal(err)
		}
	}
	toggle("wedged")
	wedgedAt := time.Now()
	api := &httpapi.Client{BaseURL: "http://" + httpAddr}
	job, err := api.Submit(ctx, httpapi.JobRequest{Prompt: "a wedged loop"})
	if err != nil {
		fail("submit: %v", err)
	}
	wedged, _ := sock.next(t, "STATUS=wedged", time.Minute)
	if !strings.Contains(wedged.state, "pull encode loop wedged") {
		fail("wedged status %q does not name the encode pull loop", wedged.state)
	}
	t.Logf("wedged loop to pings stopped: %v (%q)", wedged.at.Sub(wedgedAt).Round(time.Millisecond), wedged.state)
	for _, n := range sock.during(2 * watchdogSec) {
		if hasState(n.state, "WATCHDOG=1") {
			fail("a watchdog ping %v after the agent said it was wedged", n.at.Sub(wedged.at))
		}
	}

	// Released, the loop claims the job and the pings resume.
	toggle("released")
	if resumed, _ := sock.next(t, "WATCHDOG=1", 2*watchdogSec); !hasState(resumed.state, "STATUS=serving the built-in engine") {
		fail("first ping after the wedge %q, want the status restored", resumed.state)
	}
	if done, err := api.Wait(ctx, job.ID, time.Minute); err != nil || done.State != jobs.Succeeded {
		fail("job after the wedge: %+v %v", done, err)
	}

	// SIGTERM, as systemctl stop sends: STOPPING=1, then a drain (with a
	// job in it) and exit 0 within the unit's stop timeout.
	if _, err := api.Submit(ctx, httpapi.JobRequest{Prompt: "drained"}); err != nil {
		fail("submit: %v", err)
	}
	start := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- p.Stop(stopTimeout) }()
	sock.next(t, "STOPPING=1", stopTimeout)
	if err := <-stopped; err != nil {
		fail("stop: %v (want exit 0 within TimeoutStopSec=%v)", err, stopTimeout)
	}
	t.Logf("SIGTERM to exit 0: %v (TimeoutStopSec %v)", time.Since(start).Round(time.Millisecond), stopTimeout)
	// A lone agent of every role has nobody to hand its held outputs to:
	// it leaves at once instead of waiting out the drain timeout for them.
	if out := p.Output(); strings.Contains(out, "drain deadline") {
		fail("a lone agent waited for a consumer of its outputs until the drain deadline")
	}
}
