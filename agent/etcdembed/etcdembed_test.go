package etcdembed

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
)

func TestStartServesClients(t *testing.T) {
	ctx := context.Background()
	a, err := Start(ctx, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	// A second server must not collide with the first (tests run several).
	b, err := Start(ctx, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()

	cli, err := clientv3.New(clientv3.Config{Endpoints: a.Endpoints(), DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("get = %v, %v", resp, err)
	}
	if a.Endpoints()[0] == b.Endpoints()[0] {
		t.Fatalf("two servers share endpoint %s", a.Endpoints()[0])
	}

	// Each write is one raft entry, committed by the time its client has
	// the answer (and applied then or a moment later), and b's index is
	// its own.
	before, _ := a.RaftIndex()
	other, _ := b.RaftIndex()
	for i := range 3 {
		if _, err := cli.Put(ctx, "k", fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
	}
	if committed, _ := a.RaftIndex(); committed != before+3 {
		t.Errorf("after 3 writes: committed index %d, want %d", committed, before+3)
	}
	eventually(t, 5*time.Second, func() error {
		if committed, applied := a.RaftIndex(); applied != committed {
			return fmt.Errorf("applied index %d, committed %d", applied, committed)
		}
		return nil
	})
	if now, _ := b.RaftIndex(); now != other {
		t.Errorf("the other server's committed index moved from %d to %d", other, now)
	}
}

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

func TestQuotaRaisesNoSpace(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := DefaultConfig()
	cfg.QuotaBackendBytes = 16 << 20
	srv, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	// Every put is a new revision kept in the history, so the database grows
	// by at least a value a put until it passes the quota.
	value := strings.Repeat("x", 1<<20)
	var puts int
	for ; puts < 40; puts++ {
		if _, err = cli.Put(ctx, "filler", value); err != nil {
			break
		}
	}
	if !errors.Is(err, rpctypes.ErrNoSpace) || !strings.Contains(err.Error(), "mvcc: database space exceeded") {
		t.Fatalf("after %d puts of 1 MiB under a 16 MiB quota: %v, want %v", puts, err, rpctypes.ErrNoSpace)
	}
	if puts < 2 {
		t.Fatalf("NOSPACE after %d puts: the quota should have held a few", puts)
	}
	alarms, err := cli.AlarmList(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(alarms.Alarms) != 1 || alarms.Alarms[0].Alarm != etcdserverpb.AlarmType_NOSPACE {
		t.Fatalf("alarms = %v, want one NOSPACE", alarms.Alarms)
	}
	// Deletes still work under the alarm: that is how an operator recovers.
	if _, err := cli.Delete(ctx, "filler"); err != nil {
		t.Fatalf("delete under NOSPACE: %v", err)
	}
	t.Logf("NOSPACE after %d puts of 1 MiB", puts)
}

func TestPeriodicCompaction(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := DefaultConfig()
	cfg.CompactionRetention = time.Second
	srv, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 5 * time.Second, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	first, err := cli.Put(ctx, "k", "1")
	if err != nil {
		t.Fatal(err)
	}
	// The compactor compacts at revisions it sampled a retention ago, so
	// keep writing until the first revision is gone.
	eventually(t, 15*time.Second, func() error {
		if _, err := cli.Put(ctx, "k", "again"); err != nil {
			return err
		}
		_, err := cli.Get(ctx, "k", clientv3.WithRev(first.Header.Revision))
		if errors.Is(err, rpctypes.ErrCompacted) {
			return nil
		}
		return fmt.Errorf("revision %d still readable (err %v)", first.Header.Revision, err)
	})
}
