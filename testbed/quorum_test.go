package testbed

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// meshOnCluster is a mesh whose agents (OS processes) use every member of
// the etcd cluster c, as a deployment's agents would.
func meshOnCluster(t *testing.T, c *EtcdCluster) *mesh {
	t.Helper()
	m := &mesh{t: t, endpoint: strings.Join(c.Endpoints(), ","), keyring: writeGossipKeyring(t), state: t.TempDir()}
	t.Cleanup(func() {
		if t.Failed() {
			for _, p := range m.procs {
				out := p.Output()
				t.Logf("--- %s (last 20000 bytes) ---\n%s", p.Name, out[max(0, len(out)-20000):])
			}
		}
		m.stop() // before the cluster's own cleanup, registered earlier
	})
	var err error
	if m.cli, err = NewEtcdClient(c.Endpoints(), nil); err != nil {
		t.Fatal(err)
	}
	return m
}

// The quorum loss: two of three etcd members down for 30 s while
// jobs are in flight. Every job accepted before the outage succeeds with
// the file the engine makes in one process; no stage runs twice (every
// stage is committed by its first attempt, and no job is rewound, so the
// encoded inputs waiting in the queue and the outputs that finished during
// the outage were all kept); and every submission during the outage is
// refused with 503 and Retry-After.
//
// The agents' etcd leases (2 s) are far shorter than the outage. etcd
// expires no lease while it has no leader and extends every lease by its
// TTL when a new leader takes over; an agent keeps renewing the same lease
// until etcd answers, so its claims outlive the outage.
func TestQuorumLossMidLoad(t *testing.T) {
	etcd := startEtcdCluster(t, "")
	m := meshOnCluster(t, etcd)
	// One denoise at a time, 30 steps of 200 ms: a job spends 6 s there,
	// the others wait with their encoded inputs. A decode takes 4 s, so
	// the one behind the running denoise is mid-decode too.
	cost := []string{"--arena-size", "64MiB", "--sim-cost", "encode=50ms,step=200ms,decode=4s"}
	_, enc := m.agent("enc-q", "encode", cost...)
	_, den := m.agent("den-q", "denoise", cost...)
	_, dec := m.agent("dec-q", "decode", cost...)
	encProc, denProc, decProc := m.procs[0], m.procs[1], m.procs[2]

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	const steps = 30
	var specs []engine.Spec
	var accepted []jobs.Job
	for i := range 5 {
		seed, side, n := int64(300+i), 64, steps
		j, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a harbour at dusk", Seed: &seed, Width: &side, Height: &side, Steps: &n})
		if err != nil {
			t.Fatal(err)
		}
		accepted = append(accepted, j)
		specs = append(specs, engine.Spec{Prompt: "a harbour at dusk", Seed: seed, Width: side, Height: side, Steps: n}.WithDefaults())
	}

	// Cut etcd a third of the way into a job's denoise: the previous stage
	// boundary (claims, tickets, pulls) is two seconds past, this denoise
	// and the decode of the job before finish during the outage, and the
	// jobs behind wait, encoded, at denoise.
	eventually(t, 2*time.Minute, func() error {
		for _, j := range accepted[1:] {
			j, err := c.Get(ctx, j.ID)
			if err != nil {
				return err
			}
			if p := j.Progress; p != nil && p.Stage == jobs.Denoise && p.Step >= steps/3 && p.Step < 2*steps/3 {
				return nil
			}
		}
		return fmt.Errorf("no job a third into its denoise")
	})
	leader, err := etcd.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Killing the leader leaves a follower that never had a leader's log
	// to itself: a write sent during the outage cannot commit later.
	down := []int{leader, (leader + 1) % etcd.Len()}
	for _, i := range down {
		etcd.Kill(i)
	}
	killed := time.Now()
	t.Logf("killed etcd members %v (leader %d)", down, leader)
	restarted := false
	defer func() {
		if !restarted {
			for _, i := range down {
				etcd.Restart(i)
			}
		}
	}()

	// Submissions to every agent during the outage: each a 503 with
	// Retry-After, until the outage has lasted 30 s.
	const outage = 30 * time.Second
	var refused int
	apis := []string{enc.HTTPAddr, den.HTTPAddr, dec.HTTPAddr}
	for i := 0; time.Since(killed) < outage-2*time.Second; i++ {
		start := time.Now()
		resp, err := http.Post("http://"+apis[i%len(apis)]+"/v1/jobs", "application/json",
			strings.NewReader(`{"prompt":"during the outage","steps":2,"width":64,"height":64}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
			!strings.Contains(string(b), httpapi.CodeUnavailable) {
			t.Fatalf("submission %d, %v into the outage: %d Retry-After %q %s", i, time.Since(killed).Round(time.Millisecond),
				resp.StatusCode, resp.Header.Get("Retry-After"), b)
		}
		refused++
		if i == 0 {
			t.Logf("first submission refused after %v: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(string(b)))
		}
		time.Sleep(500 * time.Millisecond) // pacing, not synchronization: a client retrying
	}
	if d := outage - time.Since(killed); d > 0 {
		time.Sleep(d) // the outage is the 30 s
	}
	for _, i := range down {
		if err := etcd.Restart(i); err != nil {
			t.Fatal(err)
		}
	}
	restarted = true
	t.Logf("etcd quorum lost for %v; %d submissions refused with 503", time.Since(killed).Round(time.Millisecond), refused)
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	err = etcd.WaitHealthy(wctx)
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("etcd healthy %v after the kill", time.Since(killed).Round(time.Millisecond))

	// Every accepted job finishes, each stage on its first attempt.
	for i, j := range accepted {
		var done jobs.Job
		eventually(t, 3*time.Minute, func() error {
			var err error
			if done, err = c.Wait(ctx, j.ID, 10*time.Second); err != nil {
				return err
			}
			if !done.State.Terminal() {
				return fmt.Errorf("job %d still %s at %s", i, done.State, done.Stage)
			}
			return nil
		})
		if done.State != jobs.Succeeded {
			t.Fatalf("job %d ended %s: %+v", i, done.State, done.Error)
		}
		if done.Rewinds != 0 {
			t.Errorf("job %d rewound %d times: an encoded input was lost", i, done.Rewinds)
		}
		for _, st := range jobs.Stages() {
			if s := done.Stages[st]; s == nil || s.Attempt != 1 {
				t.Errorf("job %d: %s stage %+v, want committed by attempt 1", i, st, s)
			}
		}
		data, _, err := c.Result(ctx, j.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data, referenceOutput(t, specs[i])) {
			t.Errorf("job %d: file differs from the engine run in one process", i)
		}
		t.Logf("job %d: denoise %+v, decode %+v", i, *done.Stages[jobs.Denoise], *done.Stages[jobs.Decode])
	}
	// The outage did hit finished work: the denoise that ended during it
	// kept its output and retried its commit (a decode that ended during
	// it kept its file and retried storing it, or its commit). And every
	// agent kept its lease, 15 TTLs long, through the outage.
	for _, p := range []*Process{encProc, denProc, decProc} {
		out := p.Output()
		commits := strings.Count(out, "commit failed; keeping the output and retrying")
		results := strings.Count(out, "storing the result failed; keeping the file and retrying")
		held := strings.Count(out, "lease held through the etcd outage")
		t.Logf("%s: %d commit attempts and %d result stores retried; lease held through the outage %d times", p.Name, commits, results, held)
		if p == denProc && commits == 0 {
			t.Errorf("%s retried no commit: its denoise did not finish during the outage", p.Name)
		}
		if held == 0 || strings.Contains(out, "registered under new lease") {
			t.Errorf("%s did not keep its lease through the outage", p.Name)
		}
	}
	// A 503 says etcd gave no answer, not that the write failed; with the
	// leader killed, none of them can have been written. Measured, not
	// asserted: an old leader's log could hold one in another outage.
	if resp, err := m.cli.Get(ctx, prefix+"/jobs/", clientv3.WithPrefix(), clientv3.WithCountOnly()); err == nil {
		t.Logf("%d jobs in etcd after the outage, %d accepted before it", resp.Count, len(accepted))
	}
	m.checkNoLeaks(ctx)
}

// checkNoLeaks checks that no task, claim or payload record outlives the
// jobs (tasks and claims live under queues/).
func (m *mesh) checkNoLeaks(ctx context.Context) {
	m.t.Helper()
	for _, p := range []string{"queues/", "payloads/"} {
		resp, err := m.cli.Get(ctx, prefix+"/"+p, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			m.t.Fatal(err)
		}
		if resp.Count != 0 {
			m.t.Errorf("%d keys left under %s", resp.Count, p)
		}
	}
}
