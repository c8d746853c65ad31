package testbed

import (
	"go.uber.org/zap"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/latentmesh/latentmesh/agent/etcdclient"
)

// EtcdClientConfig is etcdclient.Config, under the name the testbed's
// clusters and tests use.
type EtcdClientConfig = etcdclient.Config

// NewEtcdClient connects to endpoints without TLS or auth
// (etcdclient.Connect).
func NewEtcdClient(endpoints []string, log *zap.Logger) (*clientv3.Client, error) {
	return etcdclient.Connect(endpoints, log)
}
