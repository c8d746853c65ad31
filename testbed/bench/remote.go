package bench

import (
	"context"

	"github.com/latentmesh/latentmesh/transfer"
)

// RemoteProducer is a producer process (ServeProducer) driven from this one:
// it publishes payloads for this process to pull, as the benchmarks do, so
// a test can put the producer somewhere else, in a network namespace, say.
type RemoteProducer struct {
	c *child
}

// StartProducer starts argv (a command running ServeProducer, such as
// ProducerCommand) with env appended to the environment, with an arena of
// arenaBytes (0: none) and the data plane's congestion control set to
// congestion (empty: the system default).
func StartProducer(ctx context.Context, argv, env []string, arenaBytes int64, congestion string) (*RemoteProducer, error) {
	c, err := startChild(ctx, argv, env, request{ArenaBytes: arenaBytes, TCPCongestion: congestion})
	if err != nil {
		return nil, err
	}
	return &RemoteProducer{c: c}, nil
}

// Publish publishes size pseudo-random bytes in chunks chunks and returns
// the reference to pull them by. Only one goroutine may call a
// RemoteProducer at a time.
func (p *RemoteProducer) Publish(size int64, chunks int) (transfer.Ref, error) {
	resp, err := p.c.call(request{Op: opPublish, Size: size, Chunks: chunks})
	return resp.Ref, err
}

// Close stops the producer and returns its failure, with its stderr.
func (p *RemoteProducer) Close() error { return p.c.close() }
