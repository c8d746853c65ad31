//go:build tools

// Package tools pins module dependencies that the build needs before the
// code that imports them is written. It is never compiled into a binary.
package tools

import (
	_ "github.com/zeebo/xxh3"
	_ "github.com/hashicorp/memberlist"
	_ "github.com/libp2p/go-libp2p"
	_ "github.com/vmihailenco/msgpack/v5"
	_ "go.etcd.io/etcd/client/v3"
	_ "go.etcd.io/etcd/server/v3/embed"
	_ "go.uber.org/goleak"
	_ "go.uber.org/zap"
)
