package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent/bytesize"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/cache"
	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// The acceptance targets, against a p2p pull of the same size over
// the same pair of services and transport. They are reported, never enforced.
const (
	// GetTarget is the least store get (Fetch) / p2p pull ratio that meets
	// the target.
	GetTarget = 0.9
	// PutTarget is the least put / p2p pull throughput ratio that meets
	// the target: a put (FirstCopy, R copies chained) until it returns,
	// against one pull of the source by its first holder.
	PutTarget = 0.9
	// ReplicateTarget is the most that the time to R complete copies may
	// take against R pulls one after another along the same chain of
	// services (issue 19: within 1.1x).
	ReplicateTarget = 1.1
)

// StoreConfig configures RunStore.
type StoreConfig struct {
	// Sizes are the object sizes measured, in bytes.
	Sizes []int64
	// Transports are the transports measured (tcp, shm); every node's
	// service is forced to the one under test.
	Transports []string
	// Reps is the number of measured repetitions per size, after one warm-up.
	Reps int
	// Replicas is R of every put: copies made on as many holders.
	Replicas int
	// Chunks is how many chunks each object is published in. A step
	// checkpoint (StageBytes) is one; with more, and a mode that is not
	// durable, each holder of the chain pulls the copy before it chunk by
	// chunk as it lands.
	Chunks int
	// Nodes is the size of the mesh. Node 0 puts and reads and lends the
	// Store nothing, so every copy of a put crosses the data plane and every
	// get pulls from a holder; the others hold the copies. Replicas must be
	// below Nodes.
	Nodes int
	// Transfer is every node's transfer configuration; each transport's run
	// forces its Transport and gives each node an arena sized for what it
	// holds at once.
	Transfer transfer.Config
	// Store is every node's Store configuration; Prefix, Node and
	// MemoryCapacity are set per node.
	Store cache.Config
	// Etcd configures the embedded etcd holding the records.
	Etcd etcdembed.Config
	// Progress, if not nil, receives a line per step of a long run.
	Progress io.Writer
	// Logger receives the nodes' logs.
	Logger *zap.Logger
}

// DefaultStoreConfig measures the sizes and replica count of the issue's
// acceptance criteria.
func DefaultStoreConfig() StoreConfig {
	st := cache.DefaultConfig()
	// Short periods: a bench mesh lives for seconds, and every copy is
	// freed through the watch between repetitions anyway.
	st.StageTimeout = 30 * time.Second
	st.MaintainEvery = 2 * time.Second
	return StoreConfig{
		Sizes:      []int64{64 << 20, 256 << 20},         // typical and large latent
		Transports: []string{TransportTCP, TransportShm}, // every transport one host can run
		Reps:       5,                                    // an odd count gives a true median
		Replicas:   2,                                    // the Store's default R
		Chunks:     1,                                    // what StageBytes publishes: a checkpoint, a result
		Nodes:      4,                                    // a putter/reader and three candidate holders
		Transfer:   transfer.DefaultConfig(),
		Store:      st,
		Etcd:       etcdembed.DefaultConfig(),
		Logger:     zap.NewNop(),
	}
}

func (c StoreConfig) validate() error {
	switch {
	case len(c.Sizes) == 0:
		return errors.New("bench: no sizes")
	case len(c.Transports) == 0:
		return errors.New("bench: no transports")
	case c.Reps < 1:
		return fmt.Errorf("bench: reps %d < 1", c.Reps)
	case c.Nodes < 2 || c.Nodes > 16:
		return fmt.Errorf("bench: nodes %d not in [2,16]", c.Nodes)
	case c.Replicas < 1 || c.Replicas >= c.Nodes || c.Replicas > 8:
		return fmt.Errorf("bench: replicas %d not in [1,%d] (one node puts and reads, the others hold)", c.Replicas, min(c.Nodes-1, 8))
	case c.Chunks < 1 || c.Chunks > transfer.MaxChunks:
		return fmt.Errorf("bench: chunks %d not in [1,%d]", c.Chunks, transfer.MaxChunks)
	case c.Logger == nil:
		return errors.New("bench: nil logger")
	}
	for _, s := range c.Sizes {
		if s <= 0 || s > c.Transfer.MaxPayloadBytes {
			return fmt.Errorf("bench: size %d not in [1,%d]", s, c.Transfer.MaxPayloadBytes)
		}
		if s%int64(c.Chunks) != 0 {
			return fmt.Errorf("bench: size %d not divisible into %d chunks", s, c.Chunks)
		}
	}
	return checkTransports(c.Transports)
}

// StoreResult is one row: one transport at one size.
type StoreResult struct {
	Transport string `json:"transport"`
	SizeBytes int64  `json:"size_bytes"`
	Replicas  int    `json:"replicas"`
	Chunks    int    `json:"chunks"`
	// GB/s (1e9 bytes per second) of puts: Stage (PutSpec.FirstCopy) of
	// an object published on node 0, Commit of its record while the first
	// holder's copy lands, and FirstCopied, returning once that copy is
	// complete; the others fill along the chain after it.
	PutGbpsMedian float64 `json:"put_gbps_median"`
	PutGbpsMin    float64 `json:"put_gbps_min"`
	PutGbpsMax    float64 `json:"put_gbps_max"`
	// ReplicatedMSMedian is the time from the put's start until all R
	// copies are complete (Staged.Replicated) and its record committed;
	// SeqPullsMSMedian is its baseline: R pulls one after another along
	// the put's chain (the first holder pulls node 0's source, each next
	// holder a payload of the one before), interleaved.
	ReplicatedMSMedian float64 `json:"replicated_ms_median"`
	SeqPullsMSMedian   float64 `json:"seq_pulls_ms_median"`
	// GB/s of gets: Fetch of the record's bytes into a buffer of node 0,
	// from the object's nearest holder.
	GetGbpsMedian float64 `json:"get_gbps_median"`
	GetGbpsMin    float64 `json:"get_gbps_min"`
	GetGbpsMax    float64 `json:"get_gbps_max"`
	// LookupMSMedian is the time Lookup takes to read the record from etcd
	// before a get; RatioGetWithLookup counts it in the get's time (what a
	// reader that starts from an object id pays).
	LookupMSMedian     float64 `json:"lookup_ms_median"`
	RatioGetWithLookup float64 `json:"ratio_get_with_lookup"`
	// P2PGbpsMedian is the get's baseline: node 0 pulling (PullInto) a
	// payload published on the holder the get read from, interleaved.
	P2PGbpsMedian float64 `json:"p2p_gbps_median"`
	// P2PPutGbpsMedian is the put's baseline: its first holder pulling
	// the put's source from node 0 (the first of the sequential pulls).
	P2PPutGbpsMedian float64 `json:"p2p_put_gbps_median"`
	// PutCPUMSMedian and P2PPutCPUMSMedian are the CPU time this process
	// (every node, and etcd) used during a put and during its baseline
	// pull. Near the wall time, or above it, the machine's cores are the
	// bound: what the put does besides the copy costs it its CPU time
	// whether or not it overlaps the copy.
	PutCPUMSMedian    float64 `json:"put_cpu_ms_median"`
	P2PPutCPUMSMedian float64 `json:"p2p_put_cpu_ms_median"`
	// RatioGet is get over p2p GB/s; RatioPut is put over p2p-put GB/s,
	// that is one pull's time over a put's; RatioReplicated is the time to
	// R copies over R sequential pulls' (lower is better).
	RatioGet             float64 `json:"ratio_get"`
	RatioPut             float64 `json:"ratio_put"`
	RatioReplicated      float64 `json:"ratio_replicated"`
	GetTarget            float64 `json:"get_target"`
	PutTarget            float64 `json:"put_target"`
	ReplicateTarget      float64 `json:"replicate_target"`
	GetMeetsTarget       bool    `json:"get_meets_target"`
	PutMeetsTarget       bool    `json:"put_meets_target"`
	ReplicateMeetsTarget bool    `json:"replicate_meets_target"`
}

// StoreReport is RunStore's result, as `bench store --json` prints it.
type StoreReport struct {
	// Nodes is the mesh size; InProcess is true: every node runs in this
	// process (see RunStore).
	Nodes     int           `json:"nodes"`
	InProcess bool          `json:"in_process"`
	Results   []StoreResult `json:"results"`
}

// RunStore measures the pooled Store against the data plane it runs on:
// puts and gets of objects of every size, each repetition interleaved with
// p2p pulls of the same size over the same pair of transfer services and the
// same transport, so a noisy machine moves both alike. A put is chained
// with PutSpec.FirstCopy (the put returns at its first complete copy): it
// is measured until it returns against one pull, and until its R copies
// are complete against R pulls one after another along its chain.
//
// The mesh is an embedded etcd and Nodes Store nodes, each with its own
// libp2p host, transfer service and arena, all in this process: a put and
// its copies, and a get and its baseline, share the same CPUs whatever the
// process layout, and one process keeps the harness free of a Store
// protocol of its own. (bench transfer puts its producer in another process
// to account the two ends' CPU apart; here the baseline pays the same
// in-process costs as the measured operation.) Node 0 puts objects as a
// step checkpoint is put (FirstCopy, mode TTL), which rendezvous hashing
// places on Replicas of the other nodes (an object of one chunk, as a
// checkpoint is, is pulled by each holder of the chain once the copy
// before is complete; one of several chunks chunk by chunk as it lands),
// and reads them back from the nearest holder; objects are deleted
// between repetitions and the run waits for the holders to free them.
func RunStore(ctx context.Context, cfg StoreConfig) (*StoreReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cfg.Etcd.Logger = cfg.Logger
	srv, err := etcdembed.Start(ctx, cfg.Etcd)
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	defer srv.Close()
	rep := &StoreReport{Nodes: cfg.Nodes, InProcess: true}
	for _, t := range cfg.Transports {
		rows, err := runStoreTransport(ctx, cfg, srv.Endpoints(), t)
		if err != nil {
			return nil, err
		}
		rep.Results = append(rep.Results, rows...)
	}
	return rep, nil
}

// runStoreTransport measures one transport at every size, on a mesh of its
// own whose services are forced to that transport.
func runStoreTransport(ctx context.Context, cfg StoreConfig, endpoints []string, transport string) ([]StoreResult, error) {
	r := &storeRun{cfg: cfg, transport: transport}
	r.progress("%s: starting %d nodes", transport, cfg.Nodes)
	m, err := startMesh(cfg, endpoints, transport)
	if err != nil {
		return nil, fmt.Errorf("bench: store mesh (%s): %w", transport, err)
	}
	defer m.close()
	r.m = m
	var rows []StoreResult
	for _, size := range cfg.Sizes {
		res, err := r.measure(ctx, size)
		if err != nil {
			return nil, fmt.Errorf("bench: store %s %s: %w", transport, bytesize.Format(size), err)
		}
		rows = append(rows, res)
	}
	return rows, nil
}

// storeNode is one member of the bench mesh.
type storeNode struct {
	name string
	h    host.Host
	x    *transfer.Service
	cli  *clientv3.Client
	s    *cache.Store
}

// close stops the node, Store before service, as an agent does. Nil
// fields (a node that failed halfway) are skipped.
func (n *storeNode) close() {
	if n.s != nil {
		n.s.Close()
	}
	if n.x != nil {
		n.x.Close()
	}
	if n.h != nil {
		n.h.Close()
	}
	if n.cli != nil {
		n.cli.Close()
	}
}

// storeMesh is the bench's mesh: nodes[0] puts and reads, the rest hold.
// nodes is fixed once startMesh returns.
type storeMesh struct {
	nodes []*storeNode
}

// startMesh builds every node, then starts their Stores. Holders lend the
// Store room for one copy of the largest size (each holds at most one copy
// of an object, and objects are freed between repetitions); every arena
// also holds what the baselines need: node 0 the put's source and the
// gets' destination, a holder a payload for node 0 to pull and a
// destination for its own pull of the source.
func startMesh(cfg StoreConfig, endpoints []string, transport string) (_ *storeMesh, err error) {
	m := &storeMesh{}
	defer func() {
		if err != nil {
			m.close()
		}
	}()
	largest := slices.Max(cfg.Sizes)
	const slack = 16 << 20 // alignment and a region whose free is still pending
	for i := range cfg.Nodes {
		n := &storeNode{name: fmt.Sprintf("n%d", i)}
		m.nodes = append(m.nodes, n)
		log := cfg.Logger.Named(n.name)
		tcfg := cfg.Transfer
		tcfg.Transport = transport
		tcfg.Logger = log
		tcfg.Arena = arena.DefaultConfig()
		tcfg.Arena.Name = "latentmesh-bench-store-" + n.name
		tcfg.Arena.HugePages = false
		var lend int64
		if i == 0 {
			tcfg.Arena.Size = 2*largest + slack
		} else {
			lend = largest
			tcfg.Arena.Size = 2*largest + lend + slack
		}
		if n.h, err = newHost(loopback); err != nil {
			return nil, err
		}
		if n.x, err = transfer.New(tcfg, n.h); err != nil {
			return nil, err
		}
		if n.cli, err = clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 10 * time.Second, Logger: log.Named("etcdclient")}); err != nil {
			return nil, fmt.Errorf("etcd client: %w", err)
		}
		scfg := cfg.Store
		scfg.Prefix = "/latentmesh-bench/store-" + transport
		scfg.Node = n.name
		scfg.MemoryCapacity = lend
		scfg.Logger = log
		if n.s, err = cache.New(scfg, n.cli, n.x, n.h, m.members, nil); err != nil {
			return nil, err
		}
	}
	for _, n := range m.nodes {
		n.s.Start()
	}
	return m, nil
}

// members is the member list every node's Store sees: all nodes, with the
// room their Stores have left.
func (m *storeMesh) members() []cache.Member {
	out := make([]cache.Member, 0, len(m.nodes))
	for _, n := range m.nodes {
		mem, disk := n.s.Free()
		mb := cache.Member{Node: n.name, PeerID: n.h.ID().String(), Host: n.x.HostID(), Free: mem + disk}
		for _, a := range n.h.Addrs() {
			mb.P2PAddrs = append(mb.P2PAddrs, a.String())
		}
		out = append(out, mb)
	}
	return out
}

func (m *storeMesh) node(name string) *storeNode {
	for _, n := range m.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

func (m *storeMesh) close() {
	for _, n := range m.nodes {
		n.close()
	}
}

// storeRun measures one transport on one mesh.
type storeRun struct {
	cfg       StoreConfig
	transport string
	m         *storeMesh
}

func (r *storeRun) progress(format string, a ...any) {
	if r.cfg.Progress != nil {
		fmt.Fprintf(r.cfg.Progress, "bench store: "+format+"\n", a...)
	}
}

// sizeSetup is what the baselines of one size use: the put's source on
// node 0, node 0's destination, and per holder a payload node 0 pulls and
// a destination the holder pulls the source into.
type sizeSetup struct {
	src     transfer.Ref
	srcData []byte
	dst     []byte
	held    map[string]transfer.Ref // holder -> payload published on it
	into    map[string][]byte       // holder -> its destination
	allocs  map[string]int          // node -> arena allocations with no copy held
	undo    []func()
}

func (s *sizeSetup) release() {
	for i := len(s.undo) - 1; i >= 0; i-- {
		s.undo[i]()
	}
}

// objectMeta is an object of size bytes in chunks chunks, as the bench
// publishes its sources and baselines.
func objectMeta(size int64, chunks int) transfer.TensorMeta {
	if chunks <= 1 {
		return transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{size}}
	}
	return transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(chunks), size / int64(chunks)}, NumChunks: chunks}
}

// publish allocates meta's bytes in x's arena, fills them and publishes them.
func publish(x *transfer.Service, meta transfer.TensorMeta, seed uint64) (transfer.Ref, []byte, error) {
	size := meta.Bytes()
	buf, err := x.Alloc(size)
	if err != nil {
		return transfer.Ref{}, nil, err
	}
	defer buf.Release() // the payload keeps the region until its Release
	data := buf.Bytes()
	fill(data, seed)
	ref, err := x.Publish(meta, data)
	return ref, data, err
}

func (r *storeRun) setup(size int64) (_ *sizeSetup, err error) {
	s := &sizeSetup{held: map[string]transfer.Ref{}, into: map[string][]byte{}, allocs: map[string]int{}}
	defer func() {
		if err != nil {
			s.release()
		}
	}()
	alloc := func(x *transfer.Service) ([]byte, error) {
		b, err := x.Alloc(size)
		if err != nil {
			return nil, err
		}
		s.undo = append(s.undo, b.Release)
		touch(b.Bytes())
		return b.Bytes(), nil
	}
	p := r.m.nodes[0]
	meta := objectMeta(size, r.cfg.Chunks)
	if s.src, s.srcData, err = publish(p.x, meta, uint64(size)); err != nil {
		return nil, err
	}
	s.undo = append(s.undo, func() { p.x.Release(s.src.ID) })
	if s.dst, err = alloc(p.x); err != nil {
		return nil, err
	}
	for i, n := range r.m.nodes[1:] {
		ref, _, err := publish(n.x, meta, uint64(size)+uint64(i)+1)
		if err != nil {
			return nil, err
		}
		s.held[n.name] = ref
		s.undo = append(s.undo, func() { n.x.Release(ref.ID) })
		if s.into[n.name], err = alloc(n.x); err != nil {
			return nil, err
		}
	}
	for _, n := range r.m.nodes {
		s.allocs[n.name] = n.x.Stats().Arena.Allocs
	}
	return s, nil
}

// waitFreed waits, with a bounded backoff, until every holder has freed
// the copies of deleted objects: its Store books and its arena are back to
// where the size's setup left them.
func (r *storeRun) waitFreed(ctx context.Context, s *sizeSetup) error {
	const limit = 10 * time.Second
	deadline := time.Now().Add(limit)
	wait := time.Millisecond
	for {
		var busy []string
		for _, n := range r.m.nodes {
			st, xs := n.s.LocalStats(), n.x.Stats()
			if st.MemoryUsed != 0 || xs.Arena.Allocs != s.allocs[n.name] {
				busy = append(busy, fmt.Sprintf("%s: %d bytes, %d copies, %d arena allocations (want %d)",
					n.name, st.MemoryUsed, st.Copies, xs.Arena.Allocs, s.allocs[n.name]))
			}
		}
		if len(busy) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("copies not freed %v after delete: %s", limit, strings.Join(busy, "; "))
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// benchTTL is the retention of the bench's objects, deleted long before:
// an etcd lease per retention bucket, granted at the first put of the
// bucket, as for checkpoints.
const benchTTL = time.Hour

// storeSample is one repetition's timings.
type storeSample struct {
	put, replicated, get, lookup, p2p, p2pPut, seqPulls time.Duration
	putCPU, p2pPutCPU                                   time.Duration // this process's CPU time meanwhile
}

// processCPU is the CPU time this process has used, user and system, all
// threads: every node, etcd included.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cycle runs one repetition: put until it returns and until its R copies
// are complete, the put's baseline (R pulls one after another along the
// put's chain), lookup and get, the get's baseline, then delete and wait
// for the copies to go.
func (r *storeRun) cycle(ctx context.Context, s *sizeSetup, id string, verify bool) (storeSample, error) {
	var out storeSample
	p := r.m.nodes[0]
	// As a step checkpoint is put (agent/checkpoint.go): the only caller of
	// FirstCopy.
	spec := cache.PutSpec{ID: id, Mode: cache.TTL, TTL: benchTTL, Replicas: r.cfg.Replicas, FirstCopy: true}
	c0, t0 := processCPU(), time.Now()
	st, err := p.s.Stage(ctx, spec, s.src)
	if err == nil {
		if err = st.Commit(ctx); err != nil {
			st.Abort(ctx)
		} else {
			err = st.FirstCopied(ctx)
		}
	}
	out.put, out.putCPU = time.Since(t0), processCPU()-c0
	if err != nil {
		return out, err
	}
	repl, err := st.WaitReplicated(ctx)
	out.replicated = time.Since(t0)
	if err != nil {
		return out, fmt.Errorf("put %s: copies: %w", id, err)
	}
	rec := st.Record
	if len(rec.Holders) != r.cfg.Replicas || repl.Complete != r.cfg.Replicas {
		return out, fmt.Errorf("put %s made %d copies (%d complete), want %d", id, len(rec.Holders), repl.Complete, r.cfg.Replicas)
	}
	if _, ok := rec.Holds(p.name); ok {
		return out, fmt.Errorf("put %s kept a copy on the putter %s", id, p.name)
	}
	holder := r.m.node(p.s.Nearest(rec)[0].Node)
	if holder == nil {
		return out, fmt.Errorf("put %s: nearest holder %q is not a node of the mesh", id, p.s.Nearest(rec)[0].Node)
	}

	// R pulls one after another along the put's chain.
	prev := s.src
	c0, t0 = processCPU(), time.Now()
	for i, h := range rec.Holders {
		n := r.m.node(h.Node)
		if n == nil {
			return out, fmt.Errorf("put %s: holder %q is not a node of the mesh", id, h.Node)
		}
		if err := n.x.PullInto(ctx, prev, s.into[n.name]); err != nil {
			return out, fmt.Errorf("p2p pull %s <- %s: %w", n.name, prev.Producer.PeerID, err)
		}
		if i == 0 {
			out.p2pPut, out.p2pPutCPU = time.Since(t0), processCPU()-c0
		}
		prev = s.held[n.name]
	}
	out.seqPulls = time.Since(t0)

	t0 = time.Now()
	got, err := p.s.Lookup(ctx, id)
	out.lookup = time.Since(t0)
	if err != nil {
		return out, err
	}
	t0 = time.Now()
	err = p.s.Fetch(ctx, got, s.dst)
	out.get = time.Since(t0)
	if err != nil {
		return out, err
	}
	if verify && !bytes.Equal(s.dst, s.srcData) {
		return out, fmt.Errorf("get %s delivered other bytes than were put", id)
	}

	t0 = time.Now()
	err = p.x.PullInto(ctx, s.held[holder.name], s.dst)
	out.p2p = time.Since(t0)
	if err != nil {
		return out, fmt.Errorf("p2p pull %s <- %s: %w", p.name, holder.name, err)
	}

	if err := p.s.Delete(ctx, id); err != nil {
		return out, err
	}
	return out, r.waitFreed(ctx, s)
}

// measure runs the warm-up and the interleaved repetitions of one size.
func (r *storeRun) measure(ctx context.Context, size int64) (StoreResult, error) {
	s, err := r.setup(size)
	if err != nil {
		return StoreResult{}, err
	}
	defer s.release()
	p := r.m.nodes[0]
	if got := p.x.TransportFor(s.held[r.m.nodes[1].name]); got != r.transport {
		return StoreResult{}, fmt.Errorf("pulls would use transport %q, not %q", got, r.transport)
	}
	// Warm up: dial every pair's pools and shm mappings both ways, fault in
	// the pages, and run one verified cycle. Every pair: a put's chain runs
	// between two holders, and its baseline then pulls between the same
	// two, so a pair left cold would charge the first use of its
	// connections and mappings (tens of ms over shm: the producer's arena
	// mapped and faulted in) to the put alone.
	r.progress("%s %s: warm-up", r.transport, bytesize.Format(size))
	for _, n := range r.m.nodes[1:] {
		if err := n.x.PullInto(ctx, s.src, s.into[n.name]); err != nil {
			return StoreResult{}, err
		}
		if err := p.x.PullInto(ctx, s.held[n.name], s.dst); err != nil {
			return StoreResult{}, err
		}
	}
	if !bytes.Equal(s.into[r.m.nodes[1].name], s.srcData) {
		return StoreResult{}, errors.New("a p2p pull delivered other bytes than were published")
	}
	for _, n := range r.m.nodes[1:] {
		for _, o := range r.m.nodes[1:] {
			if o == n {
				continue
			}
			if err := n.x.PullInto(ctx, s.held[o.name], s.into[n.name]); err != nil {
				return StoreResult{}, err
			}
		}
	}
	objectID := func(rep string) string {
		return fmt.Sprintf("bench-%s-%s-%s", r.transport, bytesize.Format(size), rep)
	}
	if _, err := r.cycle(ctx, s, objectID("warm"), true); err != nil {
		return StoreResult{}, err
	}

	var puts, gets, getsLookup, p2ps, p2pPuts, lookups, repls, seqs, putCPUs, p2pPutCPUs []float64
	for i := range r.cfg.Reps {
		r.progress("%s %s: rep %d/%d", r.transport, bytesize.Format(size), i+1, r.cfg.Reps)
		smp, err := r.cycle(ctx, s, objectID(fmt.Sprint(i)), false)
		if err != nil {
			return StoreResult{}, err
		}
		puts = append(puts, gbps(size, smp.put))
		gets = append(gets, gbps(size, smp.get))
		getsLookup = append(getsLookup, gbps(size, smp.lookup+smp.get))
		p2ps = append(p2ps, gbps(size, smp.p2p))
		p2pPuts = append(p2pPuts, gbps(size, smp.p2pPut))
		putCPUs = append(putCPUs, ms(smp.putCPU))
		p2pPutCPUs = append(p2pPutCPUs, ms(smp.p2pPutCPU))
		lookups = append(lookups, ms(smp.lookup))
		repls = append(repls, ms(smp.replicated))
		seqs = append(seqs, ms(smp.seqPulls))
	}
	put, get := summarize(puts), summarize(gets)
	res := StoreResult{
		Transport: r.transport, SizeBytes: size, Replicas: r.cfg.Replicas, Chunks: r.cfg.Chunks,
		PutGbpsMedian: put.median, PutGbpsMin: put.min, PutGbpsMax: put.max,
		GetGbpsMedian: get.median, GetGbpsMin: get.min, GetGbpsMax: get.max,
		LookupMSMedian:     summarize(lookups).median,
		P2PGbpsMedian:      summarize(p2ps).median,
		P2PPutGbpsMedian:   summarize(p2pPuts).median,
		PutCPUMSMedian:     summarize(putCPUs).median,
		P2PPutCPUMSMedian:  summarize(p2pPutCPUs).median,
		ReplicatedMSMedian: summarize(repls).median,
		SeqPullsMSMedian:   summarize(seqs).median,
		GetTarget:          GetTarget,
		PutTarget:          PutTarget,
		ReplicateTarget:    ReplicateTarget,
	}
	if res.P2PGbpsMedian > 0 {
		res.RatioGet = res.GetGbpsMedian / res.P2PGbpsMedian
		res.RatioGetWithLookup = summarize(getsLookup).median / res.P2PGbpsMedian
	}
	if res.P2PPutGbpsMedian > 0 {
		res.RatioPut = res.PutGbpsMedian / res.P2PPutGbpsMedian
	}
	if res.SeqPullsMSMedian > 0 {
		res.RatioReplicated = res.ReplicatedMSMedian / res.SeqPullsMSMedian
	}
	res.GetMeetsTarget = res.RatioGet >= GetTarget
	res.PutMeetsTarget = res.RatioPut >= PutTarget
	res.ReplicateMeetsTarget = res.RatioReplicated > 0 && res.RatioReplicated <= ReplicateTarget
	return res, nil
}

// WriteTable writes the report as aligned columns, then how it was measured.
func (rep *StoreReport) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join([]string{"transport", "size", "R", "chunks", "put GB/s", "p2p GB/s", "put/p2p", "put CPU ms", "p2p CPU ms",
		"R copies ms", "R pulls ms", "copies/pulls", "get GB/s", "p2p GB/s", "get/p2p", "lookup ms", "get+lookup/p2p",
		"put target", "copies target", "get target", ""}, "\t"))
	verdict := func(ok bool, target float64, more bool) string {
		switch {
		case ok && more:
			return fmt.Sprintf("met (>=%.1f)", target)
		case ok:
			return fmt.Sprintf("met (<=%.1f)", target)
		case more:
			return fmt.Sprintf("MISSED (<%.1f)", target)
		}
		return fmt.Sprintf("MISSED (>%.1f)", target)
	}
	for _, x := range rep.Results {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%s\t%s\t%s\t\n",
			x.Transport, bytesize.Format(x.SizeBytes), x.Replicas, x.Chunks, x.PutGbpsMedian, x.P2PPutGbpsMedian, x.RatioPut, x.PutCPUMSMedian, x.P2PPutCPUMSMedian,
			x.ReplicatedMSMedian, x.SeqPullsMSMedian, x.RatioReplicated,
			x.GetGbpsMedian, x.P2PGbpsMedian, x.RatioGet, x.LookupMSMedian, x.RatioGetWithLookup,
			verdict(x.PutMeetsTarget, x.PutTarget, true), verdict(x.ReplicateMeetsTarget, x.ReplicateTarget, false),
			verdict(x.GetMeetsTarget, x.GetTarget, true))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\nMedians. %d Store nodes in this process on one etcd. put: n0 -> R holders along a chain\n"+
		"(FirstCopy, mode TTL: a step checkpoint): Stage, Commit while the first copy lands, until\n"+
		"FirstCopied (that copy complete); R copies: until all are.\n"+
		"p2p (put): the first holder pulling n0's source; R pulls: that pull, then each next holder\n"+
		"pulling a payload of the one before, one after another. get: Fetch by n0 from its nearest\n"+
		"holder; lookup: the etcd record read before it; p2p (get): PullInto holder -> n0.\n"+
		"CPU ms: this process's CPU time (all nodes and etcd) during the put and during its p2p pull.\n"+
		"Baselines interleaved, same services and transport.\n", rep.Nodes)
	return err
}
