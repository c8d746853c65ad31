package jobs

import (
	"context"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Fed is a producer's ledger of the tasks its commits created in the next
// stage that are not gone yet (their stage committed, or the job was
// cancelled, failed or rewound): its share of that stage's backlog, which
// admission bounds (routing.Admission). Each task is followed by a watch
// of its one key, which sees its deletion and nothing else: one event, to
// its producer. A producer used to follow the whole next queue to count
// them, so every change of the decode queue reached every denoise agent.
//
// The count may run ahead of etcd (a deletion is counted once its event
// arrives), never behind it: a task is added when the commit that created
// it answers, before the commit stops counting as in flight.
//
// The same event returns a credit: a task pushed to a worker is gone once
// that worker committed it (or the job ended), so its slot is free, and
// the producer learns it as soon as any grant the worker could send.
type Fed struct {
	s        *Store
	ctx      context.Context // the watches end with it
	stage    Stage
	node     string
	consumed func(worker string) // see NewFed
	log      *zap.Logger
	wg       sync.WaitGroup // the watches

	mu sync.Mutex
	// mu guards the fields below.
	live    map[string]followed // by task key
	closed  bool                // Run is waiting for the watches: start no more
	synced  bool                // the tasks fed before this process started are read
	seen    int64               // see Seen
	changed chan struct{}       // closed (and replaced) when a task goes or the read lands
}

// followed is a task the ledger follows.
type followed struct {
	stop     context.CancelFunc // ends its watch
	pushedTo string             // the worker its claim was pushed to ("": none, or not known)
}

// NewFed returns the ledger of node's tasks in stage, whose watches end
// with ctx; Run reads the tasks an earlier incarnation fed. consumed (nil:
// none) is called, outside the ledger's lock, with the worker a task was
// pushed to once that task is gone.
func (s *Store) NewFed(ctx context.Context, stage Stage, node string, consumed func(worker string)) *Fed {
	return &Fed{s: s, ctx: ctx, stage: stage, node: node, consumed: consumed, log: s.log.With(zap.String("fed", string(stage))), live: map[string]followed{}, changed: make(chan struct{})}
}

// Run reads, once, the tasks of the stage that node fed before this process
// started (a restart keeps its share counted), then waits for the ledger's
// context to end and its watches with it.
func (f *Fed) Run() {
	defer func() {
		f.mu.Lock()
		f.closed = true
		f.mu.Unlock()
		f.wg.Wait()
	}()
	backoff := 50 * time.Millisecond
	for f.ctx.Err() == nil {
		tasks, _, rev, err := f.s.readQueue(f.ctx, f.stage)
		if err != nil {
			f.log.Warn("reading the tasks this node fed failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
			sleepCtx(f.ctx, backoff)
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		f.mu.Lock()
		for _, t := range tasks {
			if t.Producer() == f.node {
				f.addLocked(t.Key, rev, "")
			}
		}
		f.synced = true
		f.seen = max(f.seen, rev)
		f.notifyLocked()
		f.mu.Unlock()
		break
	}
	<-f.ctx.Done()
}

// add counts the task at key, created by this node's commit at revision
// rev (0: a commit with no answer may have created it; it is counted if
// etcd has it) and pushed to pushedTo, until it goes. The agent adds
// through Expect; a watch Expect could not make falls back to this.
func (f *Fed) add(key string, rev int64, pushedTo string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen = max(f.seen, rev)
	f.addLocked(key, rev, pushedTo)
}

// addLocked follows the task at key, which existed at revision rev (0:
// not known to exist) and was pushed to pushedTo.
func (f *Fed) addLocked(key string, rev int64, pushedTo string) {
	if _, ok := f.live[key]; ok || f.closed {
		return
	}
	ctx, cancel := context.WithCancel(f.ctx)
	f.live[key] = followed{stop: cancel, pushedTo: pushedTo}
	f.wg.Go(func() { f.follow(ctx, key, rev) })
}

// Count is how many of the tasks this node fed are not gone, and Synced
// whether those fed before this process started are among them.
func (f *Fed) Count() (n int, synced bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.live), f.synced
}

// Seen is a revision at which the stage held at most Count of this node's
// tasks: the newest of the commits added and the deletions seen, so every
// task counted was created by then and every deletion counted happened by
// then. (A deletion not seen yet only makes Count larger than the truth.)
func (f *Fed) Seen() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.seen
}

// Changed returns a channel closed when a task counted goes. Take it before
// Count, so that a change in between is not missed.
func (f *Fed) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *Fed) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

// gone forgets the task at key, deleted by revision rev, and returns the
// credit of the worker it was pushed to.
func (f *Fed) gone(key string, rev int64) {
	f.mu.Lock()
	t, ok := f.live[key]
	if ok {
		t.stop()
		delete(f.live, key)
		f.seen = max(f.seen, rev)
		f.notifyLocked()
	}
	f.mu.Unlock()
	if ok && t.pushedTo != "" && f.consumed != nil {
		f.consumed(t.pushedTo)
	}
}

// Expected is a task the ledger follows from before the commit that
// creates it (Expect). etcd serves a watch that starts at its current
// revision at once, but one asked to start at a revision it has passed
// waits for its catch-up loop, which runs every 100 ms: a downstream task
// done within that time held its producer's admission that long (bench
// api, 64 clients: 213-225 jobs/s against 363-370 with the view).
type Expected struct {
	f        *Fed
	key      string
	pushedTo string
	ctx      context.Context
	cancel   context.CancelFunc
	made     chan struct{} // closed once wch is set
	wch      clientv3.WatchChan
}

// Expect asks etcd to watch key, the key of the task a commit is about to
// create, its claim pushed to pushedTo ("": none); it waits for nothing
// (Created does): the client's Watch call itself can wait as long as etcd
// is silent.
func (f *Fed) Expect(key, pushedTo string) *Expected {
	ctx, cancel := context.WithCancel(f.ctx)
	e := &Expected{f: f, key: key, pushedTo: pushedTo, ctx: ctx, cancel: cancel, made: make(chan struct{})}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		cancel() // Created finds no watch and falls back to add, which starts none either
		return e
	}
	f.wg.Go(func() {
		e.wch = f.s.cli.Watch(clientv3.WithRequireLeader(ctx), key, clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
		close(e.made)
	})
	return e
}

// Created counts the task, which the commit created at revision rev. The
// watch Expect asked for sees every change after the revision its creation
// answer names: when that is rev or before, it sees the task's end; when
// etcd made it after the commit (its goroutine ran late), the task's end
// may have come in between, and etcd is asked once whether the task is
// still there.
func (e *Expected) Created(rev int64) { e.keep(rev) }

// Maybe counts the task if etcd has it: the commit got no answer.
func (e *Expected) Maybe() { e.keep(0) }

// Drop stops following: the commit did not create the task.
func (e *Expected) Drop() { e.cancel() }

// keep hands the watch to the ledger, for a task that existed at rev (0:
// not known to exist, so etcd is asked first). Without a watch made within
// a second the task is followed as add does.
func (e *Expected) keep(rev int64) {
	f := e.f
	made, late := false, false
	t := time.NewTimer(time.Second)
	select {
	case <-e.made:
		select {
		case wr, ok := <-e.wch:
			made = ok && wr.Created && wr.Err() == nil
			late = wr.Header.Revision > rev
		case <-t.C:
		}
	case <-e.ctx.Done(): // the ledger is closing
	case <-t.C:
	}
	t.Stop()
	if !made {
		e.cancel()
		f.add(e.key, rev, e.pushedTo)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen = max(f.seen, rev)
	if _, ok := f.live[e.key]; ok || f.closed {
		e.cancel()
		return
	}
	f.live[e.key] = followed{stop: e.cancel, pushedTo: e.pushedTo}
	f.wg.Go(func() { f.followFrom(e.ctx, e.key, rev, e.wch, late) })
}

// follow waits for the deletion of the task at key, which existed at rev.
// A watch that breaks resumes after the last revision seen; one answered
// with a compaction (history gone, or etcd replaced) asks etcd whether the
// task is still there.
func (f *Fed) follow(ctx context.Context, key string, rev int64) {
	f.followFrom(ctx, key, rev, nil, rev == 0)
}

// followFrom is follow, reading wch, a watch of key already made, first;
// check asks etcd first whether the task is there (rev 0: not known to
// have been).
func (f *Fed) followFrom(ctx context.Context, key string, rev int64, wch clientv3.WatchChan, check bool) {
	next := rev + 1
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		if check {
			resp, err := f.s.cli.Get(ctx, key, clientv3.WithCountOnly())
			switch {
			case err != nil:
				sleepCtx(ctx, backoff)
				backoff = min(2*backoff, 2*time.Second)
				continue
			case resp.Count == 0:
				f.gone(key, resp.Header.Revision)
				return
			}
			next, check = resp.Header.Revision+1, false
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		if wch == nil {
			wch = f.s.cli.Watch(wctx, key, clientv3.WithRev(next), clientv3.WithFilterPut())
		}
		compacted := false
		for wr := range wch {
			if wr.CompactRevision > 0 {
				compacted = true
				break
			}
			if len(wr.Events) > 0 {
				cancel()
				f.gone(key, wr.Events[0].Kv.ModRevision)
				return
			}
			if wr.Header.Revision > 0 {
				next = max(next, wr.Header.Revision+1)
			}
		}
		cancel()
		wch = nil
		if compacted {
			check = true
			continue
		}
		sleepCtx(ctx, 200*time.Millisecond) // a broken watch (leader loss): resume shortly
	}
}
