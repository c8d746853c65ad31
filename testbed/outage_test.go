package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// getJSON GETs url and decodes a 200 answer into v; it returns the status,
// the body and how long the answer took.
func getJSON(t *testing.T, url string, v any) (int, string, time.Duration) {
	t.Helper()
	start := time.Now()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK && v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v: %s", url, err, b)
		}
	}
	return resp.StatusCode, string(b), time.Since(start)
}

// An etcd that hangs (SIGSTOP: connections open, no answers) costs clients
// a fast 503 naming etcd, turns /readyz to 503, and costs no finished work:
// the denoise that ends during the outage keeps its output and commits when
// etcd is back, instead of running again.
// pauseEtcd freezes etcd (SIGSTOP) until the returned resume is called,
// or the test ends; resume returns how long it was paused.
func pauseEtcd(t *testing.T, etcd *EtcdProcess) (resume func() time.Duration) {
	t.Helper()
	if err := etcd.Pause(); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	var once sync.Once
	var took time.Duration
	resume = func() time.Duration {
		once.Do(func() {
			if err := etcd.Resume(); err != nil {
				t.Error(err)
			}
			took = time.Since(paused)
		})
		return took
	}
	t.Cleanup(func() { resume() })
	return resume
}

// waitDenoiseStep waits until job id's denoise reports a step that ok
// accepts.
func waitDenoiseStep(t *testing.T, ctx context.Context, a *agent.Agent, id string, ok func(step int) bool) {
	t.Helper()
	eventually(t, 30*time.Second, func() error {
		j, err := a.Get(ctx, id)
		if err != nil {
			return err
		}
		if p := j.Progress; p == nil || p.Stage != jobs.Denoise || !ok(p.Step) {
			return fmt.Errorf("job at %s %+v", j.Stage, j.Progress)
		}
		return nil
	})
}

func TestEtcdOutageOnHTTPPath(t *testing.T) {
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no etcd binary and not root to install it: %v", err)
		}
		t.Fatal(err)
	}
	etcd := startEtcdProcess(t)
	obs, logs := observer.New(zap.InfoLevel)
	const etcdTimeout = time.Second
	cl := startCluster(t, Colocated, func(c *ClusterConfig) {
		c.EtcdEndpoints = etcd.Endpoints()
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), obs))
		c.Agent.EtcdTimeout = etcdTimeout
		c.Agent.AlarmEvery = 500 * time.Millisecond // unreachable after 2.5 s of silence (0.5 s + a 2 s poll timeout)
		// Longer than the outage: the claim survives it, so the commit may
		// still succeed once etcd answers.
		c.Agent.Gossip.LeaseTTL = 20 * time.Second
		c.Agent.Engine.StepCost = 100 * time.Millisecond
	})
	a := cl.Agents[0]
	api, admin := "http://"+a.HTTPAddr(), "http://"+a.AdminAddr()

	code, body := post(t, api+"/v1/jobs", `{"prompt":"through an outage","steps":20,"width":64,"height":64}`)
	if code != http.StatusAccepted {
		t.Fatalf("submit: %d %s", code, body)
	}
	var job jobs.Job
	if err := json.Unmarshal(body, &job); err != nil {
		t.Fatal(err)
	}
	// Pause etcd a few steps into the denoise, so that the sampler ends and
	// the stage commits while etcd is silent.
	eventually(t, 30*time.Second, func() error {
		var j jobs.Job
		getJSON(t, api+"/v1/jobs/"+job.ID, &j)
		if j.Progress == nil || j.Progress.Stage != jobs.Denoise || j.Progress.Step < 3 {
			return fmt.Errorf("job at %s %+v", j.Stage, j.Progress)
		}
		return nil
	})
	resume := pauseEtcd(t, etcd)
	paused := time.Now()

	// A submission is refused with 503 and Retry-After, within one
	// EtcdTimeout (at once, once the alarm poll has noticed).
	start := time.Now()
	resp, err := http.Post(api+"/v1/jobs", "application/json", strings.NewReader(`{"prompt":"during the outage"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(b), "etcd unreachable") || !strings.Contains(string(b), httpapi.CodeUnavailable) {
		t.Fatalf("submit during the outage: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	if took > etcdTimeout+time.Second {
		t.Fatalf("submit refused after %v; want within EtcdTimeout %v", took, etcdTimeout)
	}
	t.Logf("first submission refused after %v: %s", took, strings.TrimSpace(string(b)))

	// /readyz goes 503, naming etcd, once the alarm poll finds it silent.
	eventually(t, 5*time.Second, func() error {
		code, body, _ := getJSON(t, admin+"/readyz", nil)
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "etcd unreachable") {
			return fmt.Errorf("readyz %d %q", code, body)
		}
		return nil
	})
	t.Logf("readyz 503 %v after the pause", time.Since(paused).Round(time.Millisecond))

	// Now refusals are immediate, and a long poll does not outlast its wait.
	start = time.Now()
	code, body = post(t, api+"/v1/jobs", `{"prompt":"during the outage"}`)
	if took := time.Since(start); code != http.StatusServiceUnavailable || took > 500*time.Millisecond {
		t.Fatalf("second submission: %d after %v: %s", code, took, body)
	}
	code, sbody, took := getJSON(t, api+"/v1/jobs/"+job.ID+"?wait=2s", nil)
	if code != http.StatusServiceUnavailable || took > 2*time.Second+etcdTimeout+time.Second {
		t.Fatalf("long poll during the outage: %d after %v: %s", code, took, sbody)
	}

	// The sampler was not held up by its progress writes: the denoise ended
	// during the outage and its commit waits for etcd.
	eventually(t, 10*time.Second, func() error {
		if logs.FilterMessage("commit failed; keeping the output and retrying").Len() == 0 {
			return fmt.Errorf("no commit attempted during the outage")
		}
		return nil
	})
	time.Sleep(time.Second) // a few failed attempts
	t.Logf("etcd paused for %v", resume().Round(time.Millisecond))

	var done jobs.Job
	eventually(t, time.Minute, func() error {
		code, body, _ := getJSON(t, api+"/v1/jobs/"+job.ID+"?wait=10s", &done)
		if code != http.StatusOK || done.State != jobs.Succeeded {
			return fmt.Errorf("job: %d %s", code, body)
		}
		return nil
	})
	if st := done.Stages[jobs.Denoise]; st == nil || st.Attempt != 1 {
		t.Fatalf("denoise ran again: %+v", st)
	}
	eventually(t, 10*time.Second, func() error {
		if code, body, _ := getJSON(t, admin+"/readyz", nil); code != http.StatusOK {
			return fmt.Errorf("readyz %d %q", code, body)
		}
		return nil
	})
	// And the mesh takes new work again.
	code, body = post(t, api+"/v1/jobs", `{"prompt":"after the outage","steps":2,"width":64,"height":64}`)
	if code != http.StatusAccepted {
		t.Fatalf("submit after the outage: %d %s", code, body)
	}
	var after jobs.Job
	json.Unmarshal(body, &after)
	eventually(t, time.Minute, func() error {
		var j jobs.Job
		if getJSON(t, api+"/v1/jobs/"+after.ID+"?wait=10s", &j); j.State != jobs.Succeeded {
			return fmt.Errorf("job after the outage: %s", j.State)
		}
		return nil
	})
}

// A video's denoise hands off early, committing when its first frame is
// final. When that commit meets a silent etcd it keeps the payload, the
// sampler finishes the tail, and the commit is retried until etcd answers:
// the denoise is not run again.
func TestEarlyHandoffCommitSurvivesEtcdOutage(t *testing.T) {
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no etcd binary and not root to install it: %v", err)
		}
		t.Fatal(err)
	}
	etcd := startEtcdProcess(t)
	obs, logs := observer.New(zap.InfoLevel)
	const step = time.Second // simulated: the last step finishes one frame per 125 ms
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.EtcdEndpoints = etcd.Endpoints()
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), obs))
		c.Agent.TransferMode = jobs.P2P // early handoff is for peer-to-peer latents
		c.Agent.EtcdTimeout = time.Second
		c.Agent.AlarmEvery = 500 * time.Millisecond
		// Longer than the outage: a lone etcd member paused past a lease's
		// TTL expires it on resuming (it cannot tell the time it lost).
		c.Agent.Gossip.LeaseTTL = 20 * time.Second
		c.Agent.Engine.StepCost = step
	})
	a := cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := engine.Spec{Prompt: "a river through the outage", Seed: 21, Width: 64, Height: 64, Frames: 8, Steps: 6}.WithDefaults()
	job, err := a.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	// Pause etcd a step or two before the last one, whose first frame
	// starts the early commit.
	waitDenoiseStep(t, ctx, a, job.ID, func(step int) bool { return step >= spec.Steps/2 && step < spec.Steps-1 })
	resume := pauseEtcd(t, etcd)
	// The early commit fails, and is retried, with etcd silent.
	earlyRetries := func() int {
		return logs.FilterMessage("commit failed; keeping the output and retrying").FilterField(zap.Bool("early", true)).Len()
	}
	eventually(t, 30*time.Second, func() error {
		if n := earlyRetries(); n < 2 {
			return fmt.Errorf("%d early commit attempts failed", n)
		}
		return nil
	})
	t.Logf("etcd paused for %v; %d early commit attempts failed meanwhile", resume().Round(time.Millisecond), earlyRetries())

	var done jobs.Job
	eventually(t, time.Minute, func() error {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if done, err = a.Wait(wctx, job.ID); err != nil {
			return err
		}
		return nil
	})
	if done.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", done.State, done.Error)
	}
	den, dec := done.Stages[jobs.Denoise], done.Stages[jobs.Decode]
	if den == nil || den.Attempt != 1 || dec == nil || dec.Attempt != 1 || done.Rewinds != 0 {
		t.Fatalf("denoise %+v, decode %+v, %d rewinds: want each stage once", den, dec, done.Rewinds)
	}
	// It was handed off early: its work was counted up to the first frame.
	// An attempt that got no answer may have committed it, and the retry
	// that learns so come after the job finished (earlyCommit then reads
	// the job's record): the denoise worker says so when it knows.
	if den.Millis >= float64(spec.Steps)*float64(step.Milliseconds()) {
		t.Fatalf("denoise not committed early: %+v", den)
	}
	eventually(t, 10*time.Second, func() error {
		if n := logs.FilterMessage("stage committed early").FilterField(zap.String("job", job.ID)).Len(); n != 1 {
			return fmt.Errorf("the denoise worker logged %d early commits, want 1", n)
		}
		return nil
	})
	data, _, err := a.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, spec)) {
		t.Fatal("file differs from the engine run in one process")
	}
}

// leaseLoss is a disaggregated in-process mesh on an etcd process, with
// its logs observed and a gate on its etcd writes, for loseLeaseInCommit.
type leaseLoss struct {
	etcd   *EtcdProcess
	cl     *Cluster
	logs   *observer.ObservedLogs
	writes *EtcdWriteGate
}

// leaseLossCluster starts a leaseLoss mesh tuned by tune.
func leaseLossCluster(t *testing.T, tune func(*ClusterConfig)) *leaseLoss {
	t.Helper()
	if _, err := EtcdBinaryAvailable(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no etcd binary and not root to install it: %v", err)
		}
		t.Fatal(err)
	}
	ll := &leaseLoss{etcd: startEtcdProcess(t)}
	obs, logs := observer.New(zap.InfoLevel)
	ll.logs = logs
	ll.cl = startCluster(t, "", func(c *ClusterConfig) {
		c.EtcdEndpoints = ll.etcd.Endpoints()
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), obs))
		c.Agent.EtcdTimeout = time.Second
		// The lease is revoked during the commit's first backoff: long
		// enough that a loaded machine still revokes it before the retry.
		c.Agent.RetryBackoff = 5 * time.Second
		tune(c)
	})
	ll.writes = GateEtcdWrites(ll.cl.Client) // before the agents use it
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, st := range jobs.Stages() {
		if _, err := ll.cl.AddAgent(ctx, string(st)+"-1", st); err != nil {
			t.Fatal(err)
		}
	}
	return ll
}

// loseLeaseInCommit freezes etcd under a running task of job on node, waits
// until the task's commit has failed and backed off, keeps etcd frozen for
// hold more, thaws it and revokes node's lease within that backoff, as an
// etcd majority frozen past the TTL and thawed would expire it. It returns
// the job once it has ended. The agents' writes are held back from the
// freeze until the lease is gone: a commit sent into the frozen etcd could
// take effect when it thaws, and the task would then need no reclaim.
func (ll *leaseLoss) loseLeaseInCommit(t *testing.T, ctx context.Context, a *agent.Agent, node, job string, hold time.Duration) jobs.Job {
	t.Helper()
	rec, err := ll.cl.Client.Get(ctx, prefix+"/nodes/"+node)
	if err != nil || len(rec.Kvs) != 1 {
		t.Fatalf("%s's record: %v %v", node, rec, err)
	}
	lease := clientv3.LeaseID(rec.Kvs[0].Lease)
	ll.writes.Shut()
	defer ll.writes.Open()
	resume := pauseEtcd(t, ll.etcd)
	eventually(t, 30*time.Second, func() error {
		if ll.logs.FilterMessage("commit failed; keeping the output and retrying").FilterField(zap.String("job", job)).Len() == 0 {
			return fmt.Errorf("the commit has not failed and backed off yet")
		}
		return nil
	})
	time.Sleep(hold)
	resume()
	// Within the commit's backoff the lease goes (it may already have).
	rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = ll.cl.Client.Revoke(rctx, lease)
	rcancel()
	if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatal(err)
	}
	ll.writes.Open()
	var done jobs.Job
	eventually(t, time.Minute, func() error {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		done, err = a.Wait(wctx, job)
		return err
	})
	return done
}

// A lease lost while a finished stage waits for etcd (a frozen etcd that
// thaws past the TTL expires leases as it resumes; measured with etcd 3.4)
// costs the claim but not the output: the agent takes the task back under
// its new lease, since nobody claimed it meanwhile, and commits it as the
// same attempt.
func TestClaimLostWithOutputFinished(t *testing.T) {
	ll := leaseLossCluster(t, func(c *ClusterConfig) { c.Agent.Engine.StepCost = 100 * time.Millisecond })
	a := ll.cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := engine.Spec{Prompt: "a claim that outlived its lease", Seed: 5, Width: 64, Height: 64, Steps: 20}.WithDefaults()
	job, err := a.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	waitDenoiseStep(t, ctx, a, job.ID, func(step int) bool { return step >= 3 })
	done := ll.loseLeaseInCommit(t, ctx, a, "denoise-1", job.ID, 0)
	if done.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", done.State, done.Error)
	}
	if den := done.Stages[jobs.Denoise]; den == nil || den.Attempt != 1 || den.Node != "denoise-1" || done.Rewinds != 0 {
		t.Fatalf("denoise %+v, %d rewinds: want denoise-1's first attempt", den, done.Rewinds)
	}
	if ll.logs.FilterMessage("claim lost with the output finished; task reclaimed").FilterField(zap.String("job", job.ID)).Len() != 1 {
		t.Fatal("the denoise was not reclaimed")
	}
	data, _, err := a.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, spec)) {
		t.Fatal("file differs from the engine run in one process")
	}
}
