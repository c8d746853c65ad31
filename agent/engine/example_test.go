package engine_test

import (
	"context"
	"fmt"

	"github.com/latentmesh/latentmesh/agent/engine"
)

func Example() {
	e, err := engine.New(engine.DefaultConfig())
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	s := engine.Spec{Prompt: "a lighthouse at dusk", Seed: 1}.WithDefaults()

	cond, err := e.Encode(ctx, s) // may run on another agent; cond.Data crosses as bytes
	if err != nil {
		panic(err)
	}
	latent, err := e.Denoise(ctx, s, cond, func(step, total int) {})
	if err != nil {
		panic(err)
	}
	file, contentType, err := e.Decode(ctx, s, latent)
	if err != nil {
		panic(err)
	}
	fmt.Println(e.ID(), cond.Meta.Shape, latent.Meta.Shape, contentType, len(file) > 0)
	// Output: builtin/v4 [2 77 64] [1 4 32 32] image/png true
}
