package agent

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// etcd failures are labelled by their gRPC code, whatever wraps them.
func TestEtcdCode(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{context.Canceled, "Canceled"},
		{fmt.Errorf("jobs: commit: %w", context.DeadlineExceeded), "DeadlineExceeded"},
		{rpctypes.ErrGRPCNoSpace, "ResourceExhausted"},
		{rpctypes.ErrGRPCNoLeader, "Unavailable"},
		{errors.New("something else"), "Unknown"},
	} {
		if got := etcdCode(c.err); got != c.want {
			t.Errorf("etcdCode(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

// Every stage a job runs starts from a claim pushed to its worker: with
// the task, or by the task's dispatcher once it waited (Queue.Push off
// pushes none with the task, so every stage's claim comes that way). One
// agent of every role runs one job each way.
func TestClaimsCounted(t *testing.T) {
	for _, push := range []bool{false, true} {
		t.Run(fmt.Sprintf("push=%v", push), func(t *testing.T) {
			a, _, _ := startAgentWith(t, fmt.Sprintf("claims-%v", push), func(c *Config) { c.Queue.Push = push })
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := a.Start(ctx); err != nil {
				t.Fatal(err)
			}
			for !a.ModelServed(engine.DefaultModel) {
				if ctx.Err() != nil {
					t.Fatal("the built-in model was never served")
				}
				time.Sleep(20 * time.Millisecond)
			}
			j, err := a.Submit(ctx, engine.Spec{Prompt: "a fox", Width: 64, Height: 64, Frames: 1, Steps: 2}, jobs.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if done, err := a.Wait(ctx, j.ID); err != nil || done.State != jobs.Succeeded {
				t.Fatalf("job: %v %v", done.State, err)
			}
			var sum httpapi.ClaimCounts
			for st, c := range a.Claims() {
				if c.PushedStarted != 1 || c.GivenBack != 0 || c.Conflicts < 0 {
					t.Errorf("%s: %+v, want one claim pushed and started, none given back", st, c)
				}
				sum = sum.Add(c)
			}
			hands := int64(0) // pushed with its task: no hand-on
			if !push {
				hands = 3 // none pushed with its task: each handed on once
			}
			if sum.PushedStarted != 3 || sum.Txns != hands || sum.Conflicts != 0 {
				t.Fatalf("%+v, want every stage's claim pushed and started, %d of them by a hand-on, none refused", sum, hands)
			}
			t.Logf("claims %+v", sum)
		})
	}
}
