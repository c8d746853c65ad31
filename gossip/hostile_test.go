package gossip

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/testbed/attack"
)

// heapObjects reads the bytes of live and not yet swept heap objects
// without stopping the world.
func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// retainedHeap is the live heap after a full collection.
func retainedHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// peakHeap samples heapObjects every millisecond until stop is called and
// returns the highest reading.
func peakHeap() (stop func() uint64) {
	var peak atomic.Uint64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			if h := heapObjects(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	return func() uint64 {
		close(done)
		wg.Wait()
		return peak.Load()
	}
}

// waitClosed reports how long the peer took to close c, reading and
// discarding what it sends, or fails after limit.
func waitClosed(t *testing.T, c net.Conn, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	c.SetReadDeadline(start.Add(limit))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("connection still open after %v", limit)
	}
	return time.Since(start)
}

// TestHostileGossipInput sends a live node what an attacker on the gossip
// port could: frames that declare absurd lengths, a compression bomb,
// garbage, and connections that stall. The node must stay up, its memory
// must not follow the declared sizes, and a normal peer must still join.
// memberlist v0.5.4 panicked on the first frame (makeslice: len out of
// range), died of the second (fatal error: out of memory) and grew by about
// 1 GB on the third.
func TestHostileGossipInput(t *testing.T) {
	cli := startEtcd(t)
	prefix := testPrefix(t)
	core, logs := observer.New(zap.DebugLevel)
	a := startNode(t, cli, prefix, "a", []string{RoleEncode}, func(c *Config) {
		c.Logger = zap.New(core)
		c.LogLimitEvery = time.Minute // longer than the test: one interval
	})
	addr := a.Self().Record.GossipAddr
	// The label is no secret: it is the etcd prefix. Frames carry it so
	// they reach memberlist's decoders rather than its label check.
	label := prefix
	timeout := a.cfg.Memberlist.TCPTimeout
	rnd := rand.New(rand.NewPCG(1, 2))
	garbage := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rnd.Uint32())
		}
		return b
	}

	before := retainedHeap()
	stopPeak := peakHeap()
	start := time.Now()

	streams := []struct {
		name  string
		frame []byte
	}{
		{"push/pull declaring -1 nodes", attack.PushPullHeader(-1)},
		{"push/pull declaring 2^20 nodes", attack.PushPullHeader(1 << 20)},
		{"push/pull declaring 2^62 nodes", attack.PushPullHeader(1 << 62)},
		{"user message declaring 1 TiB", attack.UserMsgHeader(1 << 40)},
		{"user message declaring -1 bytes", attack.UserMsgHeader(-1)},
		{"lzw bomb", attack.Compressed(attack.LZWZeros(37))},
		{"lzw of nothing", attack.Compressed(nil)},
		{"compress declaring 4 GiB, 4 sent", append(attack.MP{attack.Compress}.Fixmap(2).Str("Algo").Int(0).Str("Buf"),
			0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4)},
		{"deep msgpack", attack.Deep(attack.PushPull, 1<<20)},
		{"random bytes", garbage(64 << 10)},
		{"truncated push/pull", attack.PushPullHeader(1)[:20]},
		{"unknown type", []byte{200, 1, 2, 3}},
		{"label declaring 255 bytes, 3 sent", []byte{attack.Label, 255, 'a', 'b', 'c'}},
	}
	for _, s := range streams {
		sendStream(t, addr, attack.Labeled(label, s.frame))
		t.Logf("sent %s (%d bytes)", s.name, len(s.frame))
	}

	// No bomb by packet: memberlist decompresses packets with the same
	// bounded decompressBuffer, and each bomb costs a second of CPU.
	packets := []struct {
		name  string
		frame []byte
	}{
		{"random bytes", garbage(1400)},
		{"deep msgpack", attack.Deep(attack.Alive, 60000)},
		{"truncated alive", attack.AliveMsg("x", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}, 1, nil)[:30]},
		{"compound with bogus lengths", []byte{attack.Compound, 255, 0xff, 0xff}},
		{"crc mismatch", []byte{attack.HasCRC, 1, 2, 3, 4, attack.Alive}},
		// memberlist v0.7.0 alone takes this into its node list with
		// protocol version 0, and every later joiner then fails its version
		// check against it; gossip's alive check keeps it out.
		{"alive with short Vsn", attack.MP{attack.Alive}.Fixmap(2).Str("Node").Str("x").Str("Vsn").Bin([]byte{1})},
		{"alive for an unregistered node", attack.AliveMsg("intruder", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 9}, 1, nil)},
		{"empty", nil},
	}
	for _, p := range packets {
		sendPacket(t, addr, attack.Labeled(label, p.frame))
		t.Logf("sent packet %s (%d bytes)", p.name, len(p.frame))
	}

	// An idle connection and one that trickles a valid header a byte at a
	// time: memberlist's deadline (TCPTimeout, from accept) ends both.
	idle, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	slow, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	var trickle sync.WaitGroup
	trickle.Go(func() {
		for _, b := range attack.Labeled(label, attack.PushPullHeader(1)) {
			if _, err := slow.Write([]byte{b}); err != nil {
				return
			}
			time.Sleep(timeout / 10)
		}
	})
	if d := waitClosed(t, idle, timeout+2*time.Second); d > timeout+time.Second {
		t.Errorf("idle connection closed after %v, TCPTimeout is %v", d, timeout)
	}
	if d := waitClosed(t, slow, timeout+2*time.Second); d > timeout+time.Second {
		t.Errorf("slow connection closed after %v, TCPTimeout is %v", d, timeout)
	}
	trickle.Wait()

	// The node is still a working member: a new peer joins and sees its
	// meta change, and it sees the peer.
	b := startNode(t, cli, prefix, "b", []string{RoleDecode}, nil)
	eventually(t, 10*time.Second, func() error {
		if err := checkView(a, "a", "b"); err != nil {
			return err
		}
		return checkView(b, "a", "b")
	})
	if err := a.UpdateMeta(NodeMeta{Roles: []string{RoleEncode}, Free: StageCredits{Encode: 7}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() error {
		if p, _ := b.Peer("a"); p.Meta.Free.Encode != 7 {
			return fmt.Errorf("b sees a's meta %+v", p.Meta)
		}
		return nil
	})
	for _, id := range []string{"x", "intruder"} {
		if p, ok := a.Peer(id); ok {
			t.Errorf("a took in %s: %+v", id, p)
		}
	}

	// memberlist gives up on a bomb only after decompressing 40 MiB of it,
	// a second of CPU (ten under -race) that nothing waits for; let it end
	// so its goroutine does not outlive the test.
	eventually(t, 60*time.Second, func() error {
		buf := make([]byte, 1<<20)
		if bytes.Contains(buf[:runtime.Stack(buf, true)], []byte("memberlist.decompress")) {
			return errors.New("memberlist still decompressing a bomb")
		}
		return nil
	})
	peak := stopPeak()
	t.Logf("heap: %d MB before, peak %d MB, in %v", before>>20, peak>>20, time.Since(start).Round(time.Millisecond))
	// What memberlist v0.7.0 still allocates for these frames, for as long
	// as each one is being read: the node slice a push/pull header declares
	// (at most 2^20 entries of 112 bytes) and up to 40 MiB of decompressed
	// bomb in a doubling buffer.
	// Following the declared sizes would take terabytes; v0.5.4 took about
	// 1 GB for the stream bomb alone.
	if peak > before+512<<20 {
		t.Errorf("heap peaked at %d MB from %d MB", peak>>20, before>>20)
	}
	// Once memberlist is done with them, nothing of them stays.
	eventually(t, 10*time.Second, func() error {
		if after := retainedHeap(); after > before+64<<20 {
			return fmt.Errorf("heap grew from %d MB to %d MB", before>>20, after>>20)
		}
		return nil
	})

	// Every frame above made memberlist log a line; at most LogLimit got
	// through, and Close reports how many were held back.
	lines := logs.FilterLoggerName("gossip.memberlist")
	if n := lines.Len(); n > a.cfg.LogLimit+1 {
		t.Errorf("%d memberlist log lines, limit %d per %v", n, a.cfg.LogLimit, a.cfg.LogLimitEvery)
	}
	a.Close()
	held := logs.FilterLoggerName("gossip.memberlist").FilterMessage("memberlist log lines suppressed").All()
	if len(held) == 0 || held[len(held)-1].ContextMap()["lines"].(int64) == 0 {
		t.Errorf("no count of suppressed lines: %v", held)
	} else {
		t.Logf("%d memberlist lines written, %d held back", lines.Len()-len(held), held[len(held)-1].ContextMap()["lines"])
	}
}
