package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/transfer"
)

// trustMesh is three started agents on one embedded etcd, each seeing the
// others registered; their workers run only the decode stage, so the test
// drives encode and denoise tasks by hand.
type trustMesh struct {
	cli    *clientv3.Client
	jobs   *jobs.Store
	agents []*Agent
	logs   *observer.ObservedLogs // Warn and above, from every agent
}

func startTrustMesh(t *testing.T) *trustMesh {
	t.Helper()
	ctx := context.Background()
	cli := embeddedEtcd(t)
	core, logs := observer.New(zapcore.WarnLevel)
	m := &trustMesh{cli: cli, logs: logs}
	for i := range 3 {
		cfg := DefaultLocalConfig()
		cfg.NodeID = fmt.Sprintf("trust-%d", i)
		cfg.Roles = []jobs.Stage{jobs.Decode}
		cfg.Logger = zap.New(core)
		cfg.HTTPListen, cfg.AdminListen = "", ""
		m.agents = append(m.agents, runAgent(t, ctx, cli, cfg))
	}
	jc := jobs.DefaultConfig()
	jc.Prefix = m.agents[0].cfg.Prefix
	var err error
	if m.jobs, err = jobs.NewStore(cli, jc); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, a := range m.agents {
		for _, b := range m.agents {
			for !a.admitPeer(b.host.ID()) {
				if time.Now().After(deadline) {
					t.Fatalf("%s does not see %s registered", a.id, b.id)
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	return m
}

func trustCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// outsider is a transfer service on a libp2p host no agent registered, and
// that host's peer id.
func outsider(t *testing.T) (*transfer.Service, string) {
	t.Helper()
	h, err := transfer.NewHost("/ip4/127.0.0.1/tcp/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	s, err := transfer.New(transfer.DefaultConfig(), h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, h.ID().String()
}

func (m *trustMesh) refused(peerID string) bool {
	for _, e := range m.logs.FilterMessage("peer refused").All() {
		if e.ContextMap()["peer"] == peerID {
			return true
		}
	}
	return false
}

// The first finding: a peer not registered in etcd read another
// job's payload by naming its id. Now its connection is refused (and
// logged with its peer id) while a registered member still reads.
func TestUnregisteredPeerCannotReadPayload(t *testing.T) {
	m := startTrustMesh(t)
	prod, member := m.agents[0], m.agents[1]
	data := []byte("another job's latent, 32 bytes.")
	ref, err := prod.xfer.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(len(data))}}, data)
	if err != nil {
		t.Fatal(err)
	}
	out, outID := outsider(t)
	if _, err := out.Pull(trustCtx(t), ref); err == nil {
		t.Fatal("an unregistered peer pulled a payload")
	}
	if !m.refused(outID) {
		t.Fatalf("refusal of %s not logged: %v", outID, m.logs.All())
	}
	got, err := member.xfer.Pull(trustCtx(t), ref)
	if err != nil || string(got) != string(data) {
		t.Fatalf("member pull: %q, %v", got, err)
	}
}

// claimTask claims the first pending task of stage for node.
func (m *trustMesh) claimTask(t *testing.T, stage jobs.Stage, node string) *jobs.Claim {
	t.Helper()
	lease, err := m.cli.Grant(trustCtx(t), 60)
	if err != nil {
		t.Fatal(err)
	}
	tasks, _, err := m.jobs.Pending(trustCtx(t), stage)
	if err != nil || len(tasks) == 0 {
		t.Fatalf("pending %s: %v, %v", stage, tasks, err)
	}
	c, err := m.jobs.TryClaim(trustCtx(t), tasks[0], node, lease.ID)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// A peer-to-peer stage output gets a ticket only for the node holding the
// claim on the task that reads it, proven by that claim: another member,
// the holder without its proof, or anyone once the claim is gone is denied.
func TestHandoffTicketOnlyToClaimHolder(t *testing.T) {
	m := startTrustMesh(t)
	prod, cons, other := m.agents[0], m.agents[1], m.agents[2]
	if _, err := m.jobs.Submit(trustCtx(t), engine.Spec{Prompt: "x", Steps: 1, Width: 64, Height: 64, Frames: 1}, jobs.Options{}); err != nil {
		t.Fatal(err)
	}
	enc := m.claimTask(t, jobs.Encode, prod.id)
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	ref, err := prod.xfer.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{1 << 20}}, data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := prod.output(enc, ref, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := m.jobs.Commit(trustCtx(t), enc, out); err != nil {
		t.Fatal(err)
	}
	den := m.claimTask(t, jobs.Denoise, cons.id)

	dst := make([]byte, len(data))
	if err := cons.xfer.PullInto(withClaim(trustCtx(t), den), ref, dst); err != nil {
		t.Fatalf("claim holder pull: %v", err)
	}
	for name, pull := range map[string]func() error{
		"holder without proof":      func() error { return cons.xfer.PullInto(trustCtx(t), ref, dst) },
		"other member, no proof":    func() error { return other.xfer.PullInto(trustCtx(t), ref, dst) },
		"other member, its proof":   func() error { return other.xfer.PullInto(withClaim(trustCtx(t), den), ref, dst) },
		"holder, a forged revision": func() error { c := *den; c.Rev++; return cons.xfer.PullInto(withClaim(trustCtx(t), &c), ref, dst) },
	} {
		if err := pull(); !errors.Is(err, transfer.ErrDenied) {
			t.Errorf("%s: %v, want ErrDenied", name, err)
		}
	}
	if !m.refused(other.host.ID().String()) {
		t.Errorf("refusal of %s not logged", other.id)
	}
	if err := m.jobs.Drop(trustCtx(t), den); err != nil {
		t.Fatal(err)
	}
	if err := cons.xfer.PullInto(withClaim(trustCtx(t), den), ref, dst); !errors.Is(err, transfer.ErrDenied) {
		t.Fatalf("pull on a dropped claim: %v, want ErrDenied", err)
	}
}

// A task whose input names a producer peer other than the registered peer
// of the input's node (a task forged in etcd) is not pulled from: the input
// is lost, and logged.
func TestForgedProducerIsLostInput(t *testing.T) {
	m := startTrustMesh(t)
	worker, honest := m.agents[0], m.agents[1]
	out, outID := outsider(t)
	ref, err := out.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{64}}, make([]byte, 64))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(ref)
	if err != nil {
		t.Fatal(err)
	}
	for _, node := range []string{honest.id, "nobody"} {
		_, _, err := worker.pull(trustCtx(t), []jobs.Input{{Payload: ref.ID, Node: node, Ref: raw}})
		if !errors.Is(err, errInputLost) {
			t.Fatalf("input on %s served by %s: %v, want errInputLost", node, outID, err)
		}
	}
	if len(m.logs.FilterMessage("input names a producer that is not its node's registered peer; not pulling").All()) == 0 {
		t.Fatal("forged producer not logged")
	}
	// The honest producer's own ref passes the check.
	good, err := honest.xfer.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{64}}, make([]byte, 64))
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.checkProducer(jobs.Input{Payload: good.ID, Node: honest.id}, good); err != nil {
		t.Fatal(err)
	}
	// The Store's reads apply the same rule to an object's holders.
	if !worker.registeredAs(honest.id, good.Producer.PeerID) || worker.registeredAs(honest.id, outID) || worker.registeredAs("nobody", outID) {
		t.Fatal("registeredAs does not match node to registered peer id")
	}
}
