package arena_test

import (
	"fmt"

	"github.com/latentmesh/latentmesh/transfer/arena"
)

func Example() {
	cfg := arena.DefaultConfig()
	cfg.Size = 4 << 20
	a, err := arena.New(cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer a.Close()

	b, _ := a.Alloc(10000) // rounded up to 12 KiB internally
	copy(a.Slice(b), "latent bytes")
	s := a.Stats()
	fmt.Println(b.Off, b.Len, s.Used, s.Allocs)

	fmt.Println(a.Free(b), a.Free(b) != nil) // a double free is an error
	// Output:
	// 0 10000 12288 1
	// <nil> true
}
