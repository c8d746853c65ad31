//go:build rdma && !cgo

package rdma

// The rdma tag builds the libibverbs transport, which is cgo: build with
// CGO_ENABLED=1 (and libibverbs-dev installed), or without the tag. The
// undefined name below makes that the compile error.
var _ = rdma_build_tag_requires_CGO_ENABLED_1
