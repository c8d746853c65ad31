package jobs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/latentmesh/latentmesh/agent/etcdembed"
)

// eventually retries cond with backoff until it returns nil or timeout passes.
func eventually(t *testing.T, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	backoff := 20 * time.Millisecond
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not true after %v: %v", timeout, err)
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

// startSmallEtcd starts an embedded etcd whose database is full after about
// a dozen 1 MiB puts.
func startSmallEtcd(t *testing.T) (*etcdembed.Server, *clientv3.Client) {
	t.Helper()
	cfg := etcdembed.DefaultConfig()
	cfg.QuotaBackendBytes = 16 << 20
	srv, err := etcdembed.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zaptest.NewLogger(t).Named("etcdclient")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return srv, cli
}

// runWatcher runs w until the test ends.
func runWatcher(t *testing.T, w *AlarmWatcher) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		w.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
}

func TestAlarmWatcherNoSpaceAndRecovery(t *testing.T) {
	_, cli := startSmallEtcd(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Polls are rare: only Observe's kick can report the alarm in time.
	w := NewAlarmWatcher(cli, time.Hour, zaptest.NewLogger(t))
	runWatcher(t, w)
	if err := w.NoSpace(); err != nil {
		t.Fatalf("fresh etcd: NoSpace = %v", err)
	}

	value := strings.Repeat("x", 1<<20)
	var putErr error
	var fillers int
	for ; fillers < 40 && putErr == nil; fillers++ {
		_, putErr = cli.Put(ctx, fmt.Sprintf("filler/%d", fillers), value)
	}
	if !IsNoSpace(putErr) {
		t.Fatalf("after %d puts of 1 MiB under a 16 MiB quota: %v, want NOSPACE", fillers, putErr)
	}
	w.Observe(putErr)
	if err := w.NoSpace(); !errors.Is(err, ErrNoSpace) || !strings.Contains(err.Error(), "etcdctl alarm disarm") {
		t.Fatalf("right after Observe: NoSpace = %v, want ErrNoSpace saying how to recover", err)
	}
	// The kicked poll confirms it and names the member.
	var member uint64
	eventually(t, 10*time.Second, func() error {
		if err := w.NoSpace(); err == nil || !strings.Contains(err.Error(), "alarm raised on member") {
			return fmt.Errorf("NoSpace = %v, want it confirmed by a poll", err)
		}
		resp, err := cli.AlarmList(ctx)
		if err != nil || len(resp.Alarms) != 1 || resp.Alarms[0].Alarm != etcdserverpb.AlarmType_NOSPACE {
			return fmt.Errorf("alarms = %v, %v", resp, err)
		}
		member = resp.Alarms[0].MemberID
		return nil
	})
	if want := fmt.Sprintf("member %x", member); !strings.Contains(w.NoSpace().Error(), want) {
		t.Fatalf("NoSpace = %v, want it to name %s", w.NoSpace(), want)
	}

	// The operator's recovery: free space, compact, defragment, disarm.
	del, err := cli.Delete(ctx, "filler/", clientv3.WithPrefix())
	if err != nil {
		t.Fatalf("delete under NOSPACE: %v", err)
	}
	if _, err := cli.Compact(ctx, del.Header.Revision, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Defragment(ctx, cli.Endpoints()[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.AlarmDisarm(ctx, &clientv3.AlarmMember{MemberID: member, Alarm: etcdserverpb.AlarmType_NOSPACE}); err != nil {
		t.Fatal(err)
	}
	// Only a poll clears it; a foreign error does not kick one.
	w.Observe(errors.New("some other write error"))
	if w.NoSpace() == nil {
		t.Fatal("NoSpace cleared without a poll")
	}
	w.kick <- struct{}{} // stands in for the next tick
	eventually(t, 10*time.Second, func() error { return w.NoSpace() })
	if _, err := cli.Put(ctx, "after", "recovery"); err != nil {
		t.Fatalf("put after recovery: %v", err)
	}
}

func TestAlarmWatcherKeepsStateWhenEtcdUnreachable(t *testing.T) {
	srv, cli := startSmallEtcd(t)
	core, logs := observer.New(zap.WarnLevel)
	w := NewAlarmWatcher(cli, 10*time.Millisecond, zap.New(core))
	srv.Close() // every poll now fails
	w.Observe(rpctypes.ErrGRPCNoSpace)
	if !errors.Is(w.NoSpace(), ErrNoSpace) {
		t.Fatalf("NoSpace after Observe(%v) = %v", rpctypes.ErrGRPCNoSpace, w.NoSpace())
	}
	runWatcher(t, w)

	failed := func() int { return logs.FilterMessage("cannot read etcd alarms; keeping the last state").Len() }
	eventually(t, 10*time.Second, func() error {
		if failed() == 0 {
			return errors.New("no poll failed yet")
		}
		return nil
	})
	// Several more polls fail within the minute; none of them is logged.
	eventually(t, 10*time.Second, func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.errsSkipped < 2 {
			return fmt.Errorf("%d failed polls not logged, want 2", w.errsSkipped)
		}
		return nil
	})
	if n := failed(); n != 1 {
		t.Fatalf("poll failures logged %d times within a minute, want once", n)
	}
	if !errors.Is(w.NoSpace(), ErrNoSpace) {
		t.Fatalf("NoSpace after failed polls = %v, want the last state kept", w.NoSpace())
	}
}

func TestIsNoSpace(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{rpctypes.ErrNoSpace, true},
		{rpctypes.ErrGRPCNoSpace, true},
		{fmt.Errorf("jobs: submit: %w", rpctypes.ErrNoSpace), true},
		{errors.New("commit: rpc error: code = ResourceExhausted desc = etcdserver: mvcc: database space exceeded"), true},
		{ErrNoSpace, true},
		{rpctypes.ErrRequestTooLarge, false},
		{context.DeadlineExceeded, false},
	} {
		if got := IsNoSpace(c.err); got != c.want {
			t.Errorf("IsNoSpace(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// countingMaintenance counts alarm lists: each is a raft proposal.
type countingMaintenance struct {
	clientv3.Maintenance
	lists atomic.Int64
}

func (m *countingMaintenance) AlarmList(ctx context.Context) (*clientv3.AlarmResponse, error) {
	m.lists.Add(1)
	return m.Maintenance.AlarmList(ctx)
}

// An idle agent's watcher asks etcd nothing: the alarm is read only after a
// write was refused, and then until it clears.
func TestAlarmWatcherPollsOnlyAfterRefusal(t *testing.T) {
	_, cli := startSmallEtcd(t)
	m := &countingMaintenance{Maintenance: cli.Maintenance}
	cli.Maintenance = m
	w := NewAlarmWatcher(cli, 10*time.Millisecond, zaptest.NewLogger(t))
	runWatcher(t, w)
	time.Sleep(300 * time.Millisecond) // thirty poll periods
	if n := m.lists.Load(); n != 0 {
		t.Fatalf("an idle watcher read the alarms %d times, want 0", n)
	}
	w.Observe(rpctypes.ErrGRPCNoSpace) // no alarm is raised: the poll clears it
	eventually(t, 10*time.Second, func() error { return w.NoSpace() })
	after := m.lists.Load()
	if after == 0 {
		t.Fatal("a refused write did not make the watcher read the alarms")
	}
	time.Sleep(300 * time.Millisecond)
	if n := m.lists.Load(); n != after {
		t.Fatalf("the watcher kept reading the alarms once they cleared: %d more", n-after)
	}
}
