package jobs

import (
	"context"
	"fmt"
	"testing"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestIsUnavailable(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{fmt.Errorf("%w: no answer", ErrUnavailable), true},
		{status.Error(codes.Unavailable, "connection refused"), true},
		{fmt.Errorf("jobs: get x: %w", status.Error(codes.DeadlineExceeded, "slow")), true},
		{rpctypes.ErrTimeout, true},
		{rpctypes.ErrNoLeader, true},
		// A leaderless member's write that timed out on the member.
		{fmt.Errorf("cache: grant retention lease: %w", status.Error(codes.Unknown, context.DeadlineExceeded.Error())), true},
		{status.Error(codes.Unknown, "something else"), false},
		{context.DeadlineExceeded, false}, // the caller's deadline, not necessarily etcd's
		{rpctypes.ErrRequestTooLarge, false},
		{ErrNoSpace, false},
		{ErrFenced, false},
	} {
		if got := IsUnavailable(c.err); got != c.want {
			t.Errorf("IsUnavailable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
