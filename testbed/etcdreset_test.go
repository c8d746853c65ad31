package testbed

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/gossip"
)

// The etcd under an idle mesh is replaced by an empty one at the same
// address (`latentmesh-dev dev --agents 0` restarted): the agents notice that
// etcd's history went backwards, register again and watch the new etcd, so
// a job submitted afterwards completes without restarting any agent.
func TestEtcdReplacedUnderIdleMesh(t *testing.T) {
	addr, err := freeLoopbackPort()
	if err != nil {
		t.Fatal(err)
	}
	m := startMeshListen(t, addr)
	_, enc := m.agent("enc-z", "encode")
	_, den := m.agent("den-z", "denoise")
	_, dec := m.agent("dec-z", "decode")
	c := httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	seed, side, steps := int64(11), 64, 3
	req := httpapi.JobRequest{Prompt: "a lighthouse", Seed: &seed, Width: &side, Height: &side, Steps: &steps}
	// A few jobs first, so the old etcd's revision is well past anything
	// the new one reaches while the agents register again.
	for range 3 {
		job, err := c.Submit(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if done, err := c.Wait(ctx, job.ID, 60*time.Second); err != nil || done.State != jobs.Succeeded {
			t.Fatalf("job before the swap: %+v %v", done, err)
		}
	}

	// Replace etcd: the old one goes with its data, an empty one takes its
	// address. No agent is restarted.
	m.cli.Close()
	if err := m.procs[0].Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	dev, err := StartProcess("dev2", devBinary, nil, "dev", "--agents", "0", "--etcd-listen", addr)
	if err != nil {
		t.Fatal(err)
	}
	m.procs[0] = dev
	if _, err := dev.WaitFor(ctx, regexp.MustCompile(`etcd endpoint: (\S+)`)); err != nil {
		t.Fatal(err)
	}
	if m.cli, err = NewEtcdClient([]string{m.endpoint}, nil); err != nil {
		t.Fatal(err)
	}
	swapped := time.Now()

	// Every agent registers again with the new etcd.
	for _, id := range []string{enc.ID, den.ID, dec.ID} {
		eventually(t, 30*time.Second, func() error {
			resp, err := m.cli.Get(ctx, "/latentmesh/default/nodes/"+id)
			if err != nil {
				return err
			}
			if len(resp.Kvs) == 0 {
				return fmt.Errorf("%s not registered with the new etcd", id)
			}
			return nil
		})
	}
	// What the old etcd recorded is gone: the payloads and Store copies
	// of the earlier jobs are released, and each agent counted the reset.
	for _, rec := range []gossip.NodeRecord{enc, den, dec} {
		eventually(t, 30*time.Second, func() error {
			st, err := adminStatus(ctx, rec.AdminAddr)
			if err != nil {
				return err
			}
			if st.EtcdResets < 1 || st.Data.HeldPayloads != 0 || st.Store.Copies != 0 {
				return fmt.Errorf("%s: %d etcd resets, %d payloads and %d Store copies held", rec.ID, st.EtcdResets, st.Data.HeldPayloads, st.Store.Copies)
			}
			return nil
		})
	}
	job, err := c.Submit(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	done, err := c.Wait(ctx, job.ID, 60*time.Second)
	if err != nil || done.State != jobs.Succeeded {
		t.Fatalf("job after the swap: %+v %v\n%s", done, err, m.outputs())
	}
	t.Logf("job after the swap done %v after it", time.Since(swapped).Round(time.Millisecond))
	data, _, err := c.Result(ctx, job.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, referenceOutput(t, done.Spec)) {
		t.Fatal("file differs from the engine run in one process")
	}
}
