package testbed

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
)

// Net is a virtual network of hosts on this machine: a Linux bridge in the
// root network namespace with an address of its own (the test process and
// anything it runs directly reach the hosts through it), and per host a
// network namespace joined to the bridge by a veth pair. Programs run on a
// host (Host.Command) also get their own UTS namespace with the host's
// name, so agents there have distinct host identities and pick tcp, not
// shm, between hosts, as on separate machines.
//
// Building one needs root and iproute2; faults need iptables and tc. The
// project's scripts/install-deps.sh installs both. NetAvailable says
// whether this machine can.
type Net struct {
	id     string // short random tag in every name, so nets never collide
	prefix string // first three octets of the /24, e.g. "10.213.7"
	bridge string

	mu sync.Mutex
	// mu guards the fields below.
	hosts  []*Host
	closed bool
}

// Host is one network namespace on a Net.
type Host struct {
	Name string // also its hostname
	IP   string
	ns   string
	veth string // root-side end of its veth pair
	net  *Net
}

// NetAvailable reports whether this process can build a Net, and why not.
func NetAvailable() (bool, string) {
	if os.Geteuid() != 0 {
		return false, "network namespaces need root"
	}
	for _, tool := range []string{"ip", "iptables", "tc", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			return false, tool + " not installed (scripts/install-deps.sh installs it)"
		}
	}
	return true, ""
}

// NewNet creates the bridge of a new network in 10.213.x.0/24, for a free x,
// with the root namespace at .254.
func NewNet() (_ *Net, err error) {
	var tag [3]byte
	if _, err := rand.Read(tag[:]); err != nil {
		return nil, err
	}
	n := &Net{id: hex.EncodeToString(tag[:])}
	n.bridge = "lmb" + n.id
	subnet, err := freeSubnet(int(tag[0]))
	if err != nil {
		return nil, err
	}
	n.prefix = fmt.Sprintf("10.213.%d", subnet)
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if err := run("ip", "link", "add", n.bridge, "type", "bridge"); err != nil {
		return nil, err
	}
	if err := run("ip", "addr", "add", n.prefix+".254/24", "dev", n.bridge); err != nil {
		return nil, err
	}
	if err := run("ip", "link", "set", n.bridge, "up"); err != nil {
		return nil, err
	}
	return n, nil
}

// freeSubnet returns an x with no address of this machine in 10.213.x.0/24,
// trying from start.
func freeSubnet(start int) (int, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return 0, err
	}
	used := make(map[int]bool)
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			if ip := ipn.IP.To4(); ip != nil && ip[0] == 10 && ip[1] == 213 {
				used[int(ip[2])] = true
			}
		}
	}
	for i := range 250 {
		if x := 1 + (start+i)%250; !used[x] {
			return x, nil
		}
	}
	return 0, errors.New("testbed: no free 10.213.x.0/24 subnet")
}

// RootIP is the root namespace's address on the network: listen there for
// services the hosts must reach (etcd, say).
func (n *Net) RootIP() string { return n.prefix + ".254" }

// AddHost creates a namespace named name (at most 8 bytes) on the network,
// with loopback and eth0 up and the next free address.
func (n *Net) AddHost(name string) (_ *Host, err error) {
	if name == "" || len(name) > 8 || strings.ContainsAny(name, " /") {
		return nil, fmt.Errorf("testbed: host name %q: want 1-8 bytes, no spaces or slashes", name)
	}
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil, errors.New("testbed: net closed")
	}
	k := len(n.hosts) + 1
	h := &Host{Name: name, IP: fmt.Sprintf("%s.%d", n.prefix, k), ns: fmt.Sprintf("lm%s-%s", n.id, name),
		veth: fmt.Sprintf("lmh%s%d", n.id, k), net: n}
	n.hosts = append(n.hosts, h)
	n.mu.Unlock()

	peer := fmt.Sprintf("lmn%s%d", n.id, k)
	for _, argv := range [][]string{
		{"ip", "netns", "add", h.ns},
		{"ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer},
		{"ip", "link", "set", peer, "netns", h.ns},
		{"ip", "link", "set", h.veth, "master", n.bridge},
		{"ip", "link", "set", h.veth, "up"},
		{"ip", "-n", h.ns, "link", "set", peer, "name", "eth0"},
		{"ip", "-n", h.ns, "addr", "add", h.IP + "/24", "dev", "eth0"},
		{"ip", "-n", h.ns, "link", "set", "eth0", "up"},
		{"ip", "-n", h.ns, "link", "set", "lo", "up"},
	} {
		if err := run(argv...); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// Close deletes every namespace (which deletes their veth pairs) and the
// bridge. It is idempotent and tries every step, returning the first error.
func (n *Net) Close() error {
	n.mu.Lock()
	hosts := n.hosts
	n.hosts, n.closed = nil, true
	n.mu.Unlock()
	var first error
	for _, h := range hosts {
		if err := run("ip", "netns", "del", h.ns); err != nil && first == nil && !strings.Contains(err.Error(), "No such file") {
			first = err
		}
		// Gone with the namespace, unless AddHost failed before moving
		// its peer there.
		run("ip", "link", "del", h.veth)
	}
	if err := run("ip", "link", "del", n.bridge); err != nil && first == nil && !strings.Contains(err.Error(), "Cannot find device") {
		first = err
	}
	return first
}

// Command returns a command running argv on h: in its network namespace,
// in a UTS namespace of its own whose hostname is h.Name.
func (h *Host) Command(argv ...string) *exec.Cmd {
	args := append([]string{"netns", "exec", h.ns, "unshare", "--uts", "--",
		"sh", "-c", `hostname "$0" && exec "$@"`, h.Name}, argv...)
	return exec.Command("ip", args...)
}

// Partition makes h silent: every packet in or out of its eth0 is dropped,
// with no reset or ICMP error, as a pulled cable or a dead switch port
// looks to its peers. Connections stay open and stall.
func (h *Host) Partition() error {
	for _, rule := range [][]string{{"INPUT", "-i"}, {"OUTPUT", "-o"}} {
		if err := h.exec("iptables", "-I", rule[0], rule[1], "eth0", "-j", "DROP"); err != nil {
			return err
		}
	}
	return nil
}

// Heal undoes Partition.
func (h *Host) Heal() error {
	for _, rule := range [][]string{{"INPUT", "-i"}, {"OUTPUT", "-o"}} {
		if err := h.exec("iptables", "-D", rule[0], rule[1], "eth0", "-j", "DROP"); err != nil {
			return err
		}
	}
	return nil
}

// Shape limits what h sends to rate (tc syntax, e.g. "200mbit") with a token
// bucket filter, as a slower link would.
func (h *Host) Shape(rate string) error {
	return h.exec("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms")
}

// Unshape removes the limit Shape set.
func (h *Host) Unshape() error {
	return h.exec("tc", "qdisc", "del", "dev", "eth0", "root")
}

// exec runs argv in h's network namespace.
func (h *Host) exec(argv ...string) error {
	return run(append([]string{"ip", "netns", "exec", h.ns}, argv...)...)
}

// run runs argv and returns its output in the error when it fails.
func run(argv ...string) error {
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("testbed: %s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
