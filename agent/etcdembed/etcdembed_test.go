package etcdembed

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
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
}
