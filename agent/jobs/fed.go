package jobs

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/routing"
)

// Fed is a dispatcher's ledger of the tasks of one stage it dispatches
// (Task.Dispatcher: those its commits, submissions or rewinds created, and
// those it adopted) that are not gone yet (their stage committed, or the
// job was cancelled, failed or rewound). It is two things:
//   - the producer's share of that stage's backlog, which admission bounds
//     (routing.Admission). The count may run ahead of etcd (a deletion is
//     counted once its event arrives), never behind it: a task is added
//     when the commit that created it answers, before the commit stops
//     counting as in flight;
//   - the tasks that wait for a worker (Waiting): created with no worker
//     free, given back, or held by a claim whose lease ended. Nobody else
//     follows them: the dispatcher hands each to a worker (Store.Assign)
//     when one has a slot, and a free worker finds them by granting its
//     credit to the dispatchers gossip shows waiting.
//
// Each task is followed by a watch of its one key: its rewrites (a
// give-back, an adoption by another node) and its deletion reach its
// dispatcher and nobody else. A stage used to be followed whole by every
// worker of it, so every change of the denoise queue reached every
// denoise agent.
//
// The deletion returns a credit: a task pushed to a worker is gone once
// that worker committed it (or the job ended), so its slot is free, and
// the dispatcher learns it as soon as any grant the worker could send.
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
	live    map[string]*followed // by task key
	closed  bool                 // Run is waiting for the watches: start no more
	synced  bool                 // the tasks fed before this process started are read
	seen    int64                // see Seen
	changed chan struct{}        // closed (and replaced) when a task goes or the read lands
}

// followed is a task the ledger follows.
type followed struct {
	stop     context.CancelFunc // ends its watch
	pushedTo string             // the worker this node pushed its claim to ("": none, or not known)
	// task is the task as last written, as far as the ledger knows: its Key
	// always, its content (ID set) once a write of it has been seen or
	// read, and its Holder and HolderLease from the push that created it.
	task Task
	// refused is set when handing the task on was refused while the
	// ledger saw no change (a claim whose holder looks gone is still
	// there, until its lease ends): Waiting skips it until then, or until
	// the task is rewritten.
	refused time.Time
	backoff time.Duration
}

// NewFed returns the ledger of node's tasks in stage, whose watches end
// with ctx; Run reads the tasks an earlier incarnation fed. consumed (nil:
// none) is called, outside the ledger's lock, with the worker a task was
// pushed to once that task is gone.
func (s *Store) NewFed(ctx context.Context, stage Stage, node string, consumed func(worker string)) *Fed {
	return &Fed{s: s, ctx: ctx, stage: stage, node: node, consumed: consumed, log: s.log.With(zap.String("fed", string(stage))), live: map[string]*followed{}, changed: make(chan struct{})}
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
		tasks, rev, err := f.s.readQueue(f.ctx, f.stage)
		if err != nil {
			f.log.Warn("reading the tasks this node fed failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
			sleepCtx(f.ctx, backoff)
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		f.mu.Lock()
		for _, t := range tasks {
			if f.dispatches(&t) {
				f.addLocked(t, rev, "")
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

// dispatches reports whether t is this ledger's (a task written before
// Task.Dispatcher existed goes by its producer).
func (f *Fed) dispatches(t *Task) bool {
	return t.Dispatcher == f.node || (t.Dispatcher == "" && t.Producer() == f.node)
}

// Add follows task t, written at revision t.Rev, until it goes: a task
// this node submitted or adopted (t.Rev 0, or t's content unknown: a
// submit that got no answer; etcd is asked first).
func (f *Fed) Add(t Task) { f.add(t, t.Rev, "") }

// add counts task t (its Key at least), which existed at revision rev (0:
// a commit with no answer may have created it; it is counted if etcd has
// it) and was pushed to pushedTo, until it goes. The agent adds through
// Expect; a watch Expect could not make falls back to this.
func (f *Fed) add(t Task, rev int64, pushedTo string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen = max(f.seen, rev)
	f.addLocked(t, rev, pushedTo)
}

// addLocked follows task t, which existed at revision rev (0: not known
// to exist) and was pushed to pushedTo.
func (f *Fed) addLocked(t Task, rev int64, pushedTo string) {
	if _, ok := f.live[t.Key]; ok || f.closed {
		return
	}
	ctx, cancel := context.WithCancel(f.ctx)
	f.live[t.Key] = &followed{stop: cancel, pushedTo: pushedTo, task: t}
	f.wg.Go(func() { f.follow(ctx, t.Key, rev) })
	f.notifyLocked() // a task to dispatch, maybe
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

// Changed returns a channel closed when a task is added, rewritten or goes.
// Take it before Count or Waiting, so that a change in between is not
// missed.
func (f *Fed) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *Fed) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

// gone forgets the task at key, deleted (or adopted by another node) by
// revision rev, and returns the credit of the worker this node pushed it
// to.
func (f *Fed) gone(key string, rev int64, credit bool) {
	f.mu.Lock()
	t, ok := f.live[key]
	if ok {
		t.stop()
		delete(f.live, key)
		f.seen = max(f.seen, rev)
		f.notifyLocked()
	}
	f.mu.Unlock()
	if ok && credit && t.pushedTo != "" && f.consumed != nil {
		f.consumed(t.pushedTo)
	}
}

// rewritten takes a new write of the task at key: a claim, a give-back, or
// an adoption by another node, which ends this ledger's part.
func (f *Fed) rewritten(key string, kv *mvccpb.KeyValue) {
	var t Task
	if err := json.Unmarshal(kv.Value, &t); err != nil || t.ID == "" {
		f.log.Warn("undecodable task", zap.String("key", key), zap.Error(err))
		return
	}
	t.Key, t.Rev, t.Seen = key, kv.ModRevision, time.Now()
	if !f.dispatches(&t) {
		f.gone(key, kv.ModRevision, false)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if e, ok := f.live[key]; ok && e.task.Rev <= t.Rev {
		e.task, e.refused, e.backoff = t, time.Time{}, 0
		f.notifyLocked()
	}
}

// Refused records that handing t on was refused though the ledger saw no
// change: Waiting skips it for a while (doubling, up to 10 s), or until
// the task is rewritten.
func (f *Fed) Refused(t Task) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if e, ok := f.live[t.Key]; ok && e.task.Rev == t.Rev {
		e.backoff = min(max(2*e.backoff, 250*time.Millisecond), 10*time.Second)
		e.refused = time.Now().Add(e.backoff)
	}
}

// Waiting returns the tasks of the ledger that wait for a worker: held by
// no claim, or by one whose holder live no longer shows on that lease
// (its claim key went with it; Store.Assign checks). A task whose content
// the ledger has not seen (created with no answer, or by a push whose
// holder then went) is read once.
func (f *Fed) Waiting(ctx context.Context, live func(node string, lease int64) bool) []Task {
	var out []Task
	var unknown []string
	now := time.Now()
	f.mu.Lock()
	for key, e := range f.live {
		t := e.task
		if !waits(&t, live) || now.Before(e.refused) {
			continue
		}
		if t.ID == "" {
			unknown = append(unknown, key)
			continue
		}
		out = append(out, t)
	}
	f.mu.Unlock()
	for _, key := range unknown {
		t, err := f.s.readTask(ctx, key)
		if err != nil {
			continue // gone (its watch says so soon), or etcd failed: the next look tries again
		}
		t.Seen = time.Now()
		f.mu.Lock()
		if e, ok := f.live[key]; ok && e.task.Rev <= t.Rev {
			e.task = t
		}
		f.mu.Unlock()
		if waits(&t, live) {
			out = append(out, t)
		}
	}
	return out
}

// WaitingByClass counts the tasks that wait, by class, at no etcd read
// (a task whose content the ledger has not seen counts as its zero class;
// one whose hand-on was just refused counts too).
func (f *Fed) WaitingByClass(live func(node string, lease int64) bool) map[routing.Class]int {
	out := map[routing.Class]int{}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range f.live {
		if waits(&e.task, live) {
			out[e.task.Class]++
		}
	}
	return out
}

// waits reports whether t waits for a worker: no claim holds it, or its
// holder's claim no longer stands as live tells (node, lease).
func waits(t *Task, live func(node string, lease int64) bool) bool {
	return t.Holder == "" || !live(t.Holder, t.HolderLease)
}

// Assigned records that this node claimed t for worker (Store.Assign, at
// revision t.Rev): its credit comes back when t goes.
func (f *Fed) Assigned(t Task, worker string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if e, ok := f.live[t.Key]; ok && e.task.Rev <= t.Rev {
		e.task, e.pushedTo = t, worker
	}
}

// Expected is a task the ledger follows from before the commit that
// creates it (Expect). etcd serves a watch that starts at its current
// revision at once, but one asked to start at a revision it has passed
// waits for its catch-up loop, which runs every 100 ms: a downstream task
// done within that time held its producer's admission that long (bench
// api, 64 clients: 213-225 jobs/s against 363-370 with the view).
type Expected struct {
	f      *Fed
	task   Task   // the task the commit writes: its Key, and its holder if pushed
	pushed string // the worker its claim is pushed to ("": none)
	ctx    context.Context
	cancel context.CancelFunc
	made   chan struct{} // closed once wch is set
	wch    clientv3.WatchChan
}

// Expect asks etcd to watch key, the key of the task a commit is about to
// create, its claim pushed to push (nil: none); it waits for nothing
// (Created does): the client's Watch call itself can wait as long as etcd
// is silent.
func (f *Fed) Expect(key string, push *Push) *Expected {
	ctx, cancel := context.WithCancel(f.ctx)
	e := &Expected{f: f, task: Task{Key: key}, ctx: ctx, cancel: cancel, made: make(chan struct{})}
	if push != nil {
		e.pushed, e.task.Holder, e.task.HolderLease = push.Node, push.Node, int64(push.Lease)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		cancel() // Created finds no watch and falls back to add, which starts none either
		return e
	}
	f.wg.Go(func() {
		e.wch = f.s.cli.Watch(clientv3.WithRequireLeader(ctx), key, clientv3.WithCreatedNotify())
		close(e.made)
	})
	return e
}

// Created counts task t, which the commit created at revision t.Rev (the
// commit's Claim.Next). The watch Expect asked for sees every change after
// the revision its creation answer names: when that is t.Rev or before, it
// sees the task's end; when etcd made it after the commit (its goroutine
// ran late), the task's end may have come in between, and etcd is asked
// once whether the task is still there.
func (e *Expected) Created(t Task) {
	e.task = t
	e.keep(t.Rev)
}

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
		f.add(e.task, rev, e.pushed)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seen = max(f.seen, rev)
	if _, ok := f.live[e.task.Key]; ok || f.closed {
		e.cancel()
		return
	}
	f.live[e.task.Key] = &followed{stop: e.cancel, pushedTo: e.pushed, task: e.task}
	f.wg.Go(func() { f.followFrom(e.ctx, e.task.Key, rev, e.wch, late) })
	f.notifyLocked() // a task to dispatch, maybe
}

// follow follows the task at key, which existed at rev, until its
// deletion: its rewrites update the ledger (rewritten). A watch that
// breaks resumes after the last revision seen; one answered with a
// compaction (history gone, or etcd replaced) reads the task again.
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
			resp, err := f.s.cli.Get(ctx, key)
			switch {
			case err != nil:
				sleepCtx(ctx, backoff)
				backoff = min(2*backoff, 2*time.Second)
				continue
			case len(resp.Kvs) == 0:
				f.gone(key, resp.Header.Revision, true)
				return
			}
			f.rewritten(key, resp.Kvs[0])
			next, check = resp.Header.Revision+1, false
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		if wch == nil {
			wch = f.s.cli.Watch(wctx, key, clientv3.WithRev(next))
		}
		compacted := false
		for wr := range wch {
			if wr.CompactRevision > 0 {
				compacted = true
				break
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					cancel()
					f.gone(key, ev.Kv.ModRevision, true)
					return
				}
				f.rewritten(key, ev.Kv)
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
