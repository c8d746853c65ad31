package testbed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/testbed/bench"
	"github.com/latentmesh/latentmesh/transfer"
)

// newNet builds a Net for the test, deleted when it ends; it skips where
// network namespaces cannot be built (not root, iproute2 missing).
func newNet(t *testing.T, hosts ...string) (*Net, []*Host) {
	t.Helper()
	if ok, why := NetAvailable(); !ok {
		t.Skip(why)
	}
	n, err := NewNet()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("close net: %v", err)
		}
	})
	var hs []*Host
	for _, name := range hosts {
		h, err := n.AddHost(name)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	return n, hs
}

// A producer on another host goes silent mid-pull (every packet dropped, no
// reset): the consumer's pull fails with a timeout within IOTimeout of the
// last progress, and once the host is back a new pull succeeds.
func TestPartitionEndsPullWithinTimeout(t *testing.T) {
	n, hs := newNet(t, "prod")
	prodHost := hs[0]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	argv := prodHost.Command(devBinary, "bench", "producer", "--listen-ip", prodHost.IP).Args
	prod, err := bench.StartProducer(ctx, argv, nil, 0, "")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := prod.Close(); err != nil {
			t.Error(err)
		}
	}()
	// 64 MiB over a 200 Mbit/s link: a pull takes about 2.7 s, so it is in
	// flight when the partition comes.
	if err := prodHost.Shape("200mbit"); err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	ref, err := prod.Publish(size, 1)
	if err != nil {
		t.Fatal(err)
	}

	h, err := transfer.NewHost("/ip4/"+n.RootIP()+"/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	cfg := transfer.DefaultConfig()
	cfg.DataListen = net.JoinHostPort(n.RootIP(), "0")
	cfg.Transport = transfer.TransportTCP
	cfg.IOTimeout = 2 * time.Second
	cfg.Logger = zaptest.NewLogger(t)
	cons, err := transfer.New(cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	defer cons.Close()
	dst := make([]byte, size)

	pulled := make(chan error, 1)
	go func() { pulled <- cons.PullInto(ctx, ref, dst) }()
	time.Sleep(500 * time.Millisecond)
	if err := prodHost.Partition(); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	select {
	case err = <-pulled:
	case <-time.After(cfg.IOTimeout + 3*time.Second):
		t.Fatalf("pull still running %v after the partition (IOTimeout %v)", time.Since(cut), cfg.IOTimeout)
	}
	took := time.Since(cut)
	if err == nil {
		t.Fatal("pull succeeded through a partition that started 0.5 s into a 2.7 s transfer")
	}
	if !errors.Is(err, transfer.ErrUnreachable) || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("pull failed with %v, want ErrUnreachable after the deadline", err)
	}
	// The deadline moves at most once per quarter of IOTimeout, so the
	// error comes between 3/4 and all of IOTimeout after the last byte.
	if lo := cfg.IOTimeout / 2; took < lo {
		t.Fatalf("pull failed %v after the partition, before the deadline could expire (>= %v): %v", took, lo, err)
	}
	t.Logf("pull failed %v after the partition: %v", took, err)

	if err := prodHost.Heal(); err != nil {
		t.Fatal(err)
	}
	if err := prodHost.Unshape(); err != nil {
		t.Fatal(err)
	}
	// The stalled connections were discarded; a new pull dials afresh and
	// its bytes pass the producer's checksums.
	if err := cons.PullInto(ctx, ref, dst); err != nil {
		t.Fatalf("pull after healing: %v", err)
	}
}

// adminStatus reads an agent's admin status.
func adminStatus(ctx context.Context, addr string) (agent.Status, error) {
	return adminStatusAs(ctx, addr, meshAdminToken)
}

// adminStatusAs reads an agent's admin status with token.
func adminStatusAs(ctx context.Context, addr, token string) (agent.Status, error) {
	var st agent.Status
	err := AdminGet(ctx, addr, token, "/v1/admin/status", &st)
	return st, err
}

// peersAlive checks that the agent whose admin endpoint is addr sees every
// other node of ids alive in gossip.
func peersAlive(ctx context.Context, addr, token string, ids []string) error {
	st, err := adminStatusAs(ctx, addr, token)
	if err != nil {
		return err
	}
	alive := map[string]bool{}
	for _, p := range st.Peers {
		alive[p.ID] = p.Alive
	}
	for _, id := range ids {
		if id != st.Node.ID && !alive[id] {
			return fmt.Errorf("%s does not see %s alive: %+v", st.Node.ID, id, st.Peers)
		}
	}
	return nil
}

// Agents on three hosts, etcd on a fourth, every transport left on auto:
// the hosts see each other as separate machines, so latents cross by tcp,
// and the file is the one the engine makes in one process.
func TestMeshAcrossHosts(t *testing.T) {
	n, hs := newNet(t, "enc", "den", "dec")
	m := startMeshAt(t, n.RootIP())
	_, enc := m.agentOn(hs[0], "enc-h", "encode")
	_, den := m.agentOn(hs[1], "den-h", "denoise")
	_, dec := m.agentOn(hs[2], "dec-h", "decode")
	if enc.Host == den.Host || den.Host == dec.Host {
		t.Fatalf("hosts share an identity: %q %q %q", enc.Host, den.Host, dec.Host)
	}

	out := filepath.Join(t.TempDir(), "boat.png")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	w, h, steps, seed := 128, 96, 6, int64(7)
	job, data, err := c.Generate(ctx, httpapi.JobRequest{Prompt: "a boat", Width: &w, Height: &h, Steps: &steps, Seed: &seed}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if job.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", job.State, job.Error)
	}
	if err := os.WriteFile(out, data, 0o644); err != nil {
		t.Fatal(err)
	}
	spec := engine.Spec{Prompt: "a boat", Seed: seed, Width: w, Height: h, Steps: steps}.WithDefaults()
	if want := referenceOutput(t, spec); string(data) != string(want) {
		t.Fatal("output across hosts differs from the engine run in one process")
	}
	for _, rec := range []struct{ name, admin string }{{"denoise", den.AdminAddr}, {"decode", dec.AdminAddr}} {
		st, err := adminStatus(ctx, rec.admin)
		if err != nil {
			t.Fatal(err)
		}
		if st.Data.Pulls[transfer.TransportTCP] == 0 || st.Data.Pulls[transfer.TransportShm] != 0 {
			t.Fatalf("%s pulled %v, want tcp only between hosts", rec.name, st.Data.Pulls)
		}
	}
}

// The host running a job's decode is partitioned mid-task: its lease runs
// out, a decode agent on another host takes the task and the job succeeds
// with one committed result. When the partition heals, the cut-off agent
// joins again and its stale attempt commits nothing.
func TestPartitionedHostMidTask(t *testing.T) {
	n, hs := newNet(t, "enc", "den", "dec1", "dec2")
	m := startMeshAt(t, n.RootIP())
	_, enc := m.agentOn(hs[0], "enc-x", "encode")
	m.agentOn(hs[1], "den-x", "denoise")
	// dec1 takes a minute per decode, so the partition finds it mid-task.
	m.agentOn(hs[2], "dec1-x", "decode", "--sim-cost", "decode=60s")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	w, h, steps := 96, 64, 6
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a harbour", Width: &w, Height: &h, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool { return p.Stage == jobs.Decode && p.Node == "dec1-x" })
	if err := hs[2].Partition(); err != nil {
		t.Fatal(err)
	}
	m.agentOn(hs[3], "dec2-x", "decode")

	done := m.waitRedecoded(ctx, c, job.ID, "dec2-x")

	// Heal: dec1 finds its lease gone, registers again, and its stale
	// decode never commits.
	if err := hs[2].Heal(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		resp, err := m.cli.Get(ctx, "/latentmesh/default/nodes/dec1-x")
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return errors.New("dec1-x has not registered again")
		}
		return nil
	})
	m.checkResultOnce(ctx, done)
	after, err := c.Get(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if d := after.Stages[jobs.Decode]; d.Node != "dec2-x" || after.State != jobs.Succeeded {
		t.Fatalf("after healing the job reads %s with decode %+v", after.State, d)
	}
	if !strings.HasPrefix(done.Result.ContentType, "image/") {
		t.Fatalf("result content type %q", done.Result.ContentType)
	}
}
