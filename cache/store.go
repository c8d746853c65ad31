package cache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/zeebo/xxh3"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/transfer"
	"github.com/latentmesh/latentmesh/transfer/arena"
)

// Orphans decides which objects belong to nobody any more (their job was
// cancelled, failed or is gone); the agent supplies it, since the Store
// knows nothing of jobs. It is called by the collecting member only, with
// at most Config.OrphanBatch records per maintenance pass.
type Orphans func(ctx context.Context, recs []Record) (ids []string, err error)

// Store is one agent's part of the pooled Store: the copies it holds, an
// index of the records that name it, which its watches keep current
// (maintenance works from it), and the client side of puts and gets. Build
// it with New, then Start.
type Store struct {
	cfg     Config
	log     *zap.Logger
	cli     *clientv3.Client
	xfer    *transfer.Service
	h       host.Host
	members func() []Member
	orphans Orphans
	hold    *holdings
	ret     *Retention
	idx     index     // the records that name this node, fed by its watches; what maintenance reads
	joins   joins     // members' join times, for repair
	coll    collector // the collector's state across passes
	flights flights
	recent  recentEntries // entries held elsewhere, as read lately (Entry)

	memoHits, memoMisses atomic.Int64 // Memo's answers, ever

	kick   chan struct{}
	ctx    context.Context // ended by Close: every goroutine's stop signal
	cancel context.CancelFunc
	wg     sync.WaitGroup // the loops, request handlers and local stages
	once   sync.Once

	mu sync.Mutex
	// mu guards the fields below: closed, so that no wg.Add races Close's
	// wg.Wait, and the epoch.
	closed bool
	// epoch ends when etcd is replaced (EtcdReplaced); the watch lists and
	// follows the records under one epoch, and lists again under the next.
	epoch    context.Context
	endEpoch context.CancelFunc

	repairs, collected, lost, puts, gets, reannounced atomic.Int64
	watchEvents                                       atomic.Int64 // events the record and marker watches received
}

// New builds a Store on the agent's etcd client, transfer service and
// libp2p host. members lists the live members, this node included (with its
// own Free); orphans may be nil (no job-based collection).
func New(cfg Config, cli *clientv3.Client, x *transfer.Service, h host.Host, members func() []Member, orphans Orphans) (*Store, error) {
	cfg, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if cli == nil || x == nil || h == nil || members == nil {
		return nil, errors.New("cache: New needs an etcd client, a transfer service, a host and a member list")
	}
	s := &Store{
		cfg: cfg, log: cfg.Logger.Named("store"), cli: cli, xfer: x, h: h, members: members, orphans: orphans,
		ret: NewRetention(cli, cfg.Now), kick: make(chan struct{}, 1),
		flights: flights{on: map[string]*flight{}},
	}
	s.hold = newHoldings(x, &s.cfg, s.log)
	if err := s.hold.prepareSpill(); err != nil {
		return nil, err
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.epoch, s.endEpoch = context.WithCancel(s.ctx)
	return s, nil
}

// Start serves store requests and runs the watch and maintenance loops.
func (s *Store) Start() {
	s.h.SetStreamHandler(ProtocolID, s.handle)
	s.xfer.OnTicket(s.hold.touch)
	s.wg.Go(s.watchLoop)
	s.wg.Go(s.maintainLoop)
}

// Close stops serving and frees every copy this node holds (its records
// keep naming it until the survivors' maintenance re-replicates). Close the
// Store before the transfer service. Idempotent.
func (s *Store) Close() error {
	s.once.Do(func() {
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		s.h.RemoveStreamHandler(ProtocolID)
		s.cancel()
		s.wg.Wait()
		s.hold.dropAll()
	})
	return nil
}

// enter registers a goroutine that may add copies to the holdings; it
// fails once Close began, so Close's dropAll sees every copy.
func (s *Store) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// Kick runs a maintenance pass soon (a member left: re-replicate).
func (s *Store) Kick() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// EtcdReplaced tells the Store that the etcd under it was replaced by an
// empty or restored one: revisions seen before mean nothing now. The watch
// stops following the old history, every copy forgets the revisions it has
// seen, and the records are listed again, so every copy is judged by
// whether a record of the new etcd names it; the records that vanished
// free their copies. A maintenance pass follows the new list.
func (s *Store) EtcdReplaced() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.endEpoch()
	s.epoch, s.endEpoch = context.WithCancel(s.ctx)
}

// currentEpoch is the epoch of the etcd under the Store now.
func (s *Store) currentEpoch() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.epoch
}

// Free is the room this node has left for the Store, in memory and on disk.
func (s *Store) Free() (mem, disk int64) { return s.hold.free() }

// RoomChanged signals when this node's Store room changed (a copy taken or
// freed), so the agent can gossip it; one signal may stand for several
// changes.
func (s *Store) RoomChanged() <-chan struct{} { return s.hold.room }

// Room is the largest object this node can take now: a copy lives in one
// tier, so the larger of its memory and disk room. Members gossip it; it is
// what placement compares with an object's size.
func (s *Store) Room() int64 {
	mem, disk := s.Free()
	return max(mem, disk, 0)
}

// PutSpec describes an object to put.
type PutSpec struct {
	ID          string        // object id (ValidID); JobObjectID names a job's
	Mode        Mode          // who frees it
	Job         string        // owner job ("" for none)
	TTL         time.Duration // retention; 0 = none (required for Mode TTL)
	Replicas    int           // copies wanted; 0 = the default for the mode
	ContentType string        // for files (results, previews)
	Local       bool          // hold it on this node only (previews)
	// Overflow holds the object on this node beyond its capacity when no
	// member has room, rather than failing (a decode's result: finishing it
	// is what frees the latents filling the Store). Counted in LocalStats.
	Overflow bool
	// FirstCopy stages every copy in flight along the put's chain
	// (chain.go): Stage returns once each holder has published its copy,
	// before the first copy's bytes land, so the caller commits the
	// record (written once, naming every copy) while they do; then
	// Staged.FirstCopied waits for the first copy, and the put is done
	// when it returns nil. Until then the caller keeps the source
	// published (StageBytes does it for its own). The later copies start
	// once the first is whole and complete in the background
	// (Staged.Replicated). A reader that
	// finds the record before a copy is complete waits for its chunks. A
	// first copy that fails fails the put, and FirstCopied takes its
	// record back; a later holder lost before its copy completed leaves
	// the object with fewer copies until repair restores them. Every
	// copy is a memory copy, not written through to disk: for objects
	// that are cheap to lose for a while (step checkpoints: a lost one
	// means resuming from the one before). Without it Stage returns when
	// every copy is complete (and, for a durable mode, on disk): results.
	FirstCopy bool
}

func (p PutSpec) check() error {
	switch {
	case !ValidID(p.ID):
		return fmt.Errorf("cache: invalid object id %q", p.ID)
	case !p.Mode.Valid():
		return fmt.Errorf("cache: invalid mode %q", p.Mode)
	case p.Mode == TTL && p.TTL <= 0:
		return errors.New("cache: a ttl object needs a TTL")
	case p.TTL < 0 || p.Replicas < 0 || p.Replicas > 8:
		return errors.New("cache: negative TTL or replicas not in [0,8]")
	}
	return nil
}

// Staged is a put whose copies exist but whose record is not written yet:
// invisible to readers. Write the record with Commit, or put Op in a
// transaction of your own (a stage's fenced commit); Abort otherwise. A
// FirstCopy put's copies may still be filling: after the commit,
// FirstCopied says whether the put succeeded.
type Staged struct {
	Record Record
	s      *Store
	lease  clientv3.LeaseID
	repl   *replication // the copies still filling (FirstCopy); nil for none (a Staged built by hand)
}

// Op is the etcd operation that makes the object visible: a transaction
// of its own, nested in the caller's, that writes the record and its
// holders' markers (marker.go).
func (st *Staged) Op() clientv3.Op { return clientv3.OpTxn(nil, st.ops(), nil) }

// ops are the writes of Op.
func (st *Staged) ops() []clientv3.Op {
	return writeOps(st.s.cfg.Prefix, st.Record.ID, &st.Record, st.lease, nil)
}

// Commit writes the record. A retention lease that etcd no longer knows is
// replaced once.
func (st *Staged) Commit(ctx context.Context) error {
	for try := 0; ; try++ {
		resp, err := st.s.cli.Txn(ctx).Then(st.ops()...).Commit()
		if err == nil {
			st.written(resp.Header.Revision)
			return nil
		}
		if try == 0 && LeaseGone(err) {
			if rerr := st.Renew(ctx); rerr != nil {
				return rerr
			}
			continue
		}
		return fmt.Errorf("cache: commit %s: %w", st.Record.ID, err)
	}
}

// written commits this node's own copies of a record the put wrote at
// revision rev, as the record's watch will: the putter need not wait for
// its watch to know (a Cache copy is evictable only once committed).
func (st *Staged) written(rev int64) {
	if ref, ok := st.Record.Holds(st.s.cfg.Node); ok {
		st.s.hold.commit(ref.ID, rev)
	}
}

// Renew replaces a retention lease that etcd no longer knows (see
// LeaseGone); a caller whose own transaction failed so calls it, then
// retries with a fresh Op.
func (st *Staged) Renew(ctx context.Context) error {
	if st.lease == 0 {
		return nil
	}
	st.s.ret.Forget(st.lease)
	ttl := st.Record.ExpiresAt.Sub(st.s.cfg.Now())
	lease, end, err := st.s.ret.Lease(ctx, max(ttl, time.Second))
	if err != nil {
		return err
	}
	st.lease, st.Record.ExpiresAt = lease, end
	return nil
}

// Keep confirms, before a commit that has waited (an etcd outage, a
// reclaimed task), that the staged copies still exist, and restarts their
// holders' stage timeouts. A holder that answers that it no longer has its
// copy is taken out of the record, so the commit names only copies that
// exist; one that does not answer stays named (it may be cut off with its
// copy). It fails, wrapping ErrNotFound, when every holder said its copy
// is gone: the put must be made again.
func (st *Staged) Keep(ctx context.Context) error {
	var kept []Holder
	var gone []string
	for _, h := range st.Record.Holders {
		var err error
		if h.Node == st.s.cfg.Node {
			if !st.s.hold.keep(st.Record.ID, h.Ref.ID) {
				err = transfer.ErrNotFound
			}
		} else {
			err = st.s.keepOn(ctx, h, st.Record.ID)
		}
		if errors.Is(err, transfer.ErrNotFound) {
			gone = append(gone, h.Node)
			continue
		}
		kept = append(kept, h)
	}
	if len(gone) > 0 {
		st.s.log.Warn("staged copies gone before the commit; not naming them", zap.String("object", st.Record.ID),
			zap.Strings("gone", gone), zap.Int("left", len(kept)))
	}
	if len(kept) == 0 {
		return fmt.Errorf("%w: every staged copy of %s is gone (%v)", ErrNotFound, st.Record.ID, gone)
	}
	st.Record.Holders = kept
	return nil
}

// keepOn asks h's node to keep its staged copy of id. An older holder that
// does not know the request answers it as bad; its copy is taken to be
// there.
func (s *Store) keepOn(ctx context.Context, h Holder, id string) error {
	m, ok := s.member(h.Node)
	if !ok {
		return fmt.Errorf("%w: %s is not a live member", transfer.ErrUnreachable, h.Node)
	}
	_, err := s.call(ctx, m, &request{V: baseVersion, Op: opKeep, Object: id, Payload: h.Ref.ID})
	if errors.Is(err, ErrProtocol) {
		return nil
	}
	return err
}

// member returns the live member named node.
func (s *Store) member(node string) (Member, bool) {
	for _, m := range s.members() {
		if m.Node == node {
			return m, true
		}
	}
	return Member{}, false
}

// Abort drops the staged copies (best effort: a holder that misses the
// request drops its copy after StageTimeout anyway).
func (st *Staged) Abort(ctx context.Context) {
	for _, h := range st.Record.Holders {
		st.s.dropOn(ctx, h, st.Record.ID)
	}
}

// Stage copies ref's payload onto the object's holders: R members chosen by
// rendezvous hashing among those with room (this node alone for a Local
// put), trying the next when one is full or unreachable. It fails with
// ErrFull when no member could take a copy; with fewer than R copies it
// succeeds, and maintenance adds the missing ones when room appears. A
// payload of this node's of at most Config.InlineMax bytes goes to remote
// holders inside the store request; they pull a larger one from ref. With
// spec.FirstCopy, keep ref published until FirstCopied returns.
func (s *Store) Stage(ctx context.Context, spec PutSpec, ref transfer.Ref) (*Staged, error) {
	return s.stage(ctx, spec, ref, nil, nil)
}

// stage is Stage; data, when not nil, is the payload's bytes, which the
// caller published as ref and keeps unchanged until stage returns.
// release, when not nil, is called once no copy will pull ref: when stage
// returns, or, for a FirstCopy put whose first copy is in flight, when
// that copy ended.
func (s *Store) stage(ctx context.Context, spec PutSpec, ref transfer.Ref, data []byte, release func()) (_ *Staged, err error) {
	start := time.Now()
	defer func() {
		if release != nil {
			release()
		}
	}()
	if err := spec.check(); err != nil {
		return nil, err
	}
	if err := ref.Meta.Validate(s.xfer.MaxPayloadBytes()); err != nil {
		return nil, fmt.Errorf("cache: stage %s: %w", spec.ID, err)
	}
	src, err := s.sourceOf(ctx, ref, data)
	if err != nil {
		return nil, fmt.Errorf("cache: stage %s: %w", spec.ID, err)
	}
	size := src.size()
	want := spec.Replicas
	if want == 0 {
		want = s.cfg.Replicas
		if spec.Mode == Cache {
			want = 1
		}
	}
	var cands []Member
	if spec.Local {
		cands, want = []Member{s.self()}, 1 // the holder itself says whether it has room
	} else {
		cands = place(s.members(), spec.ID, size, nil)
	}
	var holders []Holder
	var copies []chained // a chain's, in chain order; nil for copies staged side by side
	if src.data != nil || want == 1 {
		// Inline copies ride in the requests, and one copy is no chain:
		// side by side, each complete when its holder answers.
		holders, err = s.stageOnto(ctx, spec.ID, spec.Mode, src, cands, want, 0)
	} else if copies, err = s.stageChain(ctx, spec, src, cands, want); err == nil {
		if !spec.FirstCopy {
			var failed []error
			if copies, failed = s.settle(ctx, spec.ID, copies); len(copies) == 0 {
				err = errors.Join(failed...)
			}
		}
		for _, c := range copies {
			holders = append(holders, c.Holder)
		}
	}
	if errors.Is(err, ErrFull) && spec.Overflow {
		var h Holder
		if h, err = s.stageLocal(ctx, spec.ID, spec.Mode, src, true); err == nil {
			holders = []Holder{h}
			s.log.Warn("store full; holding an object beyond capacity", zap.String("object", spec.ID), zap.Int64("bytes", size))
		}
	}
	if err != nil {
		return nil, fmt.Errorf("cache: stage %s (%d bytes): %w", spec.ID, size, err)
	}
	if !spec.FirstCopy {
		holders = s.ensureDurable(ctx, spec, src, holders)
	}
	st := &Staged{s: s, Record: Record{
		ID: spec.ID, Size: size, Checksum: holders[0].Ref.Checksum, Meta: src.ref.Meta, ContentType: spec.ContentType,
		Mode: spec.Mode, Job: spec.Job, Replicas: want, Holders: holders, CreatedAt: s.cfg.Now().UTC(),
	}}
	for _, h := range holders[1:] {
		if h.Ref.Checksum != st.Record.Checksum {
			st.Abort(ctx)
			return nil, fmt.Errorf("cache: stage %s: copies differ (xxh3 %x on %s, %x on %s)", spec.ID, st.Record.Checksum, holders[0].Node, h.Ref.Checksum, h.Node)
		}
	}
	if spec.TTL > 0 {
		if st.lease, st.Record.ExpiresAt, err = s.ret.Lease(ctx, spec.TTL); err != nil {
			st.Abort(ctx)
			return nil, err
		}
	}
	s.puts.Add(1)
	first := time.Since(start)
	inFlight := 0
	for _, c := range copies {
		if c.inFlight {
			inFlight++
		}
	}
	res := Replication{Wanted: want, Complete: len(holders) - inFlight, FirstCopy: first, AllCopies: first}
	if inFlight == 0 {
		st.repl = closedReplication(res)
	} else {
		st.repl = newReplication(res)
		if release == nil {
			release = func() {}
		}
		s.followChain(st, copies, start, release)
		release = nil // followChain's now
	}
	return st, nil
}

// ensureDurable adds a copy on this node's disk to the holders of a
// durable object none of whose copies landed on a disk (the holders chosen
// have no disk tier, or theirs is full), when this node has one with room:
// a result is on a disk before its job says succeeded. Best effort: with
// no disk anywhere the object lives in memory, as before.
func (s *Store) ensureDurable(ctx context.Context, spec PutSpec, src source, holders []Holder) []Holder {
	if !durable(spec.Mode) || s.cfg.SpillCapacity == 0 || src.ref.Checksum == 0 {
		return holders
	}
	for _, h := range holders {
		if h.Tier == Disk || h.Node == s.cfg.Node {
			return holders
		}
	}
	h, err := s.stageLocal(ctx, spec.ID, spec.Mode, src, false)
	if err != nil || h.Tier != Disk {
		if err == nil {
			s.dropStaged(spec.ID, h.Ref.ID)
		}
		s.log.Warn("no copy of a durable object is on a disk", zap.String("object", spec.ID), zap.Error(err))
		return holders
	}
	return append(holders, h)
}

// sourceOf is what copies of ref's payload are made from: its bytes when
// the payload is this node's and at most InlineMax long (an inline put:
// remote holders take them with the request), else ref, for holders to
// pull. data, when not nil, is the payload's bytes, already at hand. An
// inline source carries the payload's XXH3, computed here for one
// published without it (Begin), so every copy, and the record, carry the
// checksum the holders verify the bytes against.
func (s *Store) sourceOf(ctx context.Context, ref transfer.Ref, data []byte) (source, error) {
	size := ref.Meta.Bytes()
	if size == 0 || size > int64(s.cfg.InlineMax) || ref.Producer.PeerID != s.h.ID().String() {
		return source{ref: ref}, nil
	}
	if int64(len(data)) != size {
		// Copied out of our own payload, once every chunk is ready (a pull
		// would wait for them too). Not Pull: it hands back a payload's
		// memory uncopied unless it is in the arena, and a spilled copy's
		// mapping goes when the copy is dropped, maybe before the request
		// has been written.
		ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
		defer cancel()
		data = make([]byte, size)
		if err := s.xfer.PullInto(transfer.ForStore(ctx), ref, data); err != nil {
			return source{}, err
		}
	}
	if ref.Checksum == 0 {
		ref.Checksum = xxh3.Hash(data)
	}
	if ref.Checksum == 0 {
		return source{ref: ref}, nil // 0 means "no checksum": pull instead (one payload in 2^64)
	}
	return source{ref: ref, data: data}, nil
}

// stageOnto stages copies on the candidates, want at a time in parallel,
// until want succeeded or the candidates ran out. Every copy costs the
// source one request, and a pull unless it goes inline, so R copies of a
// put run side by side. perCall, when positive, bounds each candidate's
// request (repairs); 0 leaves RequestTimeout.
func (s *Store) stageOnto(ctx context.Context, id string, mode Mode, src source, cands []Member, want int, perCall time.Duration) ([]Holder, error) {
	var holders []Holder
	var errs []error
	for len(holders) < want && len(cands) > 0 {
		batch := cands[:min(want-len(holders), len(cands))]
		cands = cands[len(batch):]
		got := make([]Holder, len(batch))
		errOf := make([]error, len(batch))
		var wg sync.WaitGroup
		for i, m := range batch {
			wg.Go(func() {
				cctx := ctx
				if perCall > 0 {
					var cancel context.CancelFunc
					cctx, cancel = context.WithTimeout(ctx, perCall)
					defer cancel()
				}
				got[i], errOf[i] = s.stageOn(cctx, m, id, mode, src, nil)
			})
		}
		wg.Wait()
		for i := range batch {
			if errOf[i] != nil {
				s.log.Debug("stage refused", zap.String("object", id), zap.String("on", batch[i].Node), zap.Error(errOf[i]))
				errs = append(errs, fmt.Errorf("%s: %w", batch[i].Node, errOf[i]))
				continue
			}
			holders = append(holders, got[i])
		}
		if ctx.Err() != nil {
			break
		}
	}
	if len(holders) == 0 {
		return nil, noCopyErr(errs)
	}
	return holders, nil
}

// self is this node as a member.
func (s *Store) self() Member {
	for _, m := range s.members() {
		if m.Node == s.cfg.Node {
			return m
		}
	}
	return Member{Node: s.cfg.Node, PeerID: s.h.ID().String(), Free: s.Room()}
}

// stageOn asks m (or this node) to take a staged copy of src: inline, with
// the bytes in the request, when src has them, else by pulling src.ref.
// opts, when not nil, are a chained put's: the copy in flight (early), its
// fill deferred until asked (deferred), and the sources to fall back on.
// A holder that refuses a request as malformed (an older build, or a
// MaxFrame too small for inline bytes) is asked again without the newest
// of its fields, one at a time: the deferral (it fills at once), the
// putter's ticket (it asks for one), then the chain fields or the bytes (a
// plain copy of src, whole); opts says what was kept.
func (s *Store) stageOn(ctx context.Context, m Member, id string, mode Mode, src source, opts *chainOpts) (Holder, error) {
	if opts == nil {
		opts = &chainOpts{}
	}
	if m.Node == s.cfg.Node {
		if opts.early {
			return s.stageEarly(ctx, id, mode, append([]transfer.Ref{src.ref}, opts.fallback...), nil, opts.deferred)
		}
		return s.stageLocalFrom(ctx, id, mode, src, opts.fallback)
	}
	req := &request{Op: opStage, Object: id, Mode: mode, Src: src.ref}
	if src.data != nil {
		req.Data = src.data
	} else {
		req.Early, req.Deferred, req.Fallback = opts.early, opts.early && opts.deferred, opts.fallback
		req.Issued = s.issueFor(m, src.ref)
	}
	for {
		req.V = req.version()
		resp, err := s.call(ctx, m, req)
		if !errors.Is(err, ErrProtocol) || ctx.Err() != nil {
			return stageAnswer(m, resp, err)
		}
		switch {
		case req.Deferred:
			req.Deferred = false
		case len(req.Issued) > 0:
			req.Issued = nil // it asks for a ticket
		case req.V > baseVersion:
			req.Data, req.Early, req.Fallback = nil, false, nil
		default:
			return stageAnswer(m, resp, err)
		}
		opts.early, opts.deferred = req.Early, req.Deferred
		s.log.Debug("stage request refused; asking with fewer fields", zap.String("object", id), zap.String("on", m.Node), zap.Int("v", req.V), zap.Error(err))
	}
}

// stageAnswer is the holder m's answer to a stage request.
func stageAnswer(m Member, resp *response, err error) (Holder, error) {
	if err != nil {
		return Holder{}, err
	}
	if resp.Holder.Node != m.Node {
		return Holder{}, fmt.Errorf("%w: %s answered as %q", ErrProtocol, m.Node, resp.Holder.Node)
	}
	return resp.Holder, nil
}

// issueFor is a ticket for ref, this node's own payload, issued to member
// m (transfer.Service.Issue), for m's stage request to carry; nil when
// ref is another node's, or the ticket cannot be issued or does not fit
// the request.
func (s *Store) issueFor(m Member, ref transfer.Ref) []byte {
	if ref.Producer.PeerID != s.h.ID().String() {
		return nil
	}
	pid, err := peer.Decode(m.PeerID)
	if err != nil {
		return nil
	}
	raw, err := s.xfer.Issue(ref.ID, pid)
	if err != nil || len(raw) > maxIssued {
		return nil
	}
	return raw
}

// stageLocalFrom is stageLocal from src, then from each fallback in turn
// while the pull is what failed (not room, not a closing Store).
func (s *Store) stageLocalFrom(ctx context.Context, id string, mode Mode, src source, fallback []transfer.Ref) (Holder, error) {
	h, err := s.stageLocal(ctx, id, mode, src, false)
	var errs []error
	for _, f := range fallback {
		if err == nil || errIsFull(err) || errors.Is(err, ErrClosed) || ctx.Err() != nil {
			break
		}
		errs = append(errs, fmt.Errorf("from %s: %w", src.ref.Producer.PeerID, err))
		s.log.Debug("copy failed; falling back to an earlier source", zap.String("object", id), zap.String("next", f.Producer.PeerID), zap.Error(err))
		src = source{ref: f}
		h, err = s.stageLocal(ctx, id, mode, src, false)
	}
	if err != nil && len(errs) > 0 {
		err = fmt.Errorf("%w (earlier sources: %w)", err, errors.Join(errs...))
	}
	return h, err
}

// stageLocal takes a staged copy of src on this node.
func (s *Store) stageLocal(ctx context.Context, id string, mode Mode, src source, overflow bool) (Holder, error) {
	if !s.enter() {
		return Holder{}, ErrClosed
	}
	defer s.wg.Done()
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	defer context.AfterFunc(s.ctx, stop)() // Close waits for us: end the copy
	size := src.size()
	tier, evicted, err := s.hold.reserve(size, mode, overflow)
	s.hold.release(evicted...)
	if len(evicted) > 0 {
		s.deleteEvicted(ctx, evicted)
	}
	if err != nil {
		return Holder{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	c, err := s.hold.fill(ctx, id, mode, tier, src, overflow)
	if tier == Memory && errors.Is(err, arena.ErrNoSpace) && !overflow {
		// The arena is shared with the agent's own stage buffers: under the
		// Store's capacity but out of arena, the copy goes to disk.
		if _, _, derr := s.hold.reserveDisk(size); derr == nil {
			tier = Disk
			c, err = s.hold.fill(ctx, id, mode, tier, src, false)
		}
	}
	if err != nil {
		return Holder{}, err
	}
	s.log.Debug("staged", zap.String("object", id), zap.String("tier", string(tier)), zap.Int64("bytes", size))
	return Holder{Node: s.cfg.Node, Tier: tier, Ref: c.ref}, nil
}

// deleteEvicted removes the records of evicted cache entries (R=1: the
// copy was the object), with their markers.
func (s *Store) deleteEvicted(ctx context.Context, cs []*copyOf) {
	for _, c := range cs {
		// Only if the record still names the evicted copy.
		resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, c.object))
		if err != nil || len(resp.Kvs) == 0 {
			continue
		}
		rec, err := decodeRecord(resp.Kvs[0].Value)
		if ref, ok := rec.Holds(s.cfg.Node); err == nil && ok && ref.ID == c.ref.ID {
			s.writeIf(ctx, &listed{Record: rec, modRev: resp.Kvs[0].ModRevision}, nil)
		}
		s.log.Debug("evicted", zap.String("object", c.object), zap.Int64("bytes", c.size))
	}
}

// dropOn asks h's node to drop an aborted staged copy.
func (s *Store) dropOn(ctx context.Context, h Holder, id string) {
	if h.Node == s.cfg.Node {
		s.dropStaged(id, h.Ref.ID)
		return
	}
	if m, ok := s.member(h.Node); ok {
		if _, err := s.call(ctx, m, &request{V: baseVersion, Op: opDrop, Object: id, Payload: h.Ref.ID}); err != nil {
			s.log.Debug("drop request", zap.String("object", id), zap.String("on", h.Node), zap.Error(err))
		}
	}
}

// dropStaged drops a copy of id that no record names yet. The check runs
// under the holdings' lock: a commit whose answer the putter lost (and so
// aborts) may have reached the watch meanwhile, and then the copy stays.
func (s *Store) dropStaged(id, payload string) {
	s.hold.dropIf(payload, func(c *copyOf) bool { return c.object == id && !c.committed })
}

// call sends one request to m and reads its response.
func (s *Store) call(ctx context.Context, m Member, req *request) (*response, error) {
	pid, err := peer.Decode(m.PeerID)
	if err != nil {
		return nil, fmt.Errorf("cache: member %s peer id: %w", m.Node, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	str, stop, err := transfer.OpenStream(ctx, s.h, pid, m.P2PAddrs, ProtocolID)
	if err != nil {
		return nil, fmt.Errorf("%w: store request to %s: %v", transfer.ErrUnreachable, m.Node, err)
	}
	defer str.Close()
	defer stop()
	str.SetDeadline(time.Now().Add(s.cfg.RequestTimeout))
	if err := transfer.WriteFrame(str, req); err != nil {
		return nil, fmt.Errorf("%w: store request to %s: %v", transfer.ErrUnreachable, m.Node, err)
	}
	var resp response
	if err := transfer.ReadFrame(str, s.cfg.MaxFrame, &resp); err != nil {
		return nil, fmt.Errorf("%w: store response from %s: %v", transfer.ErrUnreachable, m.Node, err)
	}
	switch resp.ErrCode {
	case "":
		return &resp, nil
	case codeFull:
		return nil, fmt.Errorf("%w: %s", ErrFull, resp.ErrMsg)
	case codeDenied:
		return nil, fmt.Errorf("%w: %s", ErrDenied, resp.ErrMsg)
	case codeNotFound:
		return nil, fmt.Errorf("%w: %s", transfer.ErrNotFound, resp.ErrMsg)
	case codeCorrupt:
		return nil, fmt.Errorf("%w: %s: %s", transfer.ErrCorrupt, m.Node, resp.ErrMsg)
	case codeBad:
		return nil, fmt.Errorf("%w: %s refused the request: %s", ErrProtocol, m.Node, resp.ErrMsg)
	}
	return nil, fmt.Errorf("cache: %s refused (%s): %s", m.Node, resp.ErrCode, resp.ErrMsg)
}

// handle answers one store request from a member.
func (s *Store) handle(str network.Stream) {
	defer str.Close()
	remote := str.Conn().RemotePeer()
	str.SetDeadline(time.Now().Add(s.cfg.RequestTimeout))
	answer := func(r response) {
		r.V = baseVersion
		if len(r.ErrMsg) > maxErrLen {
			r.ErrMsg = r.ErrMsg[:maxErrLen]
		}
		transfer.WriteFrame(str, &r)
	}
	if !s.enter() {
		answer(response{ErrCode: codeClosed, ErrMsg: ErrClosed.Error()})
		return
	}
	defer s.wg.Done()
	if !s.isMember(remote) {
		s.log.Debug("store request from a non-member", zap.Stringer("peer", remote))
		answer(response{ErrCode: codeDenied, ErrMsg: "not a registered member of this mesh"})
		return
	}
	var req request
	if err := transfer.ReadFrame(str, s.cfg.MaxFrame, &req); err != nil {
		s.log.Debug("bad store request", zap.Stringer("peer", remote), zap.Error(err))
		answer(response{ErrCode: codeBad, ErrMsg: err.Error()})
		return
	}
	answer(s.serve(remote, &req))
}

// serve carries out a validated request from member remote.
func (s *Store) serve(remote peer.ID, req *request) response {
	switch req.Op {
	case opDrop:
		s.dropStaged(req.Object, req.Payload)
		return response{}
	case opKeep:
		if !s.hold.keep(req.Object, req.Payload) {
			return response{ErrCode: codeNotFound, ErrMsg: fmt.Sprintf("no copy %s of %s", req.Payload, req.Object)}
		}
		return response{}
	case opWait, opFill:
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		defer cancel()
		err := s.waitLocal(ctx, req.Object, req.Payload, req.Op == opFill)
		switch {
		case err == nil:
			return response{}
		case errors.Is(err, transfer.ErrNotFound):
			return response{ErrCode: codeNotFound, ErrMsg: err.Error()}
		case errors.Is(err, ErrClosed):
			return response{ErrCode: codeClosed, ErrMsg: err.Error()}
		}
		return response{ErrCode: codeFailed, ErrMsg: err.Error()}
	case opStage:
		src := source{ref: req.Src}
		if len(req.Data) > 0 {
			// Checked before anything is reserved: a copy that does not
			// match is never staged.
			if err := req.checkInline(); err != nil {
				s.log.Warn("inline copy refused", zap.Stringer("peer", remote), zap.String("object", req.Object), zap.Error(err))
				return response{ErrCode: codeCorrupt, ErrMsg: err.Error()}
			}
			src.data = req.Data
		}
		ctx, cancel := context.WithTimeout(s.ctx, s.cfg.RequestTimeout)
		defer cancel()
		if len(req.Issued) > 0 {
			// The putter's ticket for its own payload: no round trip to
			// ask for one. The pull checks it as any ticket.
			ctx = transfer.WithIssued(ctx, req.Src.ID, req.Issued)
		}
		var h Holder
		var err error
		if req.Early {
			h, err = s.stageEarly(ctx, req.Object, req.Mode, append([]transfer.Ref{req.Src}, req.Fallback...), req.Issued, req.Deferred)
		} else {
			h, err = s.stageLocalFrom(ctx, req.Object, req.Mode, src, req.Fallback)
		}
		switch {
		case err == nil:
			return response{Holder: h}
		case errIsFull(err):
			return response{ErrCode: codeFull, ErrMsg: err.Error()}
		case errors.Is(err, ErrClosed):
			return response{ErrCode: codeClosed, ErrMsg: err.Error()}
		case errors.Is(err, transfer.ErrNotFound):
			return response{ErrCode: codeNotFound, ErrMsg: err.Error()}
		}
		return response{ErrCode: codeFailed, ErrMsg: err.Error()}
	}
	return response{ErrCode: codeBad, ErrMsg: fmt.Sprintf("op %q", req.Op)} // Validate let no other op through
}

func (s *Store) isMember(p peer.ID) bool {
	id := p.String()
	if s.cfg.IsMember != nil {
		return s.cfg.IsMember(id)
	}
	for _, m := range s.members() {
		if m.PeerID == id {
			return true
		}
	}
	return false
}

// Put stages src and commits its record: the object is readable when Put
// returns (with FirstCopy, its first copy complete).
func (s *Store) Put(ctx context.Context, spec PutSpec, src transfer.Ref) (Record, error) {
	return commitStaged(ctx)(s.Stage(ctx, spec, src))
}

// commitStaged returns a function that commits what a Stage returned,
// aborting it when the commit fails, and then waits for its first copy
// (FirstCopied takes the record back when that copy failed).
func commitStaged(ctx context.Context) func(*Staged, error) (Record, error) {
	return func(st *Staged, err error) (Record, error) {
		if err != nil {
			return Record{}, err
		}
		if err := st.Commit(ctx); err != nil {
			st.Abort(context.WithoutCancel(ctx))
			return Record{}, err
		}
		if err := st.FirstCopied(ctx); err != nil {
			return Record{}, err
		}
		return st.Record, nil
	}
}

// StageBytes stages data (a file: a result, a preview, a checkpoint) as an
// object. It is published from this node's heap for the holders to pull,
// then released once the first copy is whole (for a FirstCopy put, maybe
// after StageBytes returned: data must stay unchanged until FirstCopied
// returns); remote holders of a small one take data itself, inline.
func (s *Store) StageBytes(ctx context.Context, spec PutSpec, data []byte) (*Staged, error) {
	if len(data) == 0 {
		return nil, errors.New("cache: empty object")
	}
	ref, err := s.xfer.Publish(transfer.TensorMeta{DType: transfer.Uint8, Shape: []int64{int64(len(data))}}, data)
	if err != nil {
		return nil, err
	}
	return s.stage(ctx, spec, ref, data, func() { s.xfer.Release(ref.ID) })
}

// PutBytes is StageBytes and Commit.
func (s *Store) PutBytes(ctx context.Context, spec PutSpec, data []byte) (Record, error) {
	return commitStaged(ctx)(s.StageBytes(ctx, spec, data))
}

// Lookup reads an object's record.
func (s *Store) Lookup(ctx context.Context, id string) (Record, error) {
	return s.lookup(ctx, id)
}

// LookupStale reads an object's record from the etcd member the client
// talks to, without quorum (a serializable read): what a reader can still
// learn while etcd has no leader. The record may lag (holders come and
// go; a reader skips a gone one), and a record absent here may only not
// have reached this member yet.
func (s *Store) LookupStale(ctx context.Context, id string) (Record, error) {
	return s.lookup(ctx, id, clientv3.WithSerializable())
}

func (s *Store) lookup(ctx context.Context, id string, opts ...clientv3.OpOption) (Record, error) {
	if !ValidID(id) {
		return Record{}, ErrNotFound
	}
	resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, id), opts...)
	if err != nil {
		return Record{}, fmt.Errorf("cache: lookup %s: %w", id, err)
	}
	if len(resp.Kvs) == 0 {
		return Record{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return decodeRecord(resp.Kvs[0].Value)
}

// Nearest orders rec's holders for reading: this node, then live holders
// on this host (shm), then other live holders, then those not seen alive.
// Holders Config.VerifyHolder refuses are left out.
func (s *Store) Nearest(rec Record) []Holder {
	alive := map[string]bool{}
	for _, m := range s.members() {
		alive[m.Node] = true
	}
	hostID := s.xfer.HostID()
	rankOf := func(h Holder) int {
		switch {
		case h.Node == s.cfg.Node:
			return 0
		case !alive[h.Node]:
			return 3
		case h.Ref.Producer.Host != "" && h.Ref.Producer.Host == hostID:
			return 1
		}
		return 2
	}
	out := make([]Holder, 0, len(rec.Holders))
	for _, h := range rec.Holders {
		if h.Node != s.cfg.Node && s.cfg.VerifyHolder != nil && !s.cfg.VerifyHolder(h.Node, h.Ref.Producer.PeerID) {
			s.log.Warn("skipping a holder that is not its node's registered peer",
				zap.String("object", rec.ID), zap.String("node", h.Node), zap.String("peer", h.Ref.Producer.PeerID))
			continue
		}
		out = append(out, h)
	}
	slices.SortStableFunc(out, func(a, b Holder) int { return rankOf(a) - rankOf(b) })
	return out
}

// Fetch copies rec's bytes into dst (len rec.Size) from the nearest holder
// that still has them. ErrNotFound means no holder had them.
func (s *Store) Fetch(ctx context.Context, rec Record, dst []byte) error {
	if int64(len(dst)) != rec.Size {
		return fmt.Errorf("%w: %d bytes for a %d-byte object", transfer.ErrBufferSize, len(dst), rec.Size)
	}
	var errs []error
	for _, h := range s.Nearest(rec) {
		if h.Node == s.cfg.Node {
			s.hold.touch(h.Ref.ID) // no ticket for a local read
		}
		err := s.xfer.PullInto(transfer.ForStore(ctx), h.Ref, dst)
		if err == nil {
			s.gets.Add(1)
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		errs = append(errs, fmt.Errorf("%s: %w", h.Node, err))
	}
	all := errors.Join(errs...)
	if len(errs) == 0 {
		return fmt.Errorf("%w: %s has no holders", ErrNotFound, rec.ID)
	}
	return fmt.Errorf("%w: %s: every holder failed: %w", ErrNotFound, rec.ID, all)
}

// ReadAll looks an object up and returns its bytes.
func (s *Store) ReadAll(ctx context.Context, id string) ([]byte, Record, error) {
	rec, err := s.Lookup(ctx, id)
	if err != nil {
		return nil, Record{}, err
	}
	buf := make([]byte, rec.Size)
	if err := s.Fetch(ctx, rec, buf); err != nil {
		return nil, rec, err
	}
	return buf, rec, nil
}

// DeleteOp is the etcd operation that frees object id (for a stage's
// fenced commit: delete-on-consume). Its holders drop their copies, and
// their markers, when they see the record go.
func (s *Store) DeleteOp(id string) clientv3.Op {
	return clientv3.OpDelete(ObjectKey(s.cfg.Prefix, id))
}

// Delete frees object id: it reads the record and deletes it with its
// holders' markers (a holder that follows it by its marker alone frees its
// copy then); the holders that watch it drop their copies, and their
// markers, when they see the record go. A record that changes under it
// three times in a row is an error.
func (s *Store) Delete(ctx context.Context, id string) error {
	s.recent.forget(id)
	key := ObjectKey(s.cfg.Prefix, id)
	for range 3 {
		resp, err := s.cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) == 0 {
			return err
		}
		ls := s.decodeListed(resp.Kvs)
		if len(ls) == 0 { // no record this Store can read the holders of
			_, err := s.cli.Delete(ctx, key)
			return err
		}
		t, err := s.writeIf(ctx, ls[0], nil)
		if err != nil || t.Succeeded {
			return err
		}
	}
	return fmt.Errorf("cache: delete %s: its record kept changing", id)
}

// List returns the records whose id starts with idPrefix ("" for all;
// JobObjectID(job, "") for a job's).
func (s *Store) List(ctx context.Context, idPrefix string) ([]Record, error) {
	ls, _, err := s.list(ctx, idPrefix)
	if err != nil {
		return nil, err
	}
	out := make([]Record, len(ls))
	for i, l := range ls {
		out[i] = l.Record
	}
	return out, nil
}

// list reads the records whose id starts with idPrefix, in id order, and
// the revision of the read. A record that does not decode, or whose id is
// not its key's, is left out.
func (s *Store) list(ctx context.Context, idPrefix string) ([]*listed, int64, error) {
	resp, err := s.cli.Get(ctx, ObjectKey(s.cfg.Prefix, idPrefix), clientv3.WithPrefix())
	if err != nil {
		return nil, 0, fmt.Errorf("cache: list objects: %w", err)
	}
	return s.decodeListed(resp.Kvs), resp.Header.Revision, nil
}

// decodeListed decodes the records kvs (in key order), leaving out one
// that does not decode, or whose id is not its key's.
func (s *Store) decodeListed(kvs []*mvccpb.KeyValue) []*listed {
	out := make([]*listed, 0, len(kvs))
	for _, kv := range kvs {
		rec, err := decodeRecord(kv.Value)
		if err != nil {
			s.log.Warn("undecodable object record", zap.ByteString("key", kv.Key), zap.Error(err))
			continue
		}
		if l := s.listedAt(kv, rec); l != nil {
			out = append(out, l)
		}
	}
	return out
}
