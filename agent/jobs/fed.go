package jobs

import (
	"context"
	"encoding/json"
	"strings"
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
//     when the commit that created it answers (Created), before the commit
//     stops counting as in flight;
//   - the tasks that wait for a worker (Waiting): created with no worker
//     free, given back, or held by a claim whose lease ended. Nobody else
//     follows them: the dispatcher hands each to a worker (Store.Assign)
//     when one has a slot, and a free worker finds them by granting its
//     credit to the dispatchers gossip shows waiting.
//
// The tasks a node creates lie under its own key prefix (taskKey: one per
// class), which its ledger reads once and then watches: their rewrites (a
// claim, a give-back, an adoption by another node) and their deletions
// reach their creator and nobody else, and a job costs the ledger no watch
// of its own. A task it adopted from a node that left lies under that
// node's prefix, and is followed by a watch of its one key. A stage used
// to be followed whole by every worker of it, so every change of the
// denoise queue reached every denoise agent; then by a watch per task,
// three watch creations a job.
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
	prefixes []string            // of the tasks node creates, one per class (Store.fedPrefix)
	log      *zap.Logger
	wg       sync.WaitGroup // the watches of adopted tasks

	mu sync.Mutex
	// mu guards the fields below.
	live map[string]*followed // by task key
	// ended are deletions under this node's prefixes of tasks the ledger
	// did not count (yet): a task whose stage was done before its
	// creating commit's answer came back is not counted after it.
	ended   map[string]ended
	pruned  time.Time // when ended was last pruned
	closed  bool      // Run is waiting for the watches: start no more
	synced  bool      // the tasks fed before this process started are read
	readRev int64     // the revision of the last read of this node's prefixes; their watches follow from it
	seen    int64     // see Seen
	changed changes   // a task added, rewritten or gone; a read landed
}

// ended is a deletion the ledger saw of a task it did not count.
type ended struct {
	rev int64
	at  time.Time
}

// endedKeep is how long a deletion of a task the ledger did not count is
// remembered: far longer than a commit takes to answer.
const endedKeep = time.Minute

// followed is a task the ledger follows.
type followed struct {
	stop     context.CancelFunc // ends its watch (an adopted task's; nil: under this node's prefix)
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
// with ctx; Run reads and follows them. consumed (nil: none) is called,
// outside the ledger's lock, with the worker a task was pushed to once
// that task is gone.
func (s *Store) NewFed(ctx context.Context, stage Stage, node string, consumed func(worker string)) *Fed {
	f := &Fed{s: s, ctx: ctx, stage: stage, node: node, consumed: consumed, log: s.log.With(zap.String("fed", string(stage))),
		live: map[string]*followed{}, ended: map[string]ended{}}
	for _, c := range routing.Classes() {
		f.prefixes = append(f.prefixes, s.fedPrefix(stage, c, node))
	}
	return f
}

// Run reads the tasks node fed before this process started (a restart
// keeps its share counted, and dispatches what waits), then follows its
// prefixes until the ledger's context ends; it reads them again when etcd
// compacted a watch's history away.
func (f *Fed) Run() {
	defer func() {
		f.mu.Lock()
		f.closed = true
		f.mu.Unlock()
		f.wg.Wait()
	}()
	first := true
	backoff := 50 * time.Millisecond
	for f.ctx.Err() == nil {
		rev, err := f.load(first)
		if err != nil {
			f.log.Warn("reading the tasks this node fed failed; retrying", zap.Duration("backoff", backoff), zap.Error(err))
			sleepCtx(f.ctx, backoff)
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		first, backoff = false, 50*time.Millisecond
		f.watch(rev)
	}
}

// own reports whether key lies under this node's prefixes.
func (f *Fed) own(key string) bool {
	for _, p := range f.prefixes {
		if strings.HasPrefix(key, p) {
			return true
		}
	}
	return false
}

// load reads the tasks under this node's prefixes at one revision and
// makes the ledger's view of them that read: counted tasks the read lacks
// (and that the ledger knew of by then) are gone. The first load also
// reads the whole stage once, for tasks this node adopted (under another
// node's prefix) or created before keys named their creator.
func (f *Fed) load(first bool) (int64, error) {
	var tasks []Task
	var rev int64
	for _, p := range f.prefixes {
		ts, r, err := f.s.readTasks(f.ctx, p, rev)
		if err != nil {
			return 0, err
		}
		tasks, rev = append(tasks, ts...), r
	}
	var others []Task
	if first {
		all, _, err := f.s.readTasks(f.ctx, f.s.taskPrefix(f.stage), rev)
		if err != nil {
			return 0, err
		}
		for _, t := range all {
			if !f.own(t.Key) && f.dispatches(&t) {
				others = append(others, t)
			}
		}
	}
	var credits []string
	f.mu.Lock()
	read := map[string]bool{}
	for _, t := range tasks {
		read[t.Key] = true
		if !f.dispatches(&t) {
			continue // adopted by another node
		}
		if e, ok := f.live[t.Key]; ok {
			e.task = t
		} else {
			f.live[t.Key] = &followed{task: t}
		}
	}
	for key, e := range f.live {
		if f.own(key) && !read[key] && e.task.Rev <= rev {
			delete(f.live, key)
			if e.pushedTo != "" {
				credits = append(credits, e.pushedTo)
			}
		}
	}
	for _, t := range others {
		f.followLocked(t, rev, "")
	}
	f.readRev, f.synced = rev, true
	f.seen = max(f.seen, rev)
	f.changed.notify()
	f.mu.Unlock()
	f.returnCredits(credits)
	return rev, nil
}

// watch follows this node's prefixes from revision rev+1 until the
// ledger's context ends, or etcd compacted a watch's history away (the
// caller reads them again).
func (f *Fed) watch(rev int64) {
	ctx, cancel := context.WithCancel(f.ctx)
	defer cancel()
	compacted := make(chan struct{}, len(f.prefixes))
	var wg sync.WaitGroup
	for _, prefix := range f.prefixes {
		wg.Go(func() {
			if f.watchFrom(ctx, prefix, true, rev+1) {
				compacted <- struct{}{}
			}
		})
	}
	select {
	case <-compacted:
		f.log.Info("ledger watch compacted; reading this node's tasks again")
	case <-ctx.Done():
	}
	cancel()
	wg.Wait()
}

// watchFrom applies the watch of key (of every key under it when prefix)
// from revision next until ctx ends (false) or etcd compacted that
// revision away (true): a deletion ends a task (gone), a put rewrites one.
// A watch that breaks (leader loss) resumes after the last revision seen.
func (f *Fed) watchFrom(ctx context.Context, key string, prefix bool, next int64) (compacted bool) {
	for ctx.Err() == nil {
		opts := []clientv3.OpOption{clientv3.WithRev(next)}
		if prefix {
			opts = append(opts, clientv3.WithPrefix())
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range f.s.cli.Watch(wctx, key, opts...) {
			if wr.CompactRevision > 0 {
				cancel()
				return true
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					f.gone(string(ev.Kv.Key), ev.Kv.ModRevision, true)
					continue
				}
				f.rewritten(string(ev.Kv.Key), ev.Kv)
			}
			if wr.Header.Revision > 0 {
				next = max(next, wr.Header.Revision+1)
			}
		}
		cancel()
		sleepCtx(ctx, 200*time.Millisecond)
	}
	return false
}

// dispatches reports whether t is this ledger's (a task written before
// Task.Dispatcher existed goes by its producer).
func (f *Fed) dispatches(t *Task) bool {
	return t.Dispatcher == f.node || (t.Dispatcher == "" && t.Producer() == f.node)
}

// Created counts task t, which a commit or submit of this node created at
// revision t.Rev (with its claim pushed to t.Holder, if any), unless the
// ledger has seen it end already.
func (f *Fed) Created(t Task) { f.add(t, t.Rev, t.Holder) }

// Add follows task t, which this node adopted (under another node's
// prefix), from revision t.Rev until it goes (t.Rev 0: t's content is
// not known, and etcd is asked first).
func (f *Fed) Add(t Task) { f.add(t, t.Rev, "") }

// add counts task t (its Key at least), which existed at revision rev (0:
// a write with no answer may have created it) and was pushed to pushedTo,
// until it goes.
func (f *Fed) add(t Task, rev int64, pushedTo string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.own(t.Key) {
		f.followLocked(t, rev, pushedTo)
		return
	}
	if rev == 0 || f.closed {
		return // its watch counts it if it was written
	}
	f.seen = max(f.seen, rev)
	if e, ok := f.live[t.Key]; ok {
		if e.pushedTo == "" {
			e.pushedTo = pushedTo
		}
		return // its watch was first
	}
	if end, ok := f.ended[t.Key]; ok && end.rev >= rev {
		return // its stage was done before its creation answered
	}
	if f.synced && rev <= f.readRev {
		return // the read since would have counted it: it has ended
	}
	t.Rev = rev
	f.live[t.Key] = &followed{pushedTo: pushedTo, task: t}
	f.changed.notify() // a task to dispatch, maybe
}

// followLocked follows task t, under another node's prefix, by a watch of
// its one key from revision rev (0: not known to exist, so etcd is asked
// first).
func (f *Fed) followLocked(t Task, rev int64, pushedTo string) {
	if _, ok := f.live[t.Key]; ok || f.closed {
		return
	}
	f.seen = max(f.seen, rev)
	ctx, cancel := context.WithCancel(f.ctx)
	f.live[t.Key] = &followed{stop: cancel, pushedTo: pushedTo, task: t}
	f.wg.Go(func() { f.follow(ctx, t.Key, rev) })
	f.changed.notify() // a task to dispatch, maybe
}

// Count is how many of the tasks this node fed are not gone, and Synced
// whether those fed before this process started are among them.
func (f *Fed) Count() (n int, synced bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.live), f.synced
}

// Seen is a revision at which the stage held at most Count of this node's
// tasks: the newest of the commits added, the reads and the deletions
// seen, so every task counted was created by then and every deletion
// counted happened by then. (A deletion not seen yet only makes Count
// larger than the truth.)
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
	return f.changed.wait()
}

// gone forgets the task at key, deleted (credit) or adopted by another
// node by revision rev, and returns the credit of the worker this node
// pushed it to. The deletion of a task under this node's prefix is
// remembered a while (ended), for a creation whose answer comes later.
func (f *Fed) gone(key string, rev int64, credit bool) {
	f.mu.Lock()
	t, ok := f.live[key]
	if ok {
		if t.stop != nil {
			t.stop()
		}
		delete(f.live, key)
		f.seen = max(f.seen, rev)
		f.changed.notify()
	}
	if credit && f.own(key) {
		now := time.Now()
		if now.Sub(f.pruned) > endedKeep/4 {
			for k, e := range f.ended {
				if now.Sub(e.at) > endedKeep {
					delete(f.ended, k)
				}
			}
			f.pruned = now
		}
		f.ended[key] = ended{rev: rev, at: now}
	}
	// The slot the task held is free unless another of this ledger's
	// tasks is pushed to the same worker: that one takes it next.
	queued := false
	if ok && credit && t.pushedTo != "" {
		for _, e := range f.live {
			if e.pushedTo == t.pushedTo {
				queued = true
				break
			}
		}
	}
	f.mu.Unlock()
	if ok && credit && t.pushedTo != "" && !queued {
		f.returnCredits([]string{t.pushedTo})
	}
}

// returnCredits tells the consumed hook of each worker a gone task was
// pushed to.
func (f *Fed) returnCredits(workers []string) {
	if f.consumed == nil {
		return
	}
	for _, w := range workers {
		f.consumed(w)
	}
}

// rewritten takes a new write of the task at key: a claim, a give-back, an
// adoption by another node (which ends this ledger's part), or, under this
// node's prefix, a task it created that the ledger had not counted yet.
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
	e, ok := f.live[key]
	switch {
	case ok && e.task.Rev <= t.Rev:
		e.task, e.refused, e.backoff = t, time.Time{}, 0
		f.changed.notify()
	case !ok && f.own(key) && !f.closed:
		// Its watch before its creation's answer (or a write with no
		// answer): a push's claim holder is the worker it was pushed to.
		e := &followed{task: t}
		if kv.CreateRevision == kv.ModRevision {
			e.pushedTo = t.Holder
		}
		f.live[key] = e
		f.seen = max(f.seen, t.Rev)
		f.changed.notify()
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

// WaitingCount counts the tasks that wait, at no etcd read, as
// WaitingByClass does.
func (f *Fed) WaitingCount(live func(node string, lease int64) bool) int {
	n := 0
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range f.live {
		if waits(&e.task, live) {
			n++
		}
	}
	return n
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

// follow follows the task at key (an adopted task, under another node's
// prefix), which existed at rev (0: not known to), until it goes: its
// deletion, or a rewrite that names another dispatcher, ends ctx (gone).
// It reads the task first at rev 0, and again after a compaction (history
// gone, or etcd replaced).
func (f *Fed) follow(ctx context.Context, key string, rev int64) {
	next, check := rev+1, rev == 0
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
			next = resp.Header.Revision + 1
		}
		check = f.watchFrom(ctx, key, false, next)
	}
}
