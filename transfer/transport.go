package transfer

import (
	"fmt"
	"os"
	"strings"
)

// TransportLocal is what TransportFor reports for a payload this service
// published itself: it is read in process, with no transport at all.
const TransportLocal = "local"

// caps is what one end of a pull offers, as far as the transport choice
// goes: the consumer's own, or a producer's as its Ref advertises them.
type caps struct {
	host string // hostIdentity; "" when unknown
	shm  bool   // has an arena served over a Unix socket (for a producer: one reachable here)
	rdma bool   // has an open RDMA device with its arena registered
}

// chooseTransport picks how a consumer with caps self pulls from a producer
// with caps prod under mode (Config.Transport): same host with shm on both
// ends -> shm; RDMA on both ends -> rdma; else tcp. A forced transport the
// pair cannot use is an error wrapping ErrTransport.
func chooseTransport(mode string, self, prod caps) (string, error) {
	sameHost := self.host != "" && self.host == prod.host
	shmOK := sameHost && self.shm && prod.shm
	rdmaOK := self.rdma && prod.rdma
	switch mode {
	case TransportTCP:
		return TransportTCP, nil
	case TransportShm:
		switch {
		case !sameHost:
			return "", fmt.Errorf("%w: shm: producer on host %q, we are on %q", ErrTransport, prod.host, self.host)
		case !self.shm:
			return "", fmt.Errorf("%w: shm: this service has no arena served", ErrTransport)
		case !prod.shm:
			return "", fmt.Errorf("%w: shm: producer serves no arena socket reachable here", ErrTransport)
		}
		return TransportShm, nil
	case TransportRDMA:
		switch {
		case !self.rdma:
			return "", fmt.Errorf("%w: rdma: no RDMA device open here", ErrTransport)
		case !prod.rdma:
			return "", fmt.Errorf("%w: rdma: producer has no RDMA device", ErrTransport)
		}
		return TransportRDMA, nil
	}
	switch {
	case shmOK:
		return TransportShm, nil
	case rdmaOK:
		return TransportRDMA, nil
	}
	return TransportTCP, nil
}

// TransportFor says how a pull of ref would move its bytes: TransportLocal,
// TransportShm, TransportRDMA or TransportTCP, or "" with a forced
// Config.Transport the producer cannot be reached with (the pull would fail).
// A payload the producer holds outside its arena still travels by tcp when
// the mode is auto; TransportFor cannot know that before the ticket.
func (s *Service) TransportFor(ref Ref) string {
	t, err := s.transportFor(ref)
	if err != nil {
		return ""
	}
	return t
}

func (s *Service) transportFor(ref Ref) (string, error) {
	if ref.Producer.PeerID == s.self.String() {
		return TransportLocal, nil
	}
	return chooseTransport(s.cfg.Transport, s.caps(), s.producerCaps(ref.Producer))
}

// caps is what this service offers as a consumer.
func (s *Service) caps() caps {
	return caps{host: s.hostID, shm: s.shmSrv != nil, rdma: s.rdma != nil}
}

// producerCaps is what p offers to this service: its shm socket counts only
// when it is on our host and the socket exists here (a container with its own
// /tmp sees a different directory, or none).
func (s *Service) producerCaps(p Producer) caps {
	c := caps{host: p.Host, rdma: p.RDMA}
	if p.ShmSocket != "" && p.Host != "" && p.Host == s.hostID {
		if fi, err := os.Stat(p.ShmSocket); err == nil && fi.Mode()&os.ModeSocket != 0 {
			c.shm = true
		}
	}
	return c
}

// hostIdentity names this machine's running kernel: the hostname plus the
// boot id, so two machines (or containers on two machines) that share a
// hostname are told apart. Containers on one kernel share the boot id and
// differ in hostname unless they share the host's UTS namespace; either way
// shm is then only tried when the producer's socket is visible here.
// HostID is this host's identity as transfers see it (hostname and boot id;
// "" when unknown): agents with equal HostIDs can hand payloads over shm.
func (s *Service) HostID() string { return s.hostID }

func hostIdentity() string {
	name, err := os.Hostname()
	if err != nil {
		name = ""
	}
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil || name == "" {
		return ""
	}
	return name + "/" + strings.TrimSpace(string(boot))
}
