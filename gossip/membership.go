package gossip

import (
	"context"
	"fmt"
	"log"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Peer is one node as this node sees it: its etcd registration merged with
// memberlist's view of it.
type Peer struct {
	Record NodeRecord
	// Meta is the node's last gossiped NodeMeta; zero until one arrives.
	Meta NodeMeta
	// MetaAt is when that meta arrived, on this node's clock (now for
	// this node itself, whose meta is current): what the node said after
	// a moment is newer than it.
	MetaAt time.Time
	// Registered: the node's record is in etcd now. Peers lists only
	// registered nodes; Peer reports an unregistered one with false.
	Registered bool
	// Lease is the etcd lease the node's registration lives on (0 when
	// not registered): what the node's claims live on, so a claim made on
	// the node's behalf (a pushed claim) goes on it too.
	Lease clientv3.LeaseID
	// Alive: memberlist counts the node as a member (alive or suspect).
	// False when it was declared dead or left, or was never seen.
	Alive bool
	// Suspect: this node's probes of the peer failed recently and memberlist
	// has not yet declared it dead or seen it answer again. A hint to route
	// elsewhere, not a verdict.
	Suspect bool
}

// Membership is one node's membership in the mesh: its etcd registration
// and lease, its memberlist instance, and the merged view of all nodes.
// Build it with New, then call Start; Close releases everything.
type Membership struct {
	cfg         Config
	cli         *clientv3.Client
	log         *zap.Logger
	nodesPrefix string // <prefix>/nodes/
	selfKey     string

	ctx    context.Context // canceled by Close; the stop signal of every goroutine
	cancel context.CancelFunc
	wg     sync.WaitGroup // goroutines and an in-flight Start
	done   chan struct{}  // closed when Close finishes

	metaKick chan struct{} // cap 1: a meta update is pending
	workKick chan struct{} // cap 1: joins or revokes are pending
	selfGone chan struct{} // cap 1: our own key was deleted from etcd

	dropped atomic.Uint64 // events not delivered to a full subscriber

	keyring    *memberlist.Keyring // nil without KeyringFile; memberlist reads it, keyringLoop edits it
	keyringRaw []byte              // the file content keyring was built from
	logs       *logBridge          // memberlist's log lines, bounded

	// lifeMu guards the lifecycle fields below.
	lifeMu  sync.Mutex
	started bool
	closed  bool
	ml      *memberlist.Memberlist // set once Start succeeds
	// contact is when etcd last answered for this node's lease (a grant
	// or a renewal), in Unix nanoseconds: the agent's sign that etcd
	// serves it, which costs etcd nothing beyond the keepalives.
	contact atomic.Int64

	// mu guards the fields below.
	mu        sync.Mutex
	self      NodeRecord
	meta      NodeMeta
	metaBytes []byte
	lease     clientv3.LeaseID
	leaseCh   chan struct{} // closed and replaced when lease changes
	records   map[string]registration
	members   map[string]*member
	// gen counts changes of the view (records, members, meta); peers is
	// Peers' answer at peersGen, valid until peersUntil (when a suspicion
	// it shows lapses; zero: no such time).
	gen        uint64
	peers      []Peer
	peersGen   uint64
	peersUntil time.Time
	subs       map[*subscription]struct{}
	subsDone   bool                        // Close closed every subscription
	joins      map[string]string           // node id -> gossip addr to join
	revokes    map[clientv3.LeaseID]string // dead peer's lease -> node id
}

// registration is a node's record as last read from etcd.
type registration struct {
	rec   NodeRecord
	lease clientv3.LeaseID
}

// member is memberlist's view of a node.
type member struct {
	meta         NodeMeta
	metaAt       time.Time // when meta arrived
	alive        bool      // joined and not since declared dead or left
	suspectUntil time.Time // set when our probe failed; see suspected
}

// New validates cfg and rec and prepares a Membership; nothing touches the
// network until Start. cli is the etcd client to register with; the caller
// keeps ownership of it and closes it after Close.
func New(cfg Config, cli *clientv3.Client, rec NodeRecord) (*Membership, error) {
	cfg, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if cli == nil {
		return nil, fmt.Errorf("%w: etcd client is nil", ErrInvalidConfig)
	}
	if err := rec.validate(); err != nil {
		return nil, err
	}
	rec = rec.clone()
	meta := NodeMeta{Version: MetaVersion, Roles: rec.Roles}
	metaBytes, err := EncodeMeta(meta)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Membership{
		cfg:         cfg,
		cli:         cli,
		log:         cfg.Logger.Named("gossip").With(zap.String("node", rec.ID)),
		nodesPrefix: cfg.Prefix + "/nodes/",
		ctx:         ctx,
		cancel:      cancel,
		done:        make(chan struct{}),
		metaKick:    make(chan struct{}, 1),
		workKick:    make(chan struct{}, 1),
		selfGone:    make(chan struct{}, 1),
		self:        rec,
		meta:        meta.clone(),
		metaBytes:   metaBytes,
		leaseCh:     make(chan struct{}),
		records:     make(map[string]registration),
		members:     make(map[string]*member),
		subs:        make(map[*subscription]struct{}),
		joins:       make(map[string]string),
		revokes:     make(map[clientv3.LeaseID]string),
	}
	m.selfKey = m.nodesPrefix + rec.ID
	m.logs = newLogBridge(m)
	if cfg.KeyringFile != "" {
		keys, raw, err := readKeyring(cfg.KeyringFile)
		if err != nil {
			cancel()
			return nil, err
		}
		if m.keyring, err = memberlist.NewKeyring(keys[1:], keys[0]); err != nil {
			cancel()
			return nil, fmt.Errorf("%w: %v", ErrInvalidKeyring, err)
		}
		m.keyringRaw = raw
	}
	return m, nil
}

// Start starts memberlist, registers this node in etcd under a fresh lease,
// joins the nodes already registered and starts watching for more. It
// returns once registered, or when ctx ends. If another live lease holds
// this node's id (a previous incarnation that has not expired yet), Start
// keeps retrying until ctx ends. A Membership whose Start failed must be
// closed and cannot be started again.
func (m *Membership) Start(ctx context.Context) (err error) {
	m.lifeMu.Lock()
	switch {
	case m.closed:
		m.lifeMu.Unlock()
		return ErrClosed
	case m.started:
		m.lifeMu.Unlock()
		return ErrStarted
	}
	m.started = true
	m.wg.Add(1) // Close waits for an in-flight Start
	m.lifeMu.Unlock()
	defer m.wg.Done()

	// Close cancels m.ctx; Start must give up then as well.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(m.ctx, cancel)
	defer stop()

	if m.keyring == nil {
		m.log.Warn("gossip is not encrypted: anyone who reaches the gossip port can forge members' meta and declare them dead; set a keyring file")
	} else {
		m.checkKeyringMode()
	}
	ml, err := m.createMemberlist()
	if err != nil {
		return err
	}
	var lease clientv3.LeaseID
	defer func() {
		if err != nil {
			if lease != 0 {
				m.revoke(lease)
				m.setLease(0)
			}
			if serr := ml.Shutdown(); serr != nil {
				m.log.Warn("memberlist shutdown", zap.Error(serr))
			}
		}
	}()

	if lease, err = m.registerRetry(ctx, 0); err != nil {
		return err
	}
	m.setLease(lease)

	rev, err := m.resync(ctx)
	if err != nil {
		return err
	}
	if err := m.startLoops(ml, lease, rev); err != nil {
		return err
	}
	// Join after the lease is being kept alive: joining seeds whose records
	// outlived their nodes waits a TCP timeout for each, which could
	// otherwise outlast the lease TTL.
	if seeds := m.seeds(); len(seeds) > 0 {
		n, jerr := ml.Join(seeds)
		var reason string
		var refused bool
		if jerr != nil {
			reason, _, refused = refusal([]byte(jerr.Error()))
		}
		if refused && n == 0 {
			// Every seed answered in a way this node cannot read: its
			// gossip keys (or label) are not the mesh's. It stays
			// registered but no one will gossip with it.
			m.log.Error("gossip join refused", zap.String("reason", reason),
				zap.String("hint", "the keyring file (agent --gossip-keyring) must hold a key of the mesh's"),
				zap.Strings("seeds", seeds), zap.Error(jerr))
		} else if jerr != nil {
			// Records of crashed nodes linger until their leases expire;
			// anyone alive will find us through the watch or gossip.
			m.log.Warn("join seeds", zap.Strings("seeds", seeds), zap.Int("joined", n), zap.Error(jerr))
		} else {
			m.log.Info("joined", zap.Int("seeds", len(seeds)), zap.Int("joined", n))
		}
	}
	m.log.Info("started", zap.String("gossip_addr", m.Self().Record.GossipAddr), zap.Int64("lease", int64(lease)))
	return nil
}

// startLoops hands ml to the membership and starts its goroutines.
func (m *Membership) startLoops(ml *memberlist.Memberlist, lease clientv3.LeaseID, rev int64) error {
	m.lifeMu.Lock()
	defer m.lifeMu.Unlock()
	if m.closed {
		return ErrClosed
	}
	m.ml = ml
	m.wg.Add(4)
	go m.leaseLoop(lease)
	go m.watchLoop(rev)
	go m.metaLoop()
	go m.workLoop()
	if m.keyring != nil {
		m.wg.Add(1)
		go m.keyringLoop(m.keyringRaw)
	}
	return nil
}

// createMemberlist starts memberlist and records the address peers dial
// in the node record. With port 0, memberlist picks one free port for both
// TCP and UDP and writes it back into its config.
func (m *Membership) createMemberlist() (*memberlist.Memberlist, error) {
	conf := *m.cfg.Memberlist
	m.mu.Lock()
	conf.Name = m.self.ID
	m.mu.Unlock()
	bindIP, bindPort, _ := splitIPPort(m.cfg.GossipBind)
	conf.BindAddr, conf.BindPort = bindIP.String(), bindPort
	conf.AdvertiseAddr, conf.AdvertisePort = "", bindPort
	if m.cfg.GossipAdvertise != "" {
		ip, port, _ := splitIPPort(m.cfg.GossipAdvertise)
		conf.AdvertiseAddr = ip.String()
		if port != 0 {
			conf.AdvertisePort = port
		} else if bindPort == 0 {
			// memberlist overwrites AdvertisePort with the bound port
			// only when it had to pick the port itself.
			conf.AdvertisePort = 0
		}
	}
	d := &delegate{m: m}
	conf.Delegate, conf.Events, conf.Ping, conf.Alive = d, d, d, d
	conf.LogOutput = nil
	conf.Logger = log.New(m.logs, "", 0)
	// The label keeps meshes that share a network apart, and with a keyring
	// it is authenticated with every message, so a mesh's keys are good for
	// that mesh only.
	conf.Label = m.cfg.Prefix
	if m.keyring != nil {
		conf.Keyring = m.keyring
		conf.GossipVerifyIncoming = true // drop what is not encrypted with one of our keys
		conf.GossipVerifyOutgoing = true // and never send in clear
	}

	ml, err := memberlist.Create(&conf)
	if err != nil {
		return nil, fmt.Errorf("gossip: start memberlist on %s: %w", m.cfg.GossipBind, err)
	}
	local := ml.LocalNode()
	addr := net.JoinHostPort(local.Addr.String(), strconv.Itoa(int(local.Port)))
	m.mu.Lock()
	m.self.GossipAddr = addr
	m.mu.Unlock()
	return ml, nil
}

// Close leaves memberlist (bounded by LeaveTimeout), shuts it down, revokes
// the lease so the registration disappears at once, and stops every
// goroutine. It is idempotent and safe to call before or during Start.
func (m *Membership) Close() error {
	m.lifeMu.Lock()
	if m.closed {
		m.lifeMu.Unlock()
		<-m.done
		return nil
	}
	m.closed = true
	m.lifeMu.Unlock()

	m.cancel()
	m.wg.Wait()
	// Start has returned and no goroutine runs: m.ml is stable.
	if m.ml != nil {
		if err := m.ml.Leave(m.cfg.LeaveTimeout); err != nil {
			m.log.Warn("memberlist leave", zap.Error(err))
		}
		if err := m.ml.Shutdown(); err != nil {
			m.log.Warn("memberlist shutdown", zap.Error(err))
		}
	}
	m.logs.flush()
	if lease := m.Lease(); lease != 0 {
		m.revoke(lease)
		m.setLease(0)
	}
	m.mu.Lock()
	m.subsDone = true
	for s := range m.subs {
		delete(m.subs, s)
		close(s.ch)
	}
	m.mu.Unlock()
	close(m.done)
	m.log.Info("closed")
	return nil
}

// Done is closed when Close has finished.
func (m *Membership) Done() <-chan struct{} { return m.done }

// Lease is the lease this node's registration and claims live under; 0
// while there is none (before Start, while re-registering, after Close).
func (m *Membership) Lease() clientv3.LeaseID {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lease
}

// LeaseChanged returns a channel closed at the next change of Lease: when
// the lease is lost (Lease becomes 0) and when a new one is in place. Claims
// made under an earlier lease are void. Call it again after it fires.
func (m *Membership) LeaseChanged() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.leaseCh
}

// LeaseContact is when etcd last answered for this node's lease: granted
// it, or renewed it (every third of the lease TTL while etcd serves). Zero
// before the first registration. A keepalive is answered by etcd's leader,
// so a contact that grows old means this node cannot reach a leader.
func (m *Membership) LeaseContact() time.Time {
	if n := m.contact.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

func (m *Membership) touchLease() { m.contact.Store(time.Now().UnixNano()) }

func (m *Membership) setLease(l clientv3.LeaseID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.lease == l {
		return
	}
	m.lease = l
	m.gen++
	close(m.leaseCh)
	m.leaseCh = make(chan struct{})
}

// UpdateMeta sets the NodeMeta gossiped for this node. It returns at once;
// a background loop re-advertises through memberlist, and calls made while
// one update is in flight are coalesced so only the latest is sent. A zero
// Version is written as MetaVersion.
func (m *Membership) UpdateMeta(meta NodeMeta) error {
	if meta.Version == 0 {
		meta.Version = MetaVersion
	}
	b, err := EncodeMeta(meta)
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.meta = meta.clone()
	m.metaBytes = b
	m.gen++
	m.mu.Unlock()
	select {
	case m.metaKick <- struct{}{}:
	default: // an update is already pending and will read the latest bytes
	}
	return nil
}

// Self is this node as it presents itself: its record (with GossipAddr
// filled in by Start) and its current meta.
func (m *Membership) Self() Peer {
	m.mu.Lock()
	defer m.mu.Unlock()
	return Peer{
		Record:     m.self.clone(),
		Meta:       m.meta.clone(),
		Registered: m.lease != 0,
		Alive:      m.lease != 0,
	}
}

// Peers lists the registered nodes, this one included, ordered by id. The
// list is built once per change of the view and shared by every caller
// until the next (placement and admission read it on every decision, and
// copying every record each time was 7% of a busy agent's CPU): read it,
// never modify it or what it holds.
func (m *Membership) Peers() []Peer {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	if m.peers != nil && m.peersGen == m.gen && (m.peersUntil.IsZero() || now.Before(m.peersUntil)) {
		return m.peers
	}
	out := make([]Peer, 0, len(m.records))
	for id := range m.records {
		out = append(out, m.peerLocked(id))
	}
	slices.SortFunc(out, func(a, b Peer) int { return strings.Compare(a.Record.ID, b.Record.ID) })
	m.peers, m.peersGen, m.peersUntil = out, m.gen, time.Time{}
	for _, s := range m.members {
		if s.suspectUntil.After(now) && (m.peersUntil.IsZero() || s.suspectUntil.Before(m.peersUntil)) {
			m.peersUntil = s.suspectUntil // Suspect turns false then
		}
	}
	return out
}

// Peer reports one node by id. ok is false if neither etcd nor memberlist
// knows it; a node only memberlist knows has Registered false.
func (m *Membership) Peer(id string) (p Peer, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, inEtcd := m.records[id]
	_, inML := m.members[id]
	if !inEtcd && !inML {
		return Peer{}, false
	}
	return m.peerLocked(id), true
}

// ByPeerID reports the registered node whose record carries libp2p peer id
// pid: the mesh's notion of a member. It reads only etcd registrations
// (liveness does not matter) and costs a scan of them, no copies but the
// one record returned.
func (m *Membership) ByPeerID(pid string) (NodeRecord, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range m.records {
		if r.rec.PeerID == pid && pid != "" {
			return r.rec.clone(), true
		}
	}
	return NodeRecord{}, false
}

func (m *Membership) peerLocked(id string) Peer {
	var p Peer
	if r, ok := m.records[id]; ok {
		p.Record = r.rec.clone()
		p.Registered, p.Lease = true, r.lease
	} else {
		p.Record.ID = id
	}
	if s, ok := m.members[id]; ok {
		p.Meta, p.MetaAt = s.meta.clone(), s.metaAt
		p.Alive = s.alive
		p.Suspect = p.Alive && time.Now().Before(s.suspectUntil)
	}
	if id == m.self.ID {
		p.Meta, p.MetaAt = m.meta.clone(), time.Now()
		p.Alive, p.Suspect = true, false
	}
	return p
}

// seeds are the gossip addresses of registered nodes other than this one.
func (m *Membership) seeds() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for id, r := range m.records {
		if id != m.self.ID && r.rec.GossipAddr != "" {
			out = append(out, r.rec.GossipAddr)
		}
	}
	slices.Sort(out)
	return out
}

// metaLoop pushes meta updates into memberlist, one at a time.
func (m *Membership) metaLoop() {
	defer m.wg.Done()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-m.metaKick:
		}
		if err := m.ml.UpdateNode(m.cfg.UpdateTimeout); err != nil {
			// Peers get the new incarnation through gossip or push/pull.
			m.log.Debug("meta update broadcast", zap.Error(err))
		}
	}
}

// workLoop joins newly registered nodes and revokes dead peers' leases, off
// the watch and memberlist goroutines.
func (m *Membership) workLoop() {
	defer m.wg.Done()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-m.workKick:
		}
		m.mu.Lock()
		var addrs []string
		for id, addr := range m.joins {
			if s, ok := m.members[id]; !ok || !s.alive {
				addrs = append(addrs, addr)
			}
		}
		clear(m.joins)
		revokes := m.revokes
		m.revokes = make(map[clientv3.LeaseID]string)
		m.mu.Unlock()

		if len(addrs) > 0 {
			if n, err := m.ml.Join(addrs); err != nil {
				m.log.Debug("join registered nodes", zap.Strings("addrs", addrs), zap.Int("joined", n), zap.Error(err))
			}
		}
		for lease, id := range revokes {
			m.log.Info("revoking dead peer's lease", zap.String("peer", id), zap.Int64("lease", int64(lease)))
			m.revoke(lease)
		}
	}
}

func (m *Membership) kickWork() {
	select {
	case m.workKick <- struct{}{}:
	default:
	}
}
