package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// MeasureConfig sizes MeasureEtcd.
type MeasureConfig struct {
	Clients     int           // client connections, as agents would have
	Concurrency int           // requests in flight for the capacity runs
	For         time.Duration // each capacity run
	Watchers    int           // watches on one prefix, for fan-out
	Leases      int           // leases renewed in the keepalive run, as agents would hold
}

// DefaultMeasureConfig takes about ten seconds.
func DefaultMeasureConfig() MeasureConfig {
	return MeasureConfig{Clients: 8, Concurrency: 64, For: 2 * time.Second, Watchers: 2000, Leases: 1000}
}

// MeasureEtcd starts an embedded etcd (agent/etcdembed, as `latentmesh-dev dev`
// runs) and measures on this machine what the simulation's etcd model needs:
// the latency of a claim-shaped write txn (compare, two puts) and of a
// linearizable read of one job-record-sized key (every read a job costs
// either design: a client's long poll, a commit's or a holder's read of a
// record; nothing lists a queue any more) on an idle etcd, how many of each it serves with
// Concurrency in flight, how fast it creates watches, and how many watch
// events a second it delivers to Watchers watches of one prefix, and how many
// lease renewals a second it answers for Leases leases. Client and
// server share this machine's cores, so capacities are what one machine
// does, not a tuned etcd cluster's. Its log is fsynced, as a real
// cluster's is (the dev default skips fsync in a temporary directory).
func MeasureEtcd(ctx context.Context, mc MeasureConfig) (EtcdCosts, error) {
	ec := etcdembed.DefaultConfig()
	ec.Fsync = true
	srv, err := etcdembed.Start(ctx, ec)
	if err != nil {
		return EtcdCosts{}, err
	}
	defer srv.Close()
	clis := make([]*clientv3.Client, mc.Clients)
	for i := range clis {
		c, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			return EtcdCosts{}, fmt.Errorf("sim: etcd client: %w", err)
		}
		defer c.Close()
		clis[i] = c
	}
	const pre = "/latentmesh/sim/"
	// Records to read, one at a time, each about the size of a job record.
	const records = 64
	val := string(make([]byte, 600))
	job := string(make([]byte, 1500))
	for i := range records {
		if _, err := clis[0].Put(ctx, fmt.Sprintf("%sjobs/%016x", pre, i), job); err != nil {
			return EtcdCosts{}, err
		}
	}
	var seq atomic.Int64
	write := func(ctx context.Context, c *clientv3.Client) error {
		n := seq.Add(1)
		ck := fmt.Sprintf("%sclaims/%d", pre, n)
		_, err := c.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(ck), "=", 0)).
			Then(clientv3.OpPut(ck, "{\"node\":\"x\"}"), clientv3.OpPut(fmt.Sprintf("%stask/%d", pre, n), val)).Commit()
		return err
	}
	read := func(ctx context.Context, c *clientv3.Client) error {
		_, err := c.Get(ctx, fmt.Sprintf("%sjobs/%016x", pre, seq.Add(1)%records))
		return err
	}
	var out EtcdCosts
	if out.WriteLatency, err = median(ctx, clis[0], 200, write); err != nil {
		return EtcdCosts{}, err
	}
	if out.ReadLatency, err = median(ctx, clis[0], 200, read); err != nil {
		return EtcdCosts{}, err
	}
	if out.WriteCap, err = rate(ctx, clis, mc, write); err != nil {
		return EtcdCosts{}, err
	}
	if out.ReadCap, err = rate(ctx, clis, mc, read); err != nil {
		return EtcdCosts{}, err
	}
	if out.WatchDelay, out.WatchCreateCap, out.EventCap, err = measureWatches(ctx, clis, mc.Watchers, pre+"w/"); err != nil {
		return EtcdCosts{}, err
	}
	if out.KeepAliveCap, err = measureKeepAlives(ctx, clis, mc); err != nil {
		return EtcdCosts{}, err
	}
	out.Source = fmt.Sprintf("measured here: embedded etcd, %d clients, %d in flight, %d watchers, %d leases", mc.Clients, mc.Concurrency, mc.Watchers, mc.Leases)
	return out, nil
}

func median(ctx context.Context, c *clientv3.Client, n int, op func(context.Context, *clientv3.Client) error) (time.Duration, error) {
	ds := make([]time.Duration, n)
	for i := range ds {
		t := time.Now()
		if err := op(ctx, c); err != nil {
			return 0, fmt.Errorf("sim: measure: %w", err)
		}
		ds[i] = time.Since(t)
	}
	slices.Sort(ds)
	return ds[n/2], nil
}

func rate(ctx context.Context, clis []*clientv3.Client, mc MeasureConfig, op func(context.Context, *clientv3.Client) error) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, mc.For+10*time.Second)
	defer cancel()
	var done atomic.Int64
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(mc.For)
	for g := range mc.Concurrency {
		c := clis[g%len(clis)]
		wg.Go(func() {
			for time.Now().Before(stop) {
				if err := op(ctx, c); err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return 0, fmt.Errorf("sim: measure: %w", firstErr)
	}
	return float64(done.Load()) / time.Since(start).Seconds(), nil
}

// measureWatches opens n watches on one prefix (spread over the clients),
// timing their creation, then puts keys and times until every watch has
// every event.
func measureWatches(ctx context.Context, clis []*clientv3.Client, n int, prefix string) (delay time.Duration, createRate, eventRate float64, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// One watch alone: put to receipt.
	one := clis[0].Watch(clientv3.WithRequireLeader(ctx), prefix+"one", clientv3.WithCreatedNotify())
	<-one
	ds := make([]time.Duration, 0, 50)
	for range 50 {
		t := time.Now()
		if _, err := clis[1%len(clis)].Put(ctx, prefix+"one", "x"); err != nil {
			return 0, 0, 0, err
		}
		if _, ok := <-one; !ok {
			return 0, 0, 0, fmt.Errorf("sim: measure: watch closed")
		}
		ds = append(ds, time.Since(t))
	}
	slices.Sort(ds)
	delay = ds[len(ds)/2]

	const events = 20
	var got sync.WaitGroup
	got.Add(n)
	created := make(chan struct{}, n)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		c := clis[i%len(clis)]
		// A context per watch, so each is its own watch, not a shared one.
		wctx := clientv3.WithRequireLeader(context.WithValue(ctx, watchKey{}, i))
		ch := c.Watch(wctx, prefix+"fan/", clientv3.WithPrefix(), clientv3.WithCreatedNotify())
		wg.Go(func() {
			seen := 0
			for wr := range ch {
				if wr.Created {
					created <- struct{}{}
					continue
				}
				seen += len(wr.Events)
				if seen >= events {
					got.Done()
					return
				}
			}
		})
	}
	for range n {
		select {
		case <-created:
		case <-ctx.Done():
			return 0, 0, 0, ctx.Err()
		}
	}
	createRate = float64(n) / time.Since(start).Seconds()
	start = time.Now()
	for i := range events {
		if _, err := clis[0].Put(ctx, fmt.Sprintf("%sfan/%d", prefix, i), "x"); err != nil {
			return 0, 0, 0, err
		}
	}
	got.Wait()
	eventRate = float64(n*events) / time.Since(start).Seconds()
	cancel()
	wg.Wait()
	return delay, createRate, eventRate, nil
}

type watchKey struct{}

// measureKeepAlives grants mc.Leases leases and renews them round-robin
// from mc.Concurrency LeaseKeepAlive streams spread over the clients, each
// sending a renewal and waiting for its answer, for mc.For: renewals a
// second at saturation. The agent renews its lease on such a stream
// (gossip.Membership, through clientv3's KeepAlive), one request per
// renewal; a stream is opened once, so its opening is not counted.
func measureKeepAlives(ctx context.Context, clis []*clientv3.Client, mc MeasureConfig) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, mc.For+30*time.Second)
	defer cancel()
	leases := make([]int64, mc.Leases)
	for i := range leases {
		g, err := clis[i%len(clis)].Grant(ctx, 600)
		if err != nil {
			return 0, fmt.Errorf("sim: measure: grant: %w", err)
		}
		leases[i] = int64(g.ID)
	}
	streams := make([]pb.Lease_LeaseKeepAliveClient, mc.Concurrency)
	for g := range streams {
		st, err := pb.NewLeaseClient(clis[g%len(clis)].ActiveConnection()).LeaseKeepAlive(ctx)
		if err != nil {
			return 0, fmt.Errorf("sim: measure: keepalive stream: %w", err)
		}
		streams[g] = st
	}
	var done atomic.Int64
	errs := make([]error, len(streams))
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(mc.For)
	for g, st := range streams {
		wg.Go(func() {
			for k := g; time.Now().Before(stop); k += len(streams) {
				if err := st.Send(&pb.LeaseKeepAliveRequest{ID: leases[k%len(leases)]}); err != nil {
					errs[g] = err
					return
				}
				r, err := st.Recv()
				if err == nil && r.TTL <= 0 {
					err = fmt.Errorf("lease %x not found", r.ID)
				}
				if err != nil {
					errs[g] = err
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	for _, st := range streams {
		_ = st.CloseSend()
	}
	if err := errors.Join(errs...); err != nil {
		return 0, fmt.Errorf("sim: measure: keepalive: %w", err)
	}
	return float64(done.Load()) / elapsed.Seconds(), nil
}
