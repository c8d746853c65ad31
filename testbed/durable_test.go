package testbed

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
	"github.com/latentmesh/latentmesh/routing"
)

// restartAgent kills agent id with SIGKILL, waits until its lease has
// expired (its registration is gone: the mesh has noticed), and starts it
// again under the same node id and state directory.
func (m *mesh) restartAgent(t *testing.T, p *Process, id, role string, extra ...string) (*Process, gossip.NodeRecord) {
	t.Helper()
	p.Kill()
	eventually(t, 20*time.Second, func() error {
		resp, err := m.cli.Get(context.Background(), "/latentmesh/default/nodes/"+id)
		if err != nil {
			return err
		}
		if len(resp.Kvs) != 0 {
			return fmt.Errorf("%s still registered", id)
		}
		return nil
	})
	return m.agent(id, role, extra...)
}

// resultHolders waits until job's result record names want holders, every
// one of them registered, and returns them.
func resultHolders(t *testing.T, m *mesh, job string, want int) []string {
	t.Helper()
	var holders []string
	eventually(t, 30*time.Second, func() error {
		r := objects(t, m.cli, jobs.ResultID(job))
		if len(r) != 1 {
			return fmt.Errorf("%d result records", len(r))
		}
		holders = holders[:0]
		for _, h := range r[0].Holders {
			resp, err := m.cli.Get(context.Background(), "/latentmesh/default/nodes/"+h.Node)
			if err != nil {
				return err
			}
			if len(resp.Kvs) == 0 {
				return fmt.Errorf("holder %s not registered", h.Node)
			}
			holders = append(holders, h.Node)
		}
		if len(holders) != want {
			return fmt.Errorf("holders %v, want %d", holders, want)
		}
		return nil
	})
	return holders
}

// finishJob runs a small job through c to success and returns its id and
// file.
func finishJob(t *testing.T, c httpapi.Client, prompt string, seed int64) (string, []byte) {
	t.Helper()
	ctx := context.Background()
	steps := 4
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: prompt, Seed: &seed, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := c.Wait(ctx, job.ID, 60*time.Second); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v %v", done, err)
	}
	file, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	return job.ID, file
}

// servesResult waits until c serves job's file, byte for byte.
func servesResult(t *testing.T, c httpapi.Client, job string, want []byte) {
	t.Helper()
	eventually(t, 20*time.Second, func() error {
		got, _, err := c.Result(context.Background(), job)
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%d bytes, not the file", len(got))
		}
		return nil
	})
}

// Both holders of a result are killed with SIGKILL and restarted, one
// after the other and more than a repair apart (the record names two
// registered holders again before the next kill): the file is served,
// byte-identical, after each restart and at the end.
func TestResultSurvivesHolderRestarts(t *testing.T) {
	m := startMesh(t)
	small := []string{"--arena-size", "64MiB"}
	procs, roles := map[string]*Process{}, map[string]string{}
	var reader string
	for _, a := range [][2]string{{"enc-r", "encode"}, {"den-r", "denoise"}, {"dec-r", "decode"}} {
		p, rec := m.agent(a[0], a[1], small...)
		procs[a[0]], roles[a[0]] = p, a[1]
		reader = rec.HTTPAddr
	}
	ctx := context.Background()
	c := httpapi.Client{BaseURL: "http://" + reader}
	job, want := finishJob(t, c, "a kite over dunes", 11)
	first := resultHolders(t, m, job, 2)
	for _, victim := range first {
		var rec gossip.NodeRecord
		procs[victim], rec = m.restartAgent(t, procs[victim], victim, roles[victim], small...)
		// Read through the agent that just came back: its own copy, or a
		// live holder's.
		c = httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}
		servesResult(t, c, job, want)
		resultHolders(t, m, job, 2) // repaired before the next kill
	}
	got, _, err := c.Result(ctx, job)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("result after both holders restarted: %v", err)
	}
}

// The only holder of a result (a one-agent mesh) is killed with SIGKILL
// and restarted: the file is on its disk, and is served again.
func TestOnlyResultHolderRestarts(t *testing.T) {
	m := startMesh(t)
	all := "encode,denoise,decode"
	p, rec := m.agent("solo", all, "--arena-size", "64MiB")
	job, want := finishJob(t, httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}, "a lantern in fog", 12)
	if h := resultHolders(t, m, job, 1); h[0] != "solo" {
		t.Fatalf("holders %v", h)
	}
	_, rec = m.restartAgent(t, p, "solo", all, "--arena-size", "64MiB")
	servesResult(t, httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}, job, want)
}

// A decode whose claim went with its lease while its commit waited for
// etcd takes the task back and commits it. Its result's staged copies
// outlive the wait (the decode keeps them, and a holder drops a staged
// copy only when etcd has no record naming it), so the reclaimed commit
// names copies that exist, and they stay: the result is served, from the
// first decode attempt, long after the holders' stage timeout.
func TestReclaimedDecodeKeepsResult(t *testing.T) {
	const stageTimeout = 2 * time.Second
	ll := leaseLossCluster(t, func(c *ClusterConfig) {
		c.Agent.Engine.DecodeCost = 1500 * time.Millisecond
		c.Agent.Store.StageTimeout = stageTimeout // passes while the commit waits
	})
	a := ll.cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// A first job takes the results' retention lease, so the next result
	// is staged with no etcd request while etcd is paused.
	warm := engine.Spec{Prompt: "warm the retention lease", Seed: 1, Width: 64, Height: 64, Steps: 2}.WithDefaults()
	wj, err := a.Submit(ctx, warm, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := a.Wait(ctx, wj.ID); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("warm-up: %+v %v", done, err)
	}
	spec := engine.Spec{Prompt: "a result that outlived its lease", Seed: 6, Width: 64, Height: 64, Steps: 2}.WithDefaults()
	job, err := a.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, func() error {
		j, err := a.Get(ctx, job.ID)
		if err != nil {
			return err
		}
		if j.Stage != jobs.Decode || j.State != jobs.Running {
			return fmt.Errorf("job at %s, %s: decode not running yet", j.Stage, j.State)
		}
		return nil
	})
	// The result's staged copies outlive their holders' stage timeout
	// while etcd is away.
	done := ll.loseLeaseInCommit(t, ctx, a, "decode-1", job.ID, 2*stageTimeout)
	if done.State != jobs.Succeeded {
		t.Fatalf("job ended %s: %+v", done.State, done.Error)
	}
	if dec := done.Stages[jobs.Decode]; dec == nil || dec.Attempt != 1 || dec.Node != "decode-1" {
		t.Fatalf("decode %+v: want decode-1's first attempt, reclaimed", dec)
	}
	if ll.logs.FilterMessage("claim lost with the output finished; task reclaimed").FilterField(zap.String("job", job.ID)).Len() != 1 {
		t.Fatal("the decode was not reclaimed")
	}
	want := referenceOutput(t, spec)
	// Past every holder's stage timeout and a few maintenance passes: the
	// committed copies are still there.
	time.Sleep(3 * stageTimeout)
	data, _, err := a.Result(ctx, job.ID)
	if err != nil {
		t.Fatalf("result after the reclaimed commit: %v", err)
	}
	if !bytes.Equal(data, want) {
		t.Fatal("file differs from the engine run in one process")
	}
	if n := ll.logs.FilterMessage("dropped a staged copy whose put never committed").Len(); n != 0 {
		t.Fatalf("%d staged copies dropped", n)
	}
}
