package agent

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
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
