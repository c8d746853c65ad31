package transfer_test

import (
	"context"
	"fmt"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"
)

func Example() {
	ctx := context.Background()
	newNode := func() (*transfer.Service, func()) {
		h, err := libp2p.New(
			libp2p.ListenAddrStrings("/ip4/127.0.0.1/tcp/0"),
			libp2p.Transport(tcp.NewTCPTransport),
			libp2p.DisableRelay(),
		)
		if err != nil {
			panic(err)
		}
		s, err := transfer.New(transfer.DefaultConfig(), h)
		if err != nil {
			panic(err)
		}
		return s, func() { s.Close(); h.Close() }
	}
	producer, stopP := newNode()
	defer stopP()
	consumer, stopC := newNode()
	defer stopC()

	latent := make([]byte, 4*8*8*2) // float16 [4,8,8]
	ref, err := producer.Publish(transfer.TensorMeta{DType: transfer.Float16, Shape: []int64{4, 8, 8}}, latent)
	if err != nil {
		panic(err)
	}
	// ref travels to the consumer, e.g. in an etcd task record.
	got, err := consumer.Pull(ctx, ref)
	if err != nil {
		panic(err)
	}
	fmt.Println(len(got), "bytes")
	producer.Release(ref.ID)
	// Output: 512 bytes
}
