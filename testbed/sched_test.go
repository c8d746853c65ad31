package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// schedAgent is a one-role agent of cl with slots and a simulated cost.
func schedAgent(cl *Cluster, id string, st jobs.Stage, slots int, edit func(*agent.Config)) agent.Config {
	ac := cl.cfg.Agent
	ac.NodeID, ac.Roles, ac.Logger = id, []jobs.Stage{st}, cl.cfg.Logger
	ac.Slots = map[jobs.Stage]int{st: slots}
	ac.TransferMode = jobs.P2P // a latent waiting for decode is then a payload its producer holds
	if edit != nil {
		edit(&ac)
	}
	return ac
}

// backlogWatch follows the latents waiting for decode: decode tasks
// (queued or running; each one's input is held by its producer until the
// decode commits) plus denoise tasks running (their outputs are being
// written). Tasks and claims come from etcd's history, in revision order;
// a denoise commit moves a latent from one to the other in one
// transaction. A denoise claim counts from when its worker started the
// task, not from when the claim was made: a claim pushed to a worker that
// waits for a slot or for admission holds no latent. Workers log each
// start ("task started") with fed_rev, a revision at which the decode
// queue held no more of the worker's outputs than its admission counted
// (jobs.Fed.Seen), and the start is placed at that revision: no later
// than it happened, so the backlog is never undercounted, and not before
// the count the worker's admission went by. The peak is
// worked out from the whole history once the run is over: exact, not
// sampled, and no etcd write of its own.
type backlogWatch struct {
	seen   atomic.Int64 // the last revision applied
	cancel context.CancelFunc
	done   chan struct{}
	starts *observer.ObservedLogs // the workers' "task started" entries

	mu     sync.Mutex // guards events
	events []backlogEvent
}

// backlogEvent is one change to a decode task or a denoise claim.
type backlogEvent struct {
	rev     int64
	key     string
	token   int64 // a claim's fencing token (its ModRevision, jobs.Claim.Rev); 0 on a delete
	claim   bool  // a denoise claim, else a decode task
	deleted bool
}

// startLog is a logger core that keeps the agents' "task started" entries
// (debug level) and nothing else, for watchBacklog: tee it to the
// cluster's logger.
func startLog() (zapcore.Core, *observer.ObservedLogs) {
	core, logs := observer.New(zap.DebugLevel)
	return onlyMessage{core, "task started"}, logs
}

// onlyMessage passes on to its core only the entries with message msg.
type onlyMessage struct {
	zapcore.Core
	msg string
}

func (c onlyMessage) With(fs []zapcore.Field) zapcore.Core {
	return onlyMessage{c.Core.With(fs), c.msg}
}

func (c onlyMessage) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if e.Message != c.msg {
		return ce
	}
	return c.Core.Check(e, ce)
}

func watchBacklog(t *testing.T, cli *clientv3.Client, starts *observer.ObservedLogs) *backlogWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := cli.Get(ctx, "/latentmesh/default/queues/decode/tasks/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || resp.Count != 0 {
		t.Fatalf("decode queue before the run: %v %v", resp, err)
	}
	w := &backlogWatch{cancel: cancel, done: make(chan struct{}), starts: starts}
	w.seen.Store(resp.Header.Revision)
	ch := cli.Watch(ctx, "/latentmesh/default/", clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1), clientv3.WithProgressNotify())
	go func() {
		defer close(w.done)
		for wr := range ch {
			w.mu.Lock()
			for _, ev := range wr.Events {
				k := string(ev.Kv.Key)
				claim := strings.HasPrefix(k, "/latentmesh/default/queues/denoise/claims/")
				if !claim && !strings.HasPrefix(k, "/latentmesh/default/queues/decode/tasks/") {
					continue
				}
				e := backlogEvent{rev: ev.Kv.ModRevision, key: k, claim: claim, deleted: ev.Type == clientv3.EventTypeDelete}
				if !e.deleted {
					e.token = ev.Kv.ModRevision
				}
				w.events = append(w.events, e)
			}
			w.mu.Unlock()
			w.seen.Store(wr.Header.Revision)
		}
	}()
	return w
}

// stop waits until the watch has applied everything up to now, ends it,
// and returns the peak of latents waiting for decode and how many denoise
// starts it placed, and of those how many were of pushed claims.
func (w *backlogWatch) stop(t *testing.T, cli *clientv3.Client) (peak int64, starts, pushed int) {
	t.Helper()
	resp, err := cli.Get(context.Background(), "/latentmesh/default/nodes/", clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		cli.RequestProgress(context.Background())
		if s := w.seen.Load(); s < resp.Header.Revision {
			return fmt.Errorf("watch at revision %d, want %d", s, resp.Header.Revision)
		}
		return nil
	})
	w.cancel()
	<-w.done
	return w.peak(t)
}

// peak replays the history: at each revision where a task or claim
// changed or a denoise started, it counts the decode tasks and the denoise
// claims whose task has started.
func (w *backlogWatch) peak(t *testing.T) (peak int64, starts, pushed int) {
	t.Helper()
	startAt := map[int64]int64{} // denoise claim token -> the revision its start is placed at
	moments := []int64{}
	for _, e := range w.starts.All() {
		f := e.ContextMap()
		if f["stage"] != string(jobs.Denoise) {
			continue
		}
		claim, okC := f["claim_rev"].(int64)
		at, okA := f["fed_rev"].(int64)
		if !okC || !okA || at == 0 {
			t.Fatalf("a denoise start logged without its revisions: %v", f)
		}
		if _, dup := startAt[claim]; dup {
			t.Fatalf("the denoise claim made at revision %d started twice", claim)
		}
		startAt[claim] = at
		moments = append(moments, at)
		if f["pushed"] == true {
			pushed++
		}
	}
	claimKeys := map[int64]string{} // denoise claim token -> its key: one claim per revision
	claimEnd := map[int64]int64{}   // denoise claim token -> the revision it went
	made := map[string]int64{}      // denoise claim key -> its token, while it lives
	for _, e := range w.events {
		moments = append(moments, e.rev)
		switch {
		case e.claim && e.deleted:
			claimEnd[made[e.key]] = e.rev
			delete(made, e.key)
		case e.claim:
			if k, ok := claimKeys[e.token]; ok && k != e.key {
				t.Fatalf("denoise claims %s and %s made at one revision %d", k, e.key, e.token)
			}
			if old, ok := made[e.key]; ok {
				claimEnd[old] = e.rev // handed over: that claim went as this one came
			}
			claimKeys[e.token], made[e.key] = e.key, e.token
		}
	}
	for claim, at := range startAt {
		if _, ok := claimKeys[claim]; !ok {
			t.Fatalf("a denoise started on a claim made at revision %d, which the watch never saw", claim)
		}
		if end, ok := claimEnd[claim]; ok && at >= end {
			t.Fatalf("a denoise start placed at revision %d, after its claim (made at %d) went at %d", at, claim, end)
		}
	}
	slices.Sort(moments)
	decode := map[string]bool{}
	claims := map[string]int64{} // denoise claim key -> its token
	i := 0
	for _, m := range slices.Compact(moments) {
		for ; i < len(w.events) && w.events[i].rev <= m; i++ {
			switch e := w.events[i]; {
			case e.claim && e.deleted:
				delete(claims, e.key)
			case e.claim:
				claims[e.key] = e.token
			case e.deleted:
				delete(decode, e.key)
			default:
				decode[e.key] = true
			}
		}
		n := int64(len(decode))
		for _, token := range claims {
			if at, ok := startAt[token]; ok && at <= m {
				n++
			}
		}
		peak = max(peak, n)
	}
	return peak, len(startAt), pushed
}

// runBackpressure runs jobs through 4 denoise agents (one slot each) into
// a decode pool 4x slower than them (one agent, two slots), and returns the
// peak of latents waiting for decode. Claims are pushed, as by default.
func runBackpressure(t *testing.T, jobsN int, off bool) (peak int64, credits, slack int) {
	starts, startLogs := startLog()
	backCore, backs := observer.New(zap.DebugLevel)
	givenBack := onlyMessage{backCore, "pushed claim given back"}
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), starts, givenBack))
		c.Agent.Admission.Off = off
		// Budget = decode credits 2 + slack 2 = 4, one per denoise agent:
		// every producer has a share (with fewer, the bound is one per
		// producer, routing.Admission.Quota). No share a producer: the
		// budget stays tight, so that the bound shows.
		c.Agent.Admission.Slack, c.Agent.Admission.PerProducer = 2, 0
		c.Agent.Engine.StepCost = 20 * time.Millisecond // 4 steps: 80 ms a denoise
	})
	const steps, decodeSlots = 4, 2
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 4, nil))
	for i := range 4 {
		addAgent(t, cl, schedAgent(cl, fmt.Sprintf("den-%d", i), jobs.Denoise, 1, nil))
	}
	// Pool rates: denoise 4 slots / 80 ms; decode 2 slots / 160 ms = a quarter.
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, decodeSlots, func(ac *agent.Config) {
		ac.Engine.DecodeCost = 160 * time.Millisecond
	}))
	entry := cl.Agents[0]
	// Every agent sees every other in gossip before the run.
	eventually(t, 10*time.Second, func() error {
		for _, a := range cl.Agents {
			st, err := a.Status(context.Background())
			if err != nil {
				return err
			}
			alive := 0
			for _, p := range st.Peers {
				if p.Alive {
					alive++
				}
			}
			if alive != len(cl.Agents) {
				return fmt.Errorf("%s sees %d of %d alive", a.ID(), alive, len(cl.Agents))
			}
		}
		return nil
	})
	w := watchBacklog(t, cl.Client, startLogs)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ids []string
	for i := range jobsN {
		spec := engine.Spec{Prompt: "a paper boat", Seed: int64(i), Width: 64, Height: 64, Steps: steps}.WithDefaults()
		j, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, j.ID)
	}
	for _, id := range ids {
		waitSucceeded(t, ctx, entry, id)
	}
	peak, started, pushed := w.stop(t, cl.Client)
	// A denoise agent held back by admission gossips no free slot, so few
	// pushes should land where they can only be given back (logged, not
	// asserted: it is gossip's timing).
	t.Logf("%d jobs: %d denoise starts, %d of them of pushed claims; %d pushed denoise claims given back",
		jobsN, started, pushed, backs.FilterField(zap.String("stage", string(jobs.Denoise))).Len())
	if started < jobsN || pushed == 0 {
		t.Fatalf("%d denoise starts placed for %d jobs, %d of pushed claims: want one a job at least, some pushed", started, jobsN, pushed)
	}
	slack = cl.cfg.Agent.Admission.Slack
	cl.Close() // before the next run: one mesh at a time on the test machine
	return peak, decodeSlots, slack
}

// Four denoise agents feed a decode pool four times slower than them. With
// backpressure the latents waiting for decode (decode queue + denoise
// outputs in flight) never pass the decode pool's credits plus the slack,
// however many denoise agents share that budget; without it they pile up
// with the length of the run.
func TestBackpressureManyProducers(t *testing.T) {
	peak, credits, slack := runBackpressure(t, 16, false)
	t.Logf("backpressure: peak %d latents waiting for decode over 16 jobs; bound credits %d + slack %d", peak, credits, slack)
	if peak > int64(credits+slack) {
		t.Fatalf("peak %d latents waiting for decode, want at most credits+slack = %d", peak, credits+slack)
	}
	short, _, _ := runBackpressure(t, 8, true)
	long, _, _ := runBackpressure(t, 16, true)
	t.Logf("no backpressure: peak %d over 8 jobs, %d over 16 jobs", short, long)
	if long <= short || long <= int64(credits+slack) {
		t.Fatalf("without backpressure the peak should grow with the run: %d over 8 jobs, %d over 16", short, long)
	}
}

// waitSucceeded waits for job id to succeed, riding out moments when a
// loaded test machine keeps etcd from answering the agent's alarm poll
// (the agent then refuses requests at once with ErrUnavailable).
func waitSucceeded(t *testing.T, ctx context.Context, a *agent.Agent, id string) jobs.Job {
	t.Helper()
	for {
		j, err := a.Wait(ctx, id)
		if errors.Is(err, jobs.ErrUnavailable) && ctx.Err() == nil {
			time.Sleep(200 * time.Millisecond)
			continue
		}
		if err != nil || j.State != jobs.Succeeded {
			t.Fatalf("job %s: %+v %v", id, j, err)
		}
		return j
	}
}

// latency is how long a finished job took, from submission to its last commit.
func latency(j jobs.Job) time.Duration { return j.UpdatedAt.Sub(j.CreatedAt) }

// runClassMix submits a backlog of batch jobs, then interactive ones, to a
// mesh with one denoise slot, and returns the interactive latencies.
func runClassMix(t *testing.T, sched routing.Scheduler) (interactive []time.Duration, unloaded time.Duration) {
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Agent.Queue.Scheduler = sched
		c.Agent.Queue.PreemptAfter = 0 // ordering alone; TestPreemptBatchForInteractive covers preemption
		c.Agent.Engine.StepCost = 20 * time.Millisecond
	})
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 4, nil))
	addAgent(t, cl, schedAgent(cl, "den", jobs.Denoise, 1, nil))
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 2, nil))
	entry := cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := func(i int) engine.Spec {
		return engine.Spec{Prompt: "a tin robot", Seed: int64(i), Width: 64, Height: 64, Steps: 4}.WithDefaults()
	}
	run := func(i int, class routing.Class) string {
		j, err := entry.Submit(ctx, spec(i), jobs.Options{Class: class})
		if err != nil {
			t.Fatal(err)
		}
		return j.ID
	}
	wait := func(id string) jobs.Job { return waitSucceeded(t, ctx, entry, id) }
	unloaded = latency(wait(run(0, routing.Interactive)))
	var batch, inter []string
	for i := range 8 {
		batch = append(batch, run(100+i, routing.Batch))
	}
	for i := range 3 {
		inter = append(inter, run(200+i, routing.Interactive))
	}
	for _, id := range inter {
		interactive = append(interactive, latency(wait(id)))
	}
	for _, id := range batch {
		wait(id)
	}
	return interactive, unloaded
}

// Under a backlog of batch jobs, class ordering with earliest deadline
// first serves interactive jobs ahead of the backlog; fifo serves them
// behind it.
func TestInteractiveBeatsFIFOUnderBatchBacklog(t *testing.T) {
	prio, unloadedP := runClassMix(t, routing.Priority)
	fifo, unloadedF := runClassMix(t, routing.FIFO)
	pmax, fmax := slices.Max(prio), slices.Max(fifo)
	t.Logf("interactive latency under an 8-job batch backlog: priority %v (max %v, unloaded %v), fifo %v (max %v, unloaded %v)",
		prio, pmax, unloadedP, fifo, fmax, unloadedF)
	if pmax >= fmax {
		t.Fatalf("priority's worst interactive latency %v is not below fifo's %v", pmax, fmax)
	}
}

// Earliest deadline first within a class, end to end: with the denoise
// slot busy, a later job with a nearer deadline overtakes earlier ones.
func TestDeadlineOrdersWithinClass(t *testing.T) {
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Agent.Engine.StepCost = 20 * time.Millisecond
		c.Agent.Admission.Slack = 3 // all three encoded before any denoise agent is there
	})
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 4, nil))
	den := schedAgent(cl, "den", jobs.Denoise, 1, nil)
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 2, nil))
	entry := cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var ids []string
	now := time.Now()
	for i, d := range []time.Duration{time.Hour, 50 * time.Minute, time.Minute} {
		spec := engine.Spec{Prompt: "a clock tower", Seed: int64(i), Width: 64, Height: 64, Steps: 4}.WithDefaults()
		j, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Standard, Deadline: now.Add(d)})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, j.ID)
	}
	for _, id := range ids { // all three encoded and waiting for denoise
		waitStage(t, entry, id, jobs.Denoise)
	}
	addAgent(t, cl, den)
	var done []jobs.Job
	for _, id := range ids {
		j := waitSucceeded(t, ctx, entry, id)
		if j.Deadline.IsZero() {
			t.Fatalf("job %s lost its deadline", id)
		}
		done = append(done, j)
	}
	order := func(j jobs.Job) time.Time { return j.Stages[jobs.Denoise].StartedAt }
	if !(order(done[2]).Before(order(done[1])) && order(done[1]).Before(order(done[0]))) {
		t.Fatalf("denoise starts %v, %v, %v: want the nearest deadline first", order(done[0]), order(done[1]), order(done[2]))
	}
}

// An interactive job kept waiting while both denoise agents run a batch job
// preempts one of them, not both: each agent decides alone from its queue
// view, and the policy matches the one waiting task with one batch task,
// the least aged. That task is requeued (fenced), the interactive job
// finishes before it, and both batch jobs finish once, with the same file as
// an uninterrupted run.
func TestPreemptBatchForInteractive(t *testing.T) {
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Agent.Queue.PreemptAfter = 300 * time.Millisecond
		c.Agent.Engine.StepCost = 250 * time.Millisecond // 8 steps: 2 s of batch denoise
	})
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 4, nil))
	// They lend no Store memory, so what they hold is their own stage
	// outputs (not copies of results).
	var dens []*agent.Agent
	for _, name := range []string{"den-1", "den-2"} {
		dens = append(dens, addAgent(t, cl, schedAgent(cl, name, jobs.Denoise, 1, func(ac *agent.Config) { ac.StoreMemory = 0 })))
	}
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 2, nil))
	entry := cl.Agents[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var batch []jobs.Job
	var specs []engine.Spec
	for k := range 2 {
		spec := engine.Spec{Prompt: "a long scroll", Seed: int64(7 + k), Width: 64, Height: 64, Steps: 8}.WithDefaults()
		b, err := entry.Submit(ctx, spec, jobs.Options{Class: routing.Batch})
		if err != nil {
			t.Fatal(err)
		}
		batch, specs = append(batch, b), append(specs, spec)
	}
	eventually(t, 30*time.Second, func() error {
		nodes := map[string]bool{}
		for _, b := range batch {
			j, err := entry.Get(ctx, b.ID)
			if err != nil {
				return err
			}
			if j.Progress == nil || j.Progress.Stage != jobs.Denoise || j.Progress.Step < 1 {
				return fmt.Errorf("batch job %s not denoising yet: %+v", b.ID, j.Progress)
			}
			nodes[j.Progress.Node] = true
		}
		if len(nodes) != 2 {
			return fmt.Errorf("both batch jobs denoise on %v", nodes)
		}
		return nil
	})
	i, err := entry.Submit(ctx, engine.Spec{Prompt: "a quick sketch", Seed: 8, Width: 64, Height: 64, Steps: 2}.WithDefaults(), jobs.Options{Class: routing.Interactive})
	if err != nil {
		t.Fatal(err)
	}
	ij := waitSucceeded(t, ctx, entry, i.ID)
	after := 0   // batch jobs that finished after the interactive one: the preempted one at least
	resumed := 0 // batch jobs whose denoise went on from where the preemption stopped it
	for k, b := range batch {
		bj := waitSucceeded(t, ctx, entry, b.ID)
		if ij.UpdatedAt.Before(bj.UpdatedAt) {
			after++
		}
		if bj.Stages[jobs.Denoise].ResumedFrom > 0 {
			resumed++
		}
		t.Logf("interactive latency %v while batch jobs held both slots; batch job %d %v (denoise attempt %d: pushed claims given back count too)",
			latency(ij), k, latency(bj), bj.Stages[jobs.Denoise].Attempt)
		data, _, err := entry.Result(ctx, b.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(data, referenceOutput(t, specs[k])) {
			t.Fatalf("batch job %d's file differs from an uninterrupted run", k)
		}
	}
	preempted := int64(0)
	for _, den := range dens {
		st, err := den.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		preempted += st.Preempted
	}
	if preempted != 1 {
		t.Fatalf("%d batch tasks preempted for one interactive task, want 1", preempted)
	}
	if after == 0 {
		t.Fatal("both batch jobs finished before the interactive one")
	}
	if resumed != 1 {
		t.Fatalf("%d batch jobs resumed from a checkpoint, want the preempted one", resumed)
	}
	// Every latent (a preempted attempt's and the committed ones) is freed:
	// the first at the requeue, the others once their decodes commit (the
	// release arrives by watch).
	eventually(t, 10*time.Second, func() error {
		for _, den := range dens {
			st, err := den.Status(ctx)
			if err != nil {
				return err
			}
			if st.Data.HeldPayloads != 0 {
				return fmt.Errorf("denoise agent holds %d payloads after every job", st.Data.HeldPayloads)
			}
		}
		return nil
	})
}

// Drain a denoise agent mid-job, by SIGTERM and by `latentmesh drain`: it
// stops pulling, /readyz turns 503, its running task is requeued once the
// drain timeout passes, the job finishes on the other denoise agent, and
// the drained agent deregisters and exits 0.
func TestDrainDenoiseAgentMidJob(t *testing.T) {
	for _, how := range []string{"sigterm", "cli"} {
		t.Run(how, func(t *testing.T) {
			m := startMesh(t)
			_, enc := m.agent("enc-d", "encode")
			m.agent("dec-d", "decode")
			slow, rec := m.agent("den-slow", "denoise", "--sim-cost", "step=5s", "--drain-timeout", "2s")

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			c := &httpapi.Client{BaseURL: "http://" + enc.HTTPAddr}
			w, h, steps := 64, 64, 4
			job, err := c.Submit(ctx, httpapi.JobRequest{Prompt: "a harbour at dusk", Width: &w, Height: &h, Steps: &steps})
			if err != nil {
				t.Fatal(err)
			}
			waitProgress(t, ctx, c, job.ID, func(p *jobs.Progress) bool { return p.Stage == jobs.Denoise && p.Node == "den-slow" })
			m.agent("den-fast", "denoise")

			switch how {
			case "sigterm":
				if err := slow.signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
			case "cli":
				out, err := exec.Command(binary, "drain", "--admin", "http://"+rec.AdminAddr, "--wait=false").CombinedOutput()
				if err != nil {
					t.Fatalf("latentmesh drain: %v\n%s", err, out)
				}
			}
			// Not ready while it drains (the 5 s step outlasts the 2 s drain timeout).
			eventually(t, 10*time.Second, func() error {
				resp, err := http.Get("http://" + rec.AdminAddr + "/readyz")
				if err != nil {
					if slow.exited() {
						return nil // already gone
					}
					return err
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusServiceUnavailable {
					return fmt.Errorf("/readyz %d while draining", resp.StatusCode)
				}
				return nil
			})
			select {
			case <-slow.done:
			case <-time.After(30 * time.Second):
				t.Fatalf("drained agent did not exit; output:\n%s", slow.Output())
			}
			if slow.err != nil {
				t.Fatalf("drained agent exited with %v; output:\n%s", slow.err, slow.Output())
			}
			if resp, err := m.cli.Get(ctx, "/latentmesh/default/nodes/den-slow"); err != nil || len(resp.Kvs) != 0 {
				t.Fatalf("drained agent still registered: %v %v", resp, err)
			}
			done := waitSucceededAt(t, ctx, c, job.ID)
			// The drain handed the denoise over at once, at a checkpoint of
			// the step it was in: the heir redid no step.
			if d := done.Stages[jobs.Denoise]; d.Node != "den-fast" || d.Attempt != 2 || d.ResumedFrom < 1 {
				t.Fatalf("denoise stage = %+v, want committed by den-fast on attempt 2, resumed from a checkpoint", d)
			}
			data, _, err := c.Result(ctx, job.ID)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(data, referenceOutput(t, done.Spec)) {
				t.Fatal("the handed-over job's file differs from an uninterrupted run")
			}
			m.checkResultOnce(ctx, done)
			if !strings.Contains(slow.Output(), "task requeued") {
				t.Fatalf("drained agent did not requeue its task; output:\n%s", slow.Output())
			}
		})
	}
}

// A task with no worker free when it is created waits for its dispatcher,
// which hands it to one worker: nobody races for it. Six idle denoise
// agents and pushes with the task off, so every task waits, one job at a
// time: every stage starts from a claim pushed to its worker, and no
// claim transaction is sent, won or lost.
func TestWaitingTasksAreNotRacedFor(t *testing.T) {
	const workers, jobsN = 6, 12
	cl := startCluster(t, "", func(c *ClusterConfig) {
		c.Agent.Queue.Push = false // every task waits for its dispatcher
		c.Agent.Engine.StepCost = 5 * time.Millisecond
	})
	addAgent(t, cl, schedAgent(cl, "enc", jobs.Encode, 1, nil))
	var dens []*agent.Agent
	for i := range workers {
		dens = append(dens, addAgent(t, cl, schedAgent(cl, fmt.Sprintf("den-%d", i), jobs.Denoise, 1, nil)))
	}
	addAgent(t, cl, schedAgent(cl, "dec", jobs.Decode, 1, nil))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range jobsN {
		spec := engine.Spec{Prompt: "a glass bird", Seed: int64(i), Width: 64, Height: 64, Steps: 2}.WithDefaults()
		j, err := cl.Agents[0].Submit(ctx, spec, jobs.Options{Class: routing.Standard})
		if err != nil {
			t.Fatal(err)
		}
		waitSucceeded(t, ctx, cl.Agents[0], j.ID)
	}
	var sum httpapi.ClaimCounts
	for _, a := range dens {
		sum = sum.Add(a.Claims()[jobs.Denoise])
	}
	t.Logf("%d denoise tasks among %d idle workers: %+v", jobsN, workers, sum)
	if sum.Txns != 0 || sum.Conflicts != 0 || sum.PushedStarted != jobsN || sum.GivenBack != 0 {
		t.Fatalf("%+v: want every denoise task pushed to one worker and started there, with no hand-on", sum)
	}
}
