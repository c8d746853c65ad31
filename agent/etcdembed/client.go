package etcdembed

import (
	"context"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3rpc"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter"
	"google.golang.org/grpc"
)

// Observer sees every unary request an in-process client makes (KV,
// lease and maintenance calls; not watches or keepalive streams): its
// gRPC method name (e.g. "/etcdserverpb.KV/Txn"), request, response and
// error. Benchmarks count etcd's work with it, as an interceptor does for
// a gRPC client.
type Observer func(method string, req, resp any, err error)

// Client returns a client of this server that calls its request handlers
// directly, as etcd's own v3client does: no socket, no gRPC encoding, for
// agents running in this process (`latentmesh-dev dev`, the testbed, the
// benchmarks). Measured on the development machine, a put answers in
// about half the time of one over loopback gRPC and a get in an eighth.
// It is the same server: quotas, auth, leases and watches behave as they
// do for a remote client. Defragment is not served in process (etcd's
// handler needs the gRPC server's health reporting): an operator
// defragments over gRPC, with etcdctl. obs, if not nil, sees every unary
// request. Close the client before the server; its Close reports
// context.Canceled, having no connection to close.
func (s *Server) Client(obs Observer) *clientv3.Client {
	srv := s.etcd.Server
	c := clientv3.NewCtxClient(context.Background(), clientv3.WithZapLogger(srv.Logger()))
	var kv pb.KVClient = adapter.KvServerToKvClient(v3rpc.NewQuotaKVServer(srv))
	var lease pb.LeaseClient = adapter.LeaseServerToLeaseClient(v3rpc.NewQuotaLeaseServer(srv))
	var mnt pb.MaintenanceClient = adapter.MaintenanceServerToMaintenanceClient(v3rpc.NewMaintenanceServer(srv, nil))
	if obs != nil {
		kv, lease, mnt = observedKV{kv, obs}, observedLease{lease, obs}, observedMaintenance{mnt, obs}
	}
	c.KV = clientv3.NewKVFromKVClient(kv, c)
	// One second is clientv3's marker for "the default first keepalive
	// timeout", which the in-process client of etcd uses too.
	c.Lease = clientv3.NewLeaseFromLeaseClient(lease, c, time.Second)
	c.Watcher = blankWatcher{clientv3.NewWatchFromWatchClient(queuedWatchClient{adapter.WatchServerToWatchClient(v3rpc.NewWatchServer(srv))}, c)}
	c.Maintenance = clientv3.NewMaintenanceFromMaintenanceClient(mnt, c)
	c.Cluster = clientv3.NewClusterFromClusterClient(adapter.ClusterServerToClusterClient(v3rpc.NewClusterServer(srv)), c)
	c.Auth = clientv3.NewAuthFromAuthClient(adapter.AuthServerToAuthClient(v3rpc.NewAuthServer(srv)), c)
	return c
}

// blankWatcher hands the watch server a context whose String does not read
// its values: the server formats it, and values set by other goroutines
// would be a data race (etcd's v3client does the same).
type blankWatcher struct{ clientv3.Watcher }

type blankContext struct{ context.Context }

func (blankContext) String() string { return "(blankCtx)" }

func (w blankWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	return w.Watcher.Watch(blankContext{ctx}, key, opts...)
}

type observedKV struct {
	pb.KVClient
	obs Observer
}

func (o observedKV) Range(ctx context.Context, in *pb.RangeRequest, opts ...grpc.CallOption) (*pb.RangeResponse, error) {
	r, err := o.KVClient.Range(ctx, in, opts...)
	o.obs("/etcdserverpb.KV/Range", in, r, err)
	return r, err
}

func (o observedKV) Put(ctx context.Context, in *pb.PutRequest, opts ...grpc.CallOption) (*pb.PutResponse, error) {
	r, err := o.KVClient.Put(ctx, in, opts...)
	o.obs("/etcdserverpb.KV/Put", in, r, err)
	return r, err
}

func (o observedKV) DeleteRange(ctx context.Context, in *pb.DeleteRangeRequest, opts ...grpc.CallOption) (*pb.DeleteRangeResponse, error) {
	r, err := o.KVClient.DeleteRange(ctx, in, opts...)
	o.obs("/etcdserverpb.KV/DeleteRange", in, r, err)
	return r, err
}

func (o observedKV) Txn(ctx context.Context, in *pb.TxnRequest, opts ...grpc.CallOption) (*pb.TxnResponse, error) {
	r, err := o.KVClient.Txn(ctx, in, opts...)
	o.obs("/etcdserverpb.KV/Txn", in, r, err)
	return r, err
}

func (o observedKV) Compact(ctx context.Context, in *pb.CompactionRequest, opts ...grpc.CallOption) (*pb.CompactionResponse, error) {
	r, err := o.KVClient.Compact(ctx, in, opts...)
	o.obs("/etcdserverpb.KV/Compact", in, r, err)
	return r, err
}

type observedLease struct {
	pb.LeaseClient
	obs Observer
}

func (o observedLease) LeaseGrant(ctx context.Context, in *pb.LeaseGrantRequest, opts ...grpc.CallOption) (*pb.LeaseGrantResponse, error) {
	r, err := o.LeaseClient.LeaseGrant(ctx, in, opts...)
	o.obs("/etcdserverpb.Lease/LeaseGrant", in, r, err)
	return r, err
}

func (o observedLease) LeaseRevoke(ctx context.Context, in *pb.LeaseRevokeRequest, opts ...grpc.CallOption) (*pb.LeaseRevokeResponse, error) {
	r, err := o.LeaseClient.LeaseRevoke(ctx, in, opts...)
	o.obs("/etcdserverpb.Lease/LeaseRevoke", in, r, err)
	return r, err
}

func (o observedLease) LeaseTimeToLive(ctx context.Context, in *pb.LeaseTimeToLiveRequest, opts ...grpc.CallOption) (*pb.LeaseTimeToLiveResponse, error) {
	r, err := o.LeaseClient.LeaseTimeToLive(ctx, in, opts...)
	o.obs("/etcdserverpb.Lease/LeaseTimeToLive", in, r, err)
	return r, err
}

type observedMaintenance struct {
	pb.MaintenanceClient
	obs Observer
}

func (o observedMaintenance) Alarm(ctx context.Context, in *pb.AlarmRequest, opts ...grpc.CallOption) (*pb.AlarmResponse, error) {
	r, err := o.MaintenanceClient.Alarm(ctx, in, opts...)
	o.obs("/etcdserverpb.Maintenance/Alarm", in, r, err)
	return r, err
}

func (o observedMaintenance) Status(ctx context.Context, in *pb.StatusRequest, opts ...grpc.CallOption) (*pb.StatusResponse, error) {
	r, err := o.MaintenanceClient.Status(ctx, in, opts...)
	o.obs("/etcdserverpb.Maintenance/Status", in, r, err)
	return r, err
}
