package shm

import (
	"fmt"
	"net"
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// CredCheck decides whether the process at the other end of a Unix socket,
// identified by its SO_PEERCRED credentials, may share arenas with us. A
// non-nil error rejects it.
type CredCheck func(unix.Ucred) error

// SameUID accepts peers running as this process's uid: the default, since
// a peer that can read our arena can read everything else we own anyway.
func SameUID() CredCheck {
	uid := uint32(os.Getuid())
	return func(c unix.Ucred) error {
		if c.Uid != uid {
			return fmt.Errorf("%w: uid %d (pid %d), want %d", ErrPeerRejected, c.Uid, c.Pid, uid)
		}
		return nil
	}
}

// AllowUIDs accepts peers running as one of uids, for deployments where
// engine workers run under their own accounts.
func AllowUIDs(uids ...uint32) CredCheck {
	uids = slices.Clone(uids)
	return func(c unix.Ucred) error {
		if !slices.Contains(uids, c.Uid) {
			return fmt.Errorf("%w: uid %d (pid %d) not in %v", ErrPeerRejected, c.Uid, c.Pid, uids)
		}
		return nil
	}
}

// peerCred reads SO_PEERCRED of a connected Unix socket.
func peerCred(c *net.UnixConn) (unix.Ucred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return unix.Ucred{}, fmt.Errorf("shm: peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return unix.Ucred{}, fmt.Errorf("shm: peer credentials: %w", err)
	}
	if serr != nil {
		return unix.Ucred{}, fmt.Errorf("shm: peer credentials: %w", serr)
	}
	return *cred, nil
}
