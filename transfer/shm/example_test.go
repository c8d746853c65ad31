package shm_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"github.com/latentmesh/latentmesh/transfer/arena"
	"github.com/latentmesh/latentmesh/transfer/shm"
)

func Example() {
	dir, _ := os.MkdirTemp("", "shm-example")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "arena.sock")

	// Producer: an arena exported on a Unix socket.
	a, _ := arena.New(arena.DefaultTestConfig())
	defer a.Close()
	srv, _ := shm.NewServer(a, shm.DefaultServerConfig("agent-a"))
	l, _ := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()
	defer func() { srv.Close(); <-served }()

	buf, _ := a.Alloc(5)
	copy(a.Slice(buf), "hello")
	h := srv.Handle(buf) // this travels over the control plane

	// Consumer: maps the producer's arena once, then reads by handle.
	ctx := context.Background()
	peer, err := shm.Dial(ctx, path, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer peer.Close()

	v, _ := peer.View(ctx, h) // in place, pinned until Release
	fmt.Println(string(v))
	peer.Release(h)

	dst := make([]byte, h.Len)
	_ = peer.CopyInto(ctx, h, dst) // or copied out
	fmt.Println(string(dst))
	// Output:
	// hello
	// hello
}
