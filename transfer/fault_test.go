package transfer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// stallProxy forwards TCP to target but passes at most budget bytes from the
// producer to the consumer per connection, then goes silent without closing:
// a partition as the consumer sees it.
type stallProxy struct {
	ln     net.Listener
	budget int64
	wg     sync.WaitGroup

	mu     sync.Mutex
	target string
	conns  []net.Conn
}

func newStallProxy(t *testing.T, budget int64) *stallProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{ln: ln, budget: budget}
	p.wg.Add(1)
	go p.run()
	t.Cleanup(p.close)
	return p
}

func (p *stallProxy) addr() string { return p.ln.Addr().String() }

func (p *stallProxy) setTarget(a string) {
	p.mu.Lock()
	p.target = a
	p.mu.Unlock()
}

func (p *stallProxy) run() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		target := p.target
		p.mu.Unlock()
		u, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); io.Copy(u, c) }()
		go func() {
			defer p.wg.Done()
			io.CopyN(c, u, p.budget)
			io.Copy(io.Discard, u) // keep the producer writing, drop its bytes
		}()
	}
}

func (p *stallProxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func TestSilentProducerTimesOut(t *testing.T) {
	data := randBytes(8<<20, 6)
	for _, tc := range []struct {
		name   string
		budget int64
	}{
		{"silent before hello", 0},
		{"silent mid-payload", 2 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			px := newStallProxy(t, tc.budget)
			pcfg := testConfig(t)
			pcfg.IOTimeout = 30 * time.Second // the producer is not the one waiting
			pcfg.DataAdvertise = px.addr()    // consumers are told to dial the proxy
			prod := startService(t, pcfg)
			px.setTarget(prod.ln.Addr().String())
			ref, err := prod.Publish(u8Meta(8<<20), data)
			if err != nil {
				t.Fatal(err)
			}
			ccfg := testConfig(t)
			ccfg.IOTimeout = 300 * time.Millisecond
			ccfg.Conns = 1
			cons := startService(t, ccfg)
			start := time.Now()
			_, err = cons.Pull(testCtx(t), ref)
			if err == nil {
				t.Fatal("pull through a silent proxy succeeded")
			}
			// The deadline (checked below) is what ends it; this bound only
			// says it did not wait for anything longer, with room for a
			// loaded machine (5x failed once under parallel test runs).
			if d := time.Since(start); d > 20*ccfg.IOTimeout {
				t.Fatalf("pull took %v to fail, IOTimeout %v", d, ccfg.IOTimeout)
			}
			if tc.budget == 0 && !errors.Is(err, ErrUnreachable) {
				t.Fatalf("silent before hello: %v, want ErrUnreachable", err)
			}
			if tc.budget > 0 && (!errors.Is(err, ErrUnreachable) || !errors.Is(err, os.ErrDeadlineExceeded)) {
				t.Fatalf("silent mid-payload: %v, want ErrUnreachable after the deadline", err)
			}
		})
	}
}

func TestCancelDuringPull(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	// A payload whose second chunk never arrives: the pull waits on it.
	meta := TensorMeta{DType: Uint8, Shape: []int64{2, 1 << 20}, NumChunks: 2}
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ChunkReady(0); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(testCtx(t))
	done := make(chan error, 1)
	go func() {
		_, err := cons.Pull(ctx, ref)
		done <- err
	}()
	time.Sleep(200 * time.Millisecond) // let the pull reach the wait
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled pull: %v", err)
		}
		if d := time.Since(start); d > time.Second {
			t.Fatalf("cancel took %v", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("cancelled pull did not return")
	}
}

func TestWaitingPullSurvivesSlowProducer(t *testing.T) {
	// The consumer waits longer than its IOTimeout for a chunk: heartbeats
	// keep the connection alive.
	cfg := testConfig(t)
	cfg.IOTimeout = 300 * time.Millisecond
	prod := startService(t, cfg)
	cons := startService(t, cfg)
	meta := TensorMeta{DType: Uint8, Shape: []int64{2, 4096}, NumChunks: 2}
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	src := randBytes(meta.Bytes(), 7)
	copy(p.Buf(), src)
	if err := p.ChunkReady(0); err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(time.Second, func() { p.ChunkReady(1) })
	got, err := cons.Pull(testCtx(t), ref)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, src) {
		t.Fatal("data differs")
	}
}

func TestPullChunksAsTheyLand(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	meta := TensorMeta{DType: Float16, Shape: []int64{6, 3, 1000}, NumChunks: 3}
	p, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	src := randBytes(meta.Bytes(), 8)
	for _, s := range []*Service{cons, prod} { // remote, then same peer
		dst := make([]byte, meta.Bytes())
		pull, err := s.PullChunks(testCtx(t), ref, dst)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]bool{}
		for k := range 3 {
			off, n := meta.ChunkRange(k)
			if s == cons {
				copy(p.Buf()[off:off+n], src[off:off+n])
				if err := p.ChunkReady(k); err != nil {
					t.Fatal(err)
				}
			}
			select {
			case c := <-pull.Chunks():
				// Only chunks up to k exist, so chunk k must be the one.
				if c.Index != k || !bytes.Equal(c.Data, src[off:off+n]) || &c.Data[0] != &dst[off] {
					t.Fatalf("chunk %d: got index %d or wrong view", k, c.Index)
				}
				seen[c.Index] = true
			case <-time.After(5 * time.Second):
				t.Fatalf("chunk %d did not arrive", k)
			}
		}
		if err := pull.Wait(); err != nil {
			t.Fatal(err)
		}
		if _, ok := <-pull.Chunks(); ok {
			t.Fatal("chunk channel not closed")
		}
		if !bytes.Equal(dst, src) {
			t.Fatal("data differs")
		}
	}
}

func TestCloseIdempotentAndEndsPulls(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	meta := TensorMeta{DType: Uint8, Shape: []int64{2, 100}, NumChunks: 2}
	_, ref, err := prod.Begin(meta)
	if err != nil {
		t.Fatal(err)
	}
	pull, err := cons.PullChunks(testCtx(t), ref, make([]byte, 200))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	cons.Close()
	if err := pull.Wait(); err == nil {
		t.Fatal("pull survived Close")
	}
	cons.Close()
	prod.Close()
	if _, err := prod.Publish(u8Meta(1), []byte{1}); !errors.Is(err, ErrClosed) {
		t.Fatalf("publish after close: %v", err)
	}
	if _, err := cons.Pull(testCtx(t), ref); !errors.Is(err, ErrClosed) {
		t.Fatalf("pull after close: %v", err)
	}
}

func TestUnreachableProducer(t *testing.T) {
	prod := startService(t, testConfig(t))
	cons := startService(t, testConfig(t))
	ref, err := prod.Publish(u8Meta(10), make([]byte, 10))
	if err != nil {
		t.Fatal(err)
	}
	prod.Close()
	prod.h.Close()
	ctx, cancel := context.WithTimeout(testCtx(t), 5*time.Second)
	defer cancel()
	if _, err := cons.Pull(ctx, ref); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("pull from closed producer: %v, want ErrUnreachable", err)
	}
}
