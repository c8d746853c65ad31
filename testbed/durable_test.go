package testbed

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
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

// Both holders of a result are killed with SIGKILL and restarted, one
// after the other and more than a repair apart: the file is served,
// byte-identical, the whole time it is asked for and after.
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
	seed, steps := int64(11), 4
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a kite over dunes", Seed: &seed, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := c.Wait(ctx, job.ID, 60*time.Second); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v %v", done, err)
	}
	want, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	first := resultHolders(t, m, job.ID, 2)
	for _, victim := range first {
		var rec gossip.NodeRecord
		procs[victim], rec = m.restartAgent(t, procs[victim], victim, roles[victim], small...)
		// Read through the agent that just came back: its own copy, or a
		// live holder's.
		c := httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}
		eventually(t, 20*time.Second, func() error {
			got, _, err := c.Result(ctx, job.ID)
			if err != nil {
				return err
			}
			if !bytes.Equal(got, want) {
				return fmt.Errorf("%d bytes, not the file", len(got))
			}
			return nil
		})
		resultHolders(t, m, job.ID, 2) // repaired before the next kill
	}
	got, _, err := c.Result(ctx, job.ID)
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
	ctx := context.Background()
	c := httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}
	seed, steps := int64(12), 4
	job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a lantern in fog", Seed: &seed, Steps: &steps})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := c.Wait(ctx, job.ID, 60*time.Second); err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job: %+v %v", done, err)
	}
	want, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if h := resultHolders(t, m, job.ID, 1); h[0] != "solo" {
		t.Fatalf("holders %v", h)
	}
	_, rec = m.restartAgent(t, p, "solo", all, "--arena-size", "64MiB")
	c = httpapi.Client{BaseURL: "http://" + rec.HTTPAddr}
	eventually(t, 20*time.Second, func() error {
		got, _, err := c.Result(ctx, job.ID)
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("%d bytes, not the file", len(got))
		}
		return nil
	})
}
