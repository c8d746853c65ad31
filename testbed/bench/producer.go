package bench

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// ProducerConfig configures the producer side (ServeProducer).
type ProducerConfig struct {
	// Transfer configures the producer's transfer.Service.
	Transfer transfer.Config
	// Engine gives the latent shape of the overlap benchmark; it must match
	// the consumer's.
	Engine engine.Config
	// ListenIP is the address the producer's libp2p host, data plane and
	// raw-TCP baseline server listen on (each on a port of its own). Its
	// Transfer.DataListen is replaced.
	ListenIP string
	// Logger receives the producer's logs.
	Logger *zap.Logger
}

// DefaultProducerConfig is the transfer and engine defaults on loopback.
func DefaultProducerConfig() ProducerConfig {
	return ProducerConfig{
		Transfer: transfer.DefaultConfig(),
		Engine:   engine.DefaultConfig(),
		ListenIP: "127.0.0.1", // same host as the consumer
		Logger:   zap.NewNop(),
	}
}

// ServeProducer runs the producer side of a benchmark. It answers one JSON
// request per line of in, on out, until in ends, a quit request arrives or
// ctx ends. The first request must be a start: it brings up a libp2p host, a
// transfer.Service (with an arena of the requested size) and the raw-TCP
// baseline server, and is answered with their addresses.
func ServeProducer(ctx context.Context, cfg ProducerConfig, in io.Reader, out io.Writer) (err error) {
	eng, err := engine.New(cfg.Engine)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Requests are read on their own goroutine so ctx can end the loop while
	// a read blocks. The reader ends when in does: the consumer closes the
	// pipe, or the process exits.
	reqs := make(chan request)
	readErr := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(in)
		sc.Buffer(make([]byte, 4096), maxLine)
		for sc.Scan() {
			var q request
			if err := json.Unmarshal(sc.Bytes(), &q); err != nil {
				readErr <- fmt.Errorf("bench: producer: bad request %q: %w", sc.Text(), err)
				return
			}
			select {
			case reqs <- q:
			case <-ctx.Done():
				return
			}
		}
		readErr <- sc.Err()
	}()
	next := func() (request, error) {
		select {
		case <-ctx.Done():
			return request{Op: opQuit}, nil
		case err := <-readErr:
			if err == nil {
				return request{Op: opQuit}, nil
			}
			return request{}, err
		case q := <-reqs:
			return q, nil
		}
	}

	start, err := next()
	if err != nil || start.Op == opQuit {
		return err
	}
	if start.Op != opStart {
		return fmt.Errorf("bench: producer: first request is %q, want %q", start.Op, opStart)
	}
	tcfg := cfg.Transfer
	tcfg.Logger = cfg.Logger
	tcfg.TCPCongestion = start.TCPCongestion
	tcfg.DataListen = net.JoinHostPort(cfg.ListenIP, "0")
	if start.ArenaBytes > 0 {
		tcfg.Arena = arena.DefaultConfig()
		tcfg.Arena.Name = "latentmesh-bench-producer"
		tcfg.Arena.Size = start.ArenaBytes
	}
	h, err := newHost(cfg.ListenIP)
	if err != nil {
		return err
	}
	defer h.Close()
	svc, err := transfer.New(tcfg, h)
	if err != nil {
		return err
	}
	defer svc.Close()
	raw, err := newRawServer(net.JoinHostPort(cfg.ListenIP, "0"), start.TCPCongestion)
	if err != nil {
		return err
	}
	defer raw.close()

	p := &producer{svc: svc, raw: raw, eng: eng, rawKeys: make(map[string]uint64)}
	defer p.wg.Wait() // before the service closes, after ctx is cancelled
	defer cancel()
	hi := hello{V: protoVersion, PeerID: h.ID().String(), DataAddr: svc.DataAddr(), RawAddr: raw.addr(), RawTunedAddr: raw.tunedAddr()}
	for _, a := range h.Addrs() {
		hi.P2PAddrs = append(hi.P2PAddrs, a.String())
	}
	enc := json.NewEncoder(out)
	if err := enc.Encode(hi); err != nil {
		return fmt.Errorf("bench: producer: write hello: %w", err)
	}
	for {
		q, err := next()
		if err != nil {
			return err
		}
		if q.Op == opQuit {
			return nil
		}
		resp, err := p.handle(ctx, q)
		if err != nil {
			resp = response{Err: err.Error()}
		}
		if err := enc.Encode(resp); err != nil {
			return fmt.Errorf("bench: producer: write response: %w", err)
		}
	}
}

// producer is the state behind ServeProducer's request loop; only that loop
// touches rawKeys.
type producer struct {
	svc     *transfer.Service
	raw     *rawServer
	eng     *engine.Engine
	rawKeys map[string]uint64 // payload id -> raw server key
	wg      sync.WaitGroup    // latent writers
}

func (p *producer) handle(ctx context.Context, q request) (response, error) {
	switch q.Op {
	case opPublish:
		return p.publish(q)
	case opLatent:
		return p.latent(ctx, q)
	case opRelease:
		// The raw server stops reading the bytes before the arena may reuse them.
		if k, ok := p.rawKeys[q.ID]; ok {
			p.raw.remove(k)
			delete(p.rawKeys, q.ID)
		}
		p.svc.Release(q.ID)
		return response{}, nil
	}
	return response{}, fmt.Errorf("bench: producer: unknown op %q", q.Op)
}

// publish publishes Size pseudo-random bytes in Chunks chunks (shape
// [Chunks, Size/Chunks] uint8); an unchunked payload is also served by the
// raw-TCP baseline server, from the same buffer.
func (p *producer) publish(q request) (response, error) {
	chunks := max(q.Chunks, 1)
	if q.Size <= 0 || q.Size%int64(chunks) != 0 {
		return response{}, fmt.Errorf("bench: producer: size %d not a positive multiple of %d chunks", q.Size, chunks)
	}
	meta := transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(chunks), q.Size / int64(chunks)}, NumChunks: chunks}
	// From the arena when there is one, as an engine writes its outputs, so
	// shm consumers can read the payload in place.
	buf, err := p.svc.Alloc(q.Size)
	if err != nil {
		return response{}, err
	}
	defer buf.Release() // the published payload keeps the region
	data := buf.Bytes()
	fill(data, uint64(q.Size))
	ref, err := p.svc.Publish(meta, data)
	if err != nil {
		return response{}, err
	}
	resp := response{Ref: ref}
	if chunks == 1 {
		resp.RawKey = p.raw.add(data)
		p.rawKeys[ref.ID] = resp.RawKey
	}
	return resp, nil
}

// latent begins publishing a video latent of the engine's shape and writes
// frame k (one chunk each) at (k+1)*Interval after the request, as a
// denoiser finishing frames one by one would. It answers at once.
func (p *producer) latent(ctx context.Context, q request) (response, error) {
	spec := latentSpec(q.Frames, q.Width, q.Height)
	if err := spec.Validate(p.eng.Config().Limits); err != nil {
		return response{}, fmt.Errorf("bench: producer: latent: %w", err)
	}
	meta := p.eng.LatentMeta(spec)
	start := time.Now()
	pend, ref, err := p.svc.Begin(meta)
	if err != nil {
		return response{}, err
	}
	p.wg.Go(func() {
		defer pend.Done()
		if err := writeFrames(ctx, pend, meta, start, q.Interval); err != nil && !errors.Is(err, context.Canceled) {
			fmt.Fprintf(os.Stderr, "bench: producer: latent %s: %v\n", ref.ID, err)
		}
	})
	return response{Ref: ref}, nil
}

// writeFrames fills chunk k of pend with finite latent values and marks it
// ready at start+(k+1)*interval.
func writeFrames(ctx context.Context, pend *transfer.Pending, meta transfer.TensorMeta, start time.Time, interval time.Duration) error {
	buf := pend.Buf()
	for k := range meta.Chunks() {
		if err := sleepUntil(ctx, start.Add(time.Duration(k+1)*interval)); err != nil {
			return err
		}
		off, n := meta.ChunkRange(k)
		for i := off; i < off+n; i += 4 {
			v := float32(1.5 * math.Sin(float64(i)*1e-3+float64(k)))
			binary.LittleEndian.PutUint32(buf[i:], math.Float32bits(v))
		}
		if err := pend.ChunkReady(k); err != nil {
			return err
		}
	}
	return nil
}

// sleepUntil waits until t or until ctx ends.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// latentSpec is the engine request whose latent the overlap benchmark moves.
func latentSpec(frames, width, height int) engine.Spec {
	return engine.Spec{Prompt: "latentmesh bench overlap", Seed: 1, Width: width, Height: height, Frames: frames, Steps: 1, GuidanceScale: 5}
}
