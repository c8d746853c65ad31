package agent

// A decode stage decodes its latent chunk by chunk as the chunks land
// (decode). With an external engine granted extengine's FeatureDecodeState
// the chunks of one decode stage are one stream on the engine, so that a
// causal 3D VAE carries its cache from one chunk to the next: they are
// sent in index order, one at a time, the last one marked, and the stream
// is closed when the stage ends however it ends (the engine then drops
// what it kept).

import (
	"iter"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/extengine"
	"github.com/latentmesh/latentmesh/transfer"
)

// streamDecoders is a runner whose decoders keep a stream per decode
// stage (externalRunner).
type streamDecoders interface {
	NewJobDecoder(s engine.Spec, job string) (FrameDecoder, func(), error)
}

// newDecoder is the runner's decoder of job's decode stage, and what to
// call when the stage ends.
func (a *Agent) newDecoder(s engine.Spec, job string) (FrameDecoder, func(), error) {
	if sd, ok := a.runner.(streamDecoders); ok {
		return sd.NewJobDecoder(s, job)
	}
	fd, err := a.runner.NewDecoder(s)
	return fd, func() {}, err
}

// NewJobDecoder is NewDecoder whose chunks form one stream of job's on
// the engine; close ends it.
func (x *externalRunner) NewJobDecoder(s engine.Spec, job string) (FrameDecoder, func(), error) {
	fd, err := x.NewDecoder(s)
	if err != nil {
		return nil, func() {}, err
	}
	d := fd.(*externalDecoder)
	d.stream = extengine.NewStream(job)
	return d, d.stream.Close, nil
}

// decodeOrder is how decoder fd takes the chunks of ch: a decode stream's
// in index order (inOrder), any other's as they land, so that a chunk
// striping delivers early is decoded at once.
func decodeOrder(fd FrameDecoder, ch <-chan transfer.Chunk) iter.Seq[transfer.Chunk] {
	if d, ok := fd.(*externalDecoder); ok && d.stream != nil {
		return inOrder(ch)
	}
	return func(yield func(transfer.Chunk) bool) {
		for c := range ch {
			if !yield(c) {
				return
			}
		}
	}
}

// inOrder yields the chunks of ch in index order: a chunk that lands
// before its predecessors (striping may interleave neighbours) waits for
// them. Its bytes are already in the pull's buffer, so waiting costs no
// memory; a chunk whose predecessor never lands is never yielded (the pull
// then fails).
func inOrder(ch <-chan transfer.Chunk) iter.Seq[transfer.Chunk] {
	return func(yield func(transfer.Chunk) bool) {
		held := map[int]transfer.Chunk{}
		next := 0
		for c := range ch {
			held[c.Index] = c
			for {
				c, ok := held[next]
				if !ok {
					break
				}
				delete(held, next)
				next++
				if !yield(c) {
					return
				}
			}
		}
	}
}
