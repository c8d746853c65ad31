package arena

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// Access selects the protection of a Mapping.
type Access int

const (
	// ReadOnly maps a peer's arena for reading in place and copying out; a
	// stray write faults instead of corrupting the peer.
	ReadOnly Access = iota
	// ReadWrite maps a peer's arena for writing into it.
	ReadWrite
)

// requiredSeals are the seals every arena memfd carries (see New): a peer's
// mapping can never be made to fault by the owner shrinking the file.
const requiredSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW

// Mapping is a mapping of another arena's memfd, typically a same-host
// peer's received over SCM_RIGHTS. Slices from Bytes become invalid after
// Close.
type Mapping struct {
	mem       []byte
	closeOnce sync.Once
	closeErr  error
}

// Map maps size bytes of the arena memfd fd. It checks that fd is a memfd
// sealed against shrinking and growing and that its size is exactly size,
// then maps it MAP_SHARED with page tables populated, so reading in place
// takes no page faults. Map does not take ownership of fd; the caller may
// close it once Map returns.
func Map(fd int, size int64, access Access) (*Mapping, error) {
	if size <= 0 || int64(int(size)) != size {
		return nil, fmt.Errorf("%w: size %d", ErrBadFd, size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: fstat: %v", ErrBadFd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%w: not a regular file (mode %o)", ErrBadFd, st.Mode)
	}
	if st.Size != size {
		return nil, fmt.Errorf("%w: file is %d bytes, expected %d", ErrBadFd, st.Size, size)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: get seals: %v", ErrBadFd, err)
	}
	if seals&requiredSeals != requiredSeals {
		return nil, fmt.Errorf("%w: seals %#x lack shrink/grow", ErrBadFd, seals)
	}
	prot := unix.PROT_READ
	if access == ReadWrite {
		prot |= unix.PROT_WRITE
	}
	mem, err := unix.Mmap(fd, 0, int(size), prot, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("arena: map peer arena of %d bytes: %w", size, err)
	}
	return &Mapping{mem: mem}, nil
}

// Bytes is the whole mapping. Invalid after Close.
func (m *Mapping) Bytes() []byte { return m.mem }

// Size is the mapped size in bytes.
func (m *Mapping) Size() int64 { return int64(len(m.mem)) }

// Close unmaps. Idempotent; it must not race with use of Bytes.
func (m *Mapping) Close() error {
	m.closeOnce.Do(func() {
		if err := unix.Munmap(m.mem); err != nil {
			m.closeErr = fmt.Errorf("arena: munmap peer arena: %w", err)
		}
	})
	return m.closeErr
}
