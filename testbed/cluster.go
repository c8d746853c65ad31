// Package testbed builds whole latentmesh meshes for tests, the demo and
// benchmarks: an embedded etcd plus agents in this process (Cluster), or
// agents as separate OS processes (Process), with fault controls (kill -9).
//
// It sits above agent and may import anything; nothing but cmd and tests
// import it.
package testbed

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/latentmesh/latentmesh/agent"
	"github.com/latentmesh/latentmesh/agent/engine"
	"github.com/latentmesh/latentmesh/agent/etcdembed"
	"github.com/latentmesh/latentmesh/agent/jobs"
	"github.com/latentmesh/latentmesh/routing"
)

// Topology is how stages map onto agents.
type Topology string

// Topologies of an in-process cluster.
const (
	// Disaggregated runs one agent per stage: encode, denoise, decode.
	Disaggregated Topology = "disaggregated"
	// Colocated runs one agent with every role.
	Colocated Topology = "colocated"
)

// ParseTopology checks a --topology flag.
func ParseTopology(s string) (Topology, error) {
	switch t := Topology(s); t {
	case Disaggregated, Colocated:
		return t, nil
	}
	return "", fmt.Errorf("testbed: unknown topology %q (want disaggregated or colocated)", s)
}

// ClusterConfig describes an in-process cluster.
type ClusterConfig struct {
	Topology Topology
	// Agent is the base config of every agent; roles and node ids are set per
	// agent. Start from agent.DefaultLocalConfig().
	Agent agent.Config
	// Etcd configures the embedded etcd.
	Etcd etcdembed.Config
	// EtcdInProcess has the agents reach the embedded etcd by function
	// calls (etcdembed.Server.Client) rather than over loopback gRPC as
	// agents on other machines do: about half the time per write and less
	// CPU per request. It does not apply to EtcdEndpoints.
	EtcdInProcess bool
	// EtcdEndpoints, when set, is an etcd the cluster uses instead of
	// starting its own (an external etcd process, say).
	EtcdEndpoints []string
	// EtcdClient holds the TLS files and credentials for EtcdEndpoints
	// (its Endpoints and Logger are set by the cluster).
	EtcdClient EtcdClientConfig
	Logger     *zap.Logger
}

// DefaultClusterConfig is a disaggregated cluster on loopback.
func DefaultClusterConfig() ClusterConfig {
	return ClusterConfig{
		Topology: Disaggregated,
		Agent:    agent.DefaultLocalConfig(),
		Etcd:     etcdembed.DefaultConfig(),
		// In-process agents of the embedded etcd skip the socket; tests of
		// the gRPC path run on external etcd processes or turn this off.
		EtcdInProcess: true,
		Logger:        zap.NewNop(),
	}
}

// Cluster is an embedded etcd and agents in this process. Each agent is a
// full agent: its own etcd lease, memberlist, libp2p host and ports.
type Cluster struct {
	cfg    ClusterConfig
	Etcd   *etcdembed.Server
	Client *clientv3.Client
	Agents []*agent.Agent
}

// StartCluster starts etcd and the topology's agents.
func StartCluster(ctx context.Context, cfg ClusterConfig) (_ *Cluster, err error) {
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	c := &Cluster{cfg: cfg}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	endpoints := cfg.EtcdEndpoints
	if len(endpoints) == 0 {
		ec := cfg.Etcd
		ec.Logger = cfg.Logger
		if c.Etcd, err = etcdembed.Start(ctx, ec); err != nil {
			return nil, err
		}
		endpoints = c.Etcd.Endpoints()
	}
	if c.Etcd != nil && cfg.EtcdInProcess {
		c.Client = c.Etcd.Client(nil)
	} else {
		ecc := cfg.EtcdClient
		ecc.Endpoints, ecc.Logger = endpoints, cfg.Logger
		if c.Client, err = ecc.New(ctx); err != nil {
			return nil, err
		}
	}
	switch cfg.Topology {
	case Colocated:
		_, err = c.AddAgent(ctx, "node-all", jobs.Stages()...)
	case Disaggregated:
		for _, st := range jobs.Stages() {
			if _, err = c.AddAgent(ctx, string(st)+"-1", st); err != nil {
				break
			}
		}
	case "":
		// No agents: the caller adds them (latentmesh-dev dev).
	default:
		err = fmt.Errorf("testbed: unknown topology %q", cfg.Topology)
	}
	if err != nil {
		return nil, err
	}
	return c, nil
}

// AddAgent starts one more agent with the given roles and the cluster's base config.
func (c *Cluster) AddAgent(ctx context.Context, id string, roles ...jobs.Stage) (*agent.Agent, error) {
	ac := c.cfg.Agent
	ac.NodeID = id
	ac.Roles = roles
	ac.Logger = c.cfg.Logger
	return c.AddAgentConfig(ctx, ac)
}

// AddAgentConfig starts one more agent with a config of the caller's.
func (c *Cluster) AddAgentConfig(ctx context.Context, ac agent.Config) (*agent.Agent, error) {
	a, err := agent.New(ac, c.Client)
	if err != nil {
		return nil, err
	}
	if err := a.Start(ctx); err != nil {
		a.Close()
		return nil, err
	}
	c.Agents = append(c.Agents, a)
	return a, nil
}

// Close stops the agents, then etcd.
func (c *Cluster) Close() error {
	var errs []error
	for i := len(c.Agents) - 1; i >= 0; i-- {
		errs = append(errs, c.Agents[i].Close())
	}
	c.Agents = nil
	if c.Client != nil {
		err := c.Client.Close()
		if errors.Is(err, context.Canceled) {
			err = nil // an in-process client has no connection: Close reports its own context's end
		}
		errs = append(errs, err)
		c.Client = nil
	}
	if c.Etcd != nil {
		c.Etcd.Close()
		c.Etcd = nil
	}
	return errors.Join(errs...)
}

// Output is a finished job of Run: its record and its file.
type Output struct {
	Job         jobs.Job
	Data        []byte
	ContentType string
}

// Run submits every spec through the first agent, all at once, and returns
// the finished jobs in spec order. A job that does not succeed is an error.
func (c *Cluster) Run(ctx context.Context, specs []engine.Spec) ([]Output, error) {
	if len(c.Agents) == 0 {
		return nil, errors.New("testbed: cluster has no agents")
	}
	entry := c.Agents[0]
	ids := make([]string, len(specs))
	for i, s := range specs {
		j, err := entry.Submit(ctx, s, jobs.Options{Class: routing.Standard})
		if err != nil {
			return nil, fmt.Errorf("testbed: submit %q: %w", s.Prompt, err)
		}
		ids[i] = j.ID
	}
	out := make([]Output, len(ids))
	for i, id := range ids {
		job, err := entry.Wait(ctx, id)
		if err != nil {
			return nil, fmt.Errorf("testbed: wait %s: %w", id, err)
		}
		if job.State != jobs.Succeeded {
			msg := string(job.State)
			if job.Error != nil {
				msg = job.Error.Code + ": " + job.Error.Message
			}
			return nil, fmt.Errorf("testbed: job %s (%q) did not succeed: %s", id, job.Spec.Prompt, msg)
		}
		data, ctype, err := entry.Result(ctx, id)
		if err != nil {
			return nil, fmt.Errorf("testbed: result %s: %w", id, err)
		}
		out[i] = Output{Job: job, Data: data, ContentType: ctype}
	}
	return out, nil
}

// Pulls sums, over the cluster's agents, the payloads pulled by each
// transport (transports that moved none are left out).
func (c *Cluster) Pulls(ctx context.Context) (map[string]int64, error) {
	pulls := map[string]int64{}
	for _, a := range c.Agents {
		st, err := a.Status(ctx)
		if err != nil {
			return nil, fmt.Errorf("testbed: status of %s: %w", a.ID(), err)
		}
		for t, n := range st.Data.Pulls {
			if n > 0 {
				pulls[t] += n
			}
		}
	}
	return pulls, nil
}
