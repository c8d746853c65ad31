// Package etcdclient builds latentmesh's etcd clients: endpoints, TLS with
// a client certificate and a CA (checked with a handshake up front, so that
// a refused certificate is an error that says so), and user auth. The
// agent command and the testbed build every client here.
package etcdclient
