package gossip

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"time"
)

// Roles a node can serve: the three pipeline stages.
const (
	RoleEncode  = "encode"
	RoleDenoise = "denoise"
	RoleDecode  = "decode"
)

// maxIDLen bounds a node id; it is an etcd key segment and a memberlist name.
const maxIDLen = 128

// NodeRecord is a node's durable registration, stored as JSON at
// <prefix>/nodes/<ID> on the node's lease so operators can read it with
// etcdctl. It changes only when the node (re-)registers.
type NodeRecord struct {
	ID         string   `json:"id"`
	PeerID     string   `json:"peer_id,omitempty"`     // libp2p peer id
	P2PAddrs   []string `json:"p2p_addrs,omitempty"`   // libp2p multiaddrs
	DataAddr   string   `json:"data_addr,omitempty"`   // raw TCP data plane, host:port
	GossipAddr string   `json:"gossip_addr,omitempty"` // memberlist, host:port; filled in by Start
	HTTPAddr   string   `json:"http_addr,omitempty"`
	AdminAddr  string   `json:"admin_addr,omitempty"`
	Roles      []string `json:"roles,omitempty"` // subset of RoleEncode, RoleDenoise, RoleDecode
	// Slots is each role's total credits (tasks run at once): the
	// downstream budget of admission is their sum over a stage's agents.
	Slots     map[string]int `json:"slots,omitempty"`
	Host      string         `json:"host,omitempty"` // host identity (hostname/boot id): equal means same host
	Version   string         `json:"version,omitempty"`
	StartedAt time.Time      `json:"started_at"`
	// Models is what the node's engine says of each model it serves that
	// a request needs before it is queued (its limits), as JSON the agent
	// defines: gossip meta has no room for it (512 bytes), and it changes
	// only when an engine registers (SetModels).
	Models map[string]json.RawMessage `json:"models,omitempty"`
}

// HasRole reports whether the record lists role.
func (r NodeRecord) HasRole(role string) bool {
	for _, x := range r.Roles {
		if x == role {
			return true
		}
	}
	return false
}

func (r NodeRecord) clone() NodeRecord {
	r.P2PAddrs = append([]string(nil), r.P2PAddrs...)
	r.Roles = append([]string(nil), r.Roles...)
	if r.Slots != nil {
		slots := make(map[string]int, len(r.Slots))
		for k, v := range r.Slots {
			slots[k] = v
		}
		r.Slots = slots
	}
	if r.Models != nil {
		r.Models = maps.Clone(r.Models) // the values are never modified in place
	}
	return r
}

func (r NodeRecord) validate() error {
	if err := validateID(r.ID); err != nil {
		return err
	}
	seen := make(map[string]bool, len(r.Roles))
	for _, role := range r.Roles {
		if !validRole(role) {
			return fmt.Errorf("%w: unknown role %q", ErrInvalidRecord, role)
		}
		if seen[role] {
			return fmt.Errorf("%w: role %q listed twice", ErrInvalidRecord, role)
		}
		seen[role] = true
	}
	return nil
}

func validateID(id string) error {
	if id == "" || len(id) > maxIDLen {
		return fmt.Errorf("%w: id must be 1..%d bytes, got %d", ErrInvalidRecord, maxIDLen, len(id))
	}
	if strings.ContainsAny(id, "/ \t\r\n") {
		return fmt.Errorf("%w: id %q contains '/' or whitespace", ErrInvalidRecord, id)
	}
	return nil
}

func validRole(role string) bool {
	return role == RoleEncode || role == RoleDenoise || role == RoleDecode
}
