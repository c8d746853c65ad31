package transfer

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxCongestionName is the longest congestion control name Linux accepts
// (TCP_CA_NAME_MAX less the terminating NUL).
const maxCongestionName = 15

// validCongestion reports whether name can be a Linux congestion control
// name: short, lower-case letters, digits and underscores.
func validCongestion(name string) bool {
	if len(name) > maxCongestionName {
		return false
	}
	for _, r := range name {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '_' {
			return false
		}
	}
	return true
}

// congestionFallbackMsg is the one line New logs when Config.TCPCongestion
// cannot be set.
const congestionFallbackMsg = "tcp congestion control unavailable; the data plane uses the system default"

// congestionReason says why setting a congestion control failed, naming the
// sysctl to change when it is a permission matter.
func congestionReason(err error) string {
	switch {
	case errors.Is(err, unix.EPERM):
		return "not in net.ipv4.tcp_allowed_congestion_control for this unprivileged process"
	case errors.Is(err, unix.ENOENT):
		return "not in net.ipv4.tcp_available_congestion_control (module not loaded)"
	}
	return err.Error()
}

// systemCongestion is the system's default congestion control, for logs.
func systemCongestion() string {
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

// SetCongestion sets the congestion control of a TCP socket (Linux
// TCP_CONGESTION). Set on a listener, the connections it accepts inherit it.
func SetCongestion(c syscall.RawConn, name string) error {
	if !validCongestion(name) || name == "" {
		return fmt.Errorf("transfer: %q is not a congestion control name", name)
	}
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION, name)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("transfer: set tcp congestion control %s: %s: %w", name, congestionReason(serr), serr)
	}
	return nil
}

// listenControl returns the net.ListenConfig Control hook that sets the data
// listener's congestion control, which every accepted connection inherits,
// so the producer's sending side of each pull runs it at no per-connection
// cost. It never fails the listen: the error setting the option, if any, is
// stored in *failed for New to log once.
func listenControl(name string, failed *error) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		if name != "" {
			*failed = SetCongestion(c, name)
		}
		return nil
	}
}
