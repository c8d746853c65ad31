package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/agent/httpapi"
	"github.com/latentmesh/latentmesh/agent/jobs"
)

// answer is one HTTP exchange of TestQuorumLossAnsweredAtOnce: when it was
// sent (from the kill), how long it took, what came back.
type answer struct {
	what       string
	at, took   time.Duration
	status     int
	retryAfter string
	body       []byte
}

func (a answer) String() string {
	return fmt.Sprintf("%s at %v: %d after %v (Retry-After %q) %s", a.what, a.at.Round(time.Millisecond),
		a.status, a.took.Round(time.Millisecond), a.retryAfter, bytes.TrimSpace(a.body[:min(len(a.body), 300)]))
}

// answers collects the exchanges of the goroutines that hit the API during
// the outage.
type answers struct {
	mu  sync.Mutex // guards all
	all []answer
}

func (as *answers) add(a answer) {
	as.mu.Lock()
	as.all = append(as.all, a)
	as.mu.Unlock()
}

// of returns the exchanges named what, sent at or after from.
func (as *answers) of(what string, from time.Duration) []answer {
	as.mu.Lock()
	defer as.mu.Unlock()
	var out []answer
	for _, a := range as.all {
		if a.what == what && a.at >= from {
			out = append(out, a)
		}
	}
	return out
}

// slowest is the longest of as, and how many there are.
func slowest(as []answer) (time.Duration, int) {
	var d time.Duration
	for _, a := range as {
		d = max(d, a.took)
	}
	return d, len(as)
}

// The quorum loss as clients see it: two of three etcd members
// (the leader among them) killed for 30 s under client traffic, the
// agents in-process on the real cluster, etcd 3.4 with its default flags.
// Every submission sent 2 s or more after the kill is refused with 503 and
// Retry-After within 1 s; a finished job's record and file are served
// throughout; a long poll of the running job returns within its wait plus
// 1 s; nothing is a 500. The job that ran through the outage commits after
// it on its first attempt, and the agents accept work again.
func TestQuorumLossAnsweredAtOnce(t *testing.T) {
	etcd := startEtcdCluster(t, "")
	obs, logs := observer.New(zap.InfoLevel)
	cl := startCluster(t, Disaggregated, func(c *ClusterConfig) {
		c.EtcdEndpoints = etcd.Endpoints()
		c.Logger = zap.New(zapcore.NewTee(c.Logger.Core(), obs))
		c.Agent.Engine.StepCost = 200 * time.Millisecond
	})
	var apis []string
	for _, a := range cl.Agents {
		apis = append(apis, "http://"+a.HTTPAddr())
	}
	hc := &http.Client{Timeout: 20 * time.Second} // a hung answer fails the test, not CI
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	submit := func(api, body string) jobs.Job {
		t.Helper()
		code, b := post(t, api+"/v1/jobs", body)
		if code != http.StatusAccepted {
			t.Fatalf("submit: %d %s", code, b)
		}
		var j jobs.Job
		if err := json.Unmarshal(b, &j); err != nil {
			t.Fatal(err)
		}
		return j
	}
	waitDone := func(api, id string) jobs.Job {
		t.Helper()
		var j jobs.Job
		eventually(t, time.Minute, func() error {
			if code, body, _ := getJSON(t, api+"/v1/jobs/"+id+"?wait=10s", &j); code != http.StatusOK || !j.State.Terminal() {
				return fmt.Errorf("job %s: %d %s", id, code, body)
			}
			return nil
		})
		return j
	}
	// A finished job, and its file as every agent serves it before the outage.
	done := submit(apis[0], `{"prompt":"finished before the outage","steps":2,"width":64,"height":64}`)
	if j := waitDone(apis[0], done.ID); j.State != jobs.Succeeded {
		t.Fatalf("job before the outage ended %s: %+v", j.State, j.Error)
	}
	resp, err := hc.Get(apis[0] + "/v1/jobs/" + done.ID + "/result")
	if err != nil {
		t.Fatal(err)
	}
	file, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || len(file) == 0 {
		t.Fatalf("result before the outage: %d %s", resp.StatusCode, file)
	}
	// A job running through the outage: 30 denoise steps of 200 ms, cut a
	// few steps in, so that its denoise ends and waits to commit meanwhile.
	running := submit(apis[0], `{"prompt":"running through the outage","steps":30,"width":64,"height":64}`)
	waitDenoiseStep(t, ctx, cl.Agents[0], running.ID, func(step int) bool { return step >= 3 })

	leader, err := etcd.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	down := []int{leader, (leader + 1) % etcd.Len()}
	for _, i := range down {
		etcd.Kill(i)
	}
	killed := time.Now()
	restarted := false
	defer func() {
		if !restarted {
			for _, i := range down {
				etcd.Restart(i)
			}
		}
	}()
	t.Logf("killed etcd members %v (leader %d)", down, leader)

	const outage = 30 * time.Second
	var got answers
	exchange := func(what, method, url, body string) answer {
		start := time.Now()
		req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
		if err != nil {
			panic(err) // a test bug: the URL is ours
		}
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		a := answer{what: what, at: start.Sub(killed)}
		resp, err := hc.Do(req)
		a.took = time.Since(start)
		if err != nil {
			t.Errorf("%s: %v", a, err)
			return a
		}
		a.body, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		a.status, a.retryAfter = resp.StatusCode, resp.Header.Get("Retry-After")
		if a.status >= 500 && a.status != http.StatusServiceUnavailable {
			t.Errorf("%s", a) // an outage is a 503, never a 500
		}
		got.add(a)
		return a
	}
	// Three clients side by side until the outage ends, each round robin
	// over the agents; the pauses are pacing, not synchronization.
	var wg sync.WaitGroup
	for client := range 3 {
		wg.Go(func() {
			for i := 0; time.Since(killed) < outage-time.Second; i++ {
				api := apis[i%len(apis)]
				switch client {
				case 0:
					exchange("submit", http.MethodPost, api+"/v1/jobs", `{"prompt":"during the outage","steps":2,"width":64,"height":64}`)
					time.Sleep(250 * time.Millisecond)
				case 1:
					exchange("get finished", http.MethodGet, api+"/v1/jobs/"+done.ID, "")
					if i%4 == 0 {
						if a := exchange("result", http.MethodGet, api+"/v1/jobs/"+done.ID+"/result", ""); a.status == http.StatusOK && !bytes.Equal(a.body, file) {
							t.Errorf("result at %v differs from the one before the outage", a.at.Round(time.Millisecond))
						}
						exchange("wait finished", http.MethodGet, api+"/v1/jobs/"+done.ID+"?wait=5s", "")
					}
					time.Sleep(250 * time.Millisecond)
				case 2:
					if a := exchange("wait running", http.MethodGet, api+"/v1/jobs/"+running.ID+"?wait=5s", ""); a.took < time.Second {
						time.Sleep(250 * time.Millisecond) // refused at once: retry as a client would
					}
				}
			}
		})
	}
	wg.Go(func() { // when each agent's /readyz turns 503
		for _, a := range cl.Agents {
			for time.Since(killed) < outage {
				code, _, _ := getJSON(t, "http://"+a.AdminAddr()+"/readyz", nil)
				if code == http.StatusServiceUnavailable {
					t.Logf("%s: /readyz 503 %v after the kill", a.ID(), time.Since(killed).Round(time.Millisecond))
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	})
	wg.Wait()
	if d := outage - time.Since(killed); d > 0 {
		time.Sleep(d) // the outage is the 30 s
	}
	for _, i := range down {
		if err := etcd.Restart(i); err != nil {
			t.Fatal(err)
		}
	}
	restarted = true
	back := time.Now()
	t.Logf("etcd quorum lost for %v", back.Sub(killed).Round(time.Millisecond))

	// When each agent knew: its health signal's first word of the outage.
	for _, e := range logs.FilterMessage("etcd unreachable: refusing submissions until it answers").All() {
		if d := e.Time.Sub(killed); d > 0 && d < outage {
			t.Logf("%v after the kill %v knew etcd unreachable: %v", d.Round(time.Millisecond), e.ContextMap()["node"], e.ContextMap()["error"])
		}
	}
	// Every submission from 2 s on: 503 with Retry-After within 1 s, naming etcd.
	for _, a := range got.of("submit", 0) {
		if a.at < 2*time.Second {
			t.Logf("early %s", a)
			continue
		}
		if a.status != http.StatusServiceUnavailable || a.retryAfter == "" || a.took > time.Second ||
			!strings.Contains(string(a.body), httpapi.CodeUnavailable) || !strings.Contains(string(a.body), "etcd") {
			t.Errorf("%s: want 503 with Retry-After within 1 s", a)
		}
	}
	// The finished job, its file and a long poll of it: served throughout.
	for _, what := range []string{"get finished", "result", "wait finished"} {
		for _, a := range got.of(what, 0) {
			if a.status != http.StatusOK {
				t.Errorf("%s: want 200", a)
				continue
			}
			var j jobs.Job
			if what != "result" && (json.Unmarshal(a.body, &j) != nil || j.State != jobs.Succeeded) {
				t.Errorf("%s: want the job succeeded", a)
			}
		}
	}
	// The long polls of the running job: within 6 s, with the job as last
	// known, or 503.
	for _, a := range got.of("wait running", 0) {
		var j jobs.Job
		switch {
		case a.took > 6*time.Second:
			t.Errorf("%s: want an answer within the wait plus 1 s", a)
		case a.status == http.StatusOK && (json.Unmarshal(a.body, &j) != nil || j.State.Terminal()):
			t.Errorf("%s: want the job as last known, not finished", a)
		case a.status != http.StatusOK && a.status != http.StatusServiceUnavailable:
			t.Errorf("%s: want 200 or 503", a)
		}
	}
	for _, what := range []string{"submit", "get finished", "result", "wait finished", "wait running"} {
		early, n := slowest(got.of(what, 0))
		late, m := slowest(got.of(what, 2*time.Second))
		t.Logf("%-13s %3d sent, slowest %v; %3d sent 2 s or more after the kill, slowest %v",
			what, n, early.Round(time.Millisecond), m, late.Round(time.Millisecond))
	}
	if len(got.of("submit", 2*time.Second)) == 0 || len(got.of("wait running", 0)) == 0 || len(got.of("result", 2*time.Second)) == 0 {
		t.Fatal("the outage saw too few requests to tell")
	}

	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	err = etcd.WaitHealthy(wctx)
	wcancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("etcd healthy %v after the restart", time.Since(back).Round(time.Millisecond))
	// Every agent takes work again once etcd answers: at most a probe
	// period after the cluster serves.
	for _, api := range apis {
		var after jobs.Job
		start := time.Now()
		eventually(t, 10*time.Second, func() error {
			code, b := post(t, api+"/v1/jobs", `{"prompt":"after the outage","steps":2,"width":64,"height":64}`)
			if code != http.StatusAccepted {
				return fmt.Errorf("submit after the outage: %d %s", code, b)
			}
			return json.Unmarshal(b, &after)
		})
		t.Logf("%s accepts again %v after etcd served", api, time.Since(start).Round(time.Millisecond))
		if j := waitDone(api, after.ID); j.State != jobs.Succeeded {
			t.Fatalf("job after the outage ended %s: %+v", j.State, j.Error)
		}
	}
	// The work in flight committed: the denoise that ended during the
	// outage was not run again.
	j := waitDone(apis[0], running.ID)
	if j.State != jobs.Succeeded {
		t.Fatalf("the job running through the outage ended %s: %+v", j.State, j.Error)
	}
	for _, st := range jobs.Stages() {
		if s := j.Stages[st]; s == nil || s.Attempt != 1 {
			t.Errorf("%s stage %+v: want committed by its first attempt", st, s)
		}
	}
	if logs.FilterMessage("commit failed; keeping the output and retrying").Len() == 0 {
		t.Error("no commit waited for etcd: the denoise did not end during the outage")
	}
	if n := logs.FilterMessage("registered under new lease").Len(); n != 0 {
		t.Errorf("%d agents lost their lease in the outage", n)
	}
}
