//go:build !rdma

package rdma

import "testing"

func TestAvailableWithoutTag(t *testing.T) {
	ok, reason := Available()
	if ok || reason != "built without the rdma tag" {
		t.Fatalf("Available() = %v, %q", ok, reason)
	}
}
