package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"

	"github.com/latentmesh/latentmesh/transfer"
)

// rawRequestLen is the size of a raw-TCP baseline request: key, offset and
// length, big endian.
const rawRequestLen = 24

// rawServer is the raw-TCP baseline: plain Go sockets serving byte ranges of
// registered buffers with a 24-byte request and no tickets, deadlines or
// checksums, the floor the transfer data plane is compared with. It listens
// twice: with the system's socket defaults (the baseline), and with the
// data plane's congestion control (the tuned baseline, which isolates what
// the connector itself costs).
type rawServer struct {
	ln, tuned net.Listener // tuned is nil without a congestion control
	wg        sync.WaitGroup

	mu sync.Mutex
	// mu guards the fields below.
	bufs   map[uint64][]byte
	next   uint64
	conns  map[net.Conn]struct{}
	closed bool
}

// newRawServer listens on addr, and with congestion set on a second port
// of the same host whose connections run it.
func newRawServer(addr, congestion string) (_ *rawServer, err error) {
	r := &rawServer{bufs: make(map[uint64][]byte), conns: make(map[net.Conn]struct{})}
	if r.ln, err = net.Listen("tcp", addr); err != nil {
		return nil, fmt.Errorf("bench: raw tcp listen %s: %w", addr, err)
	}
	if congestion != "" {
		host, _, _ := net.SplitHostPort(r.ln.Addr().String())
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			return transfer.SetCongestion(c, congestion)
		}}
		if r.tuned, err = lc.Listen(context.Background(), "tcp", net.JoinHostPort(host, "0")); err != nil {
			r.ln.Close()
			return nil, fmt.Errorf("bench: tuned raw tcp listen: %w", err)
		}
		r.wg.Go(func() { r.acceptLoop(r.tuned) })
	}
	r.wg.Go(func() { r.acceptLoop(r.ln) })
	return r, nil
}

func (r *rawServer) addr() string { return r.ln.Addr().String() }

// tunedAddr is the tuned baseline's address, empty without one.
func (r *rawServer) tunedAddr() string {
	if r.tuned == nil {
		return ""
	}
	return r.tuned.Addr().String()
}

// add registers b and returns the key requests name it by.
func (r *rawServer) add(b []byte) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.next++
	r.bufs[r.next] = b
	return r.next
}

func (r *rawServer) remove(key uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.bufs, key)
}

func (r *rawServer) get(key uint64) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bufs[key]
}

func (r *rawServer) acceptLoop(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			c.Close()
			return
		}
		r.conns[c] = struct{}{}
		r.mu.Unlock()
		r.wg.Go(func() { r.serve(c) })
	}
}

// serve answers requests on c until it closes or asks for a bad range.
func (r *rawServer) serve(c net.Conn) {
	defer func() {
		r.mu.Lock()
		delete(r.conns, c)
		r.mu.Unlock()
		c.Close()
	}()
	var q [rawRequestLen]byte
	for {
		if _, err := io.ReadFull(c, q[:]); err != nil {
			return
		}
		key := binary.BigEndian.Uint64(q[:8])
		off, n := binary.BigEndian.Uint64(q[8:16]), binary.BigEndian.Uint64(q[16:])
		b := r.get(key)
		if b == nil || off > uint64(len(b)) || n > uint64(len(b))-off {
			return
		}
		if _, err := c.Write(b[off : off+n]); err != nil {
			return
		}
	}
}

// close stops the listener, closes every connection and waits for the
// server's goroutines.
func (r *rawServer) close() {
	r.mu.Lock()
	r.closed = true
	conns := r.conns
	r.conns = nil
	r.mu.Unlock()
	r.ln.Close()
	if r.tuned != nil {
		r.tuned.Close()
	}
	for c := range conns {
		c.Close()
	}
	r.wg.Wait()
}

// rawClient holds persistent connections to a rawServer, one per stripe.
type rawClient struct {
	conns []net.Conn
}

func dialRaw(ctx context.Context, addr string, n int) (_ *rawClient, err error) {
	c := &rawClient{}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	var d net.Dialer
	for range n {
		nc, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("bench: raw tcp dial %s: %w", addr, err)
		}
		c.conns = append(c.conns, nc)
	}
	return c, nil
}

// pull reads buffer key into dst in stripes equal ranges, one per connection,
// in parallel.
func (c *rawClient) pull(key uint64, dst []byte, stripes int) error {
	if stripes < 1 || stripes > len(c.conns) {
		return fmt.Errorf("bench: raw tcp: %d stripes over %d connections", stripes, len(c.conns))
	}
	size := int64(len(dst))
	per := size / int64(stripes)
	errs := make([]error, stripes)
	var wg sync.WaitGroup
	for i := range stripes {
		off, n := int64(i)*per, per
		if i == stripes-1 {
			n = size - off
		}
		wg.Go(func() {
			var q [rawRequestLen]byte
			binary.BigEndian.PutUint64(q[:8], key)
			binary.BigEndian.PutUint64(q[8:16], uint64(off))
			binary.BigEndian.PutUint64(q[16:], uint64(n))
			if _, err := c.conns[i].Write(q[:]); err != nil {
				errs[i] = fmt.Errorf("bench: raw tcp request: %w", err)
				return
			}
			if _, err := io.ReadFull(c.conns[i], dst[off:off+n]); err != nil {
				errs[i] = fmt.Errorf("bench: raw tcp read %d bytes at %d: %w", n, off, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (c *rawClient) close() {
	for _, nc := range c.conns {
		nc.Close()
	}
}
