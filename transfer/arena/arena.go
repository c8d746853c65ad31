package arena

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

var (
	// ErrNoSpace is returned by Alloc when no free block can hold the request.
	ErrNoSpace = errors.New("arena: no space")
	// ErrBadBuf is returned for a Buf this arena did not hand out, one already
	// freed (double free), or one whose region was since reused (stale).
	ErrBadBuf = errors.New("arena: unknown or stale buffer")
	// ErrNotPinned is returned by Unpin for a buffer that holds no pin.
	ErrNotPinned = errors.New("arena: buffer not pinned")
	// ErrClosed is returned by operations on a closed Arena.
	ErrClosed = errors.New("arena: closed")
	// ErrBadConfig is returned (wrapped) by New for an invalid Config.
	ErrBadConfig = errors.New("arena: bad config")
	// ErrBadFd is returned (wrapped) by Map for an fd that is not a sealed
	// memfd of the expected size.
	ErrBadFd = errors.New("arena: bad arena fd")
)

// Page modes reported in Stats.PageMode.
const (
	PageHugeTLB = "hugetlb" // MFD_HUGETLB: explicit huge pages from the kernel's pool
	PageTHP     = "thp"     // base memfd with madvise(MADV_HUGEPAGE) honoured for shmem
	PageBase    = "base"    // ordinary base pages
)

// hugePageSize is the size a hugetlb arena is rounded to. The kernel's default
// huge page size on amd64; a host configured for 1 GiB defaults falls back.
const hugePageSize = 2 << 20

// maxAlign bounds Config.Align so rounding cannot overflow.
const maxAlign = 1 << 30

// Config configures an Arena. Treat it as frozen once passed to New.
type Config struct {
	// Name labels the memfd (visible in /proc/<pid>/maps and fd listings).
	Name string
	// Size is the arena size in bytes. Rounded up to Align, and to 2 MiB when
	// hugetlb pages are used.
	Size int64
	// Align is the alignment and granularity of every buffer; a power of two.
	Align int64
	// HugePages asks for huge pages: MFD_HUGETLB first, then transparent huge
	// pages via madvise(MADV_HUGEPAGE); falls back silently to base pages.
	// Stats reports what was obtained.
	HugePages bool
	// Prefault faults every page in at New (MADV_POPULATE_WRITE), so no
	// transfer ever pays for a first touch.
	Prefault bool
}

// DefaultConfig returns a Config for a 1 GiB arena.
func DefaultConfig() Config {
	return Config{
		// Shows up in /proc/<pid>/maps as memfd:latentmesh-arena.
		Name: "latentmesh-arena",
		// Room for a few SDXL latents and embeddings; agents size it from
		// their role and the host's memory.
		Size: 1 << 30,
		// Page alignment: buffers never share a page, so each can be used for
		// O_DIRECT spill or registered for RDMA on its own; the waste is at most
		// 4 KiB against MB-sized payloads.
		Align: 4096,
		// Fewer TLB misses when copying hundreds of MiB; free when unavailable.
		HugePages: true,
		// Fresh pages fault at ~1.5 GB/s here, a quarter of memcpy speed; pay
		// that once at start-up, not on the data path.
		Prefault: true,
	}
}

// DefaultTestConfig returns a small arena for tests: 16 MiB, not prefaulted
// so many can be created quickly.
func DefaultTestConfig() Config {
	c := DefaultConfig()
	c.Name = "latentmesh-arena-test"
	c.Size = 16 << 20
	c.HugePages = false
	c.Prefault = false
	return c
}

func (c Config) validate() error {
	if c.Size <= 0 {
		return fmt.Errorf("%w: size %d must be positive", ErrBadConfig, c.Size)
	}
	if c.Align <= 0 || c.Align > maxAlign || bits.OnesCount64(uint64(c.Align)) != 1 {
		return fmt.Errorf("%w: align %d must be a power of two in [1, %d]", ErrBadConfig, c.Align, maxAlign)
	}
	if c.Size > (1<<62)-maxAlign {
		return fmt.Errorf("%w: size %d too large", ErrBadConfig, c.Size)
	}
	if strings.IndexByte(c.Name, 0) >= 0 || len(c.Name) > 200 {
		return fmt.Errorf("%w: name must be under 200 bytes with no NUL", ErrBadConfig)
	}
	return nil
}

// Arena is one memfd-backed shared mapping carved into buffers. All methods
// are safe for concurrent use.
//
// Slices returned by Bytes and Slice point into the mapping and become invalid
// (accessing them crashes the process) after Close; callers stop using them,
// and stop calling Bytes, Slice and Fd, before Close.
type Arena struct {
	cfg        Config
	fd         int
	mem        []byte
	size       int64
	pageMode   string
	prefaulted bool

	closeOnce sync.Once
	closeErr  error

	// mu guards the fields below.
	mu     sync.Mutex
	closed bool
	alloc  allocator
}

// New creates an arena: memfd_create, ftruncate, seal, mmap(MAP_SHARED),
// optional huge pages and prefault.
func New(cfg Config) (_ *Arena, err error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	size := roundUp(cfg.Size, cfg.Align)
	a := &Arena{cfg: cfg, fd: -1}
	defer func() {
		if err != nil {
			a.release()
		}
	}()

	if cfg.HugePages {
		hsize := roundUp(size, max(hugePageSize, cfg.Align))
		if fd, mem, err := createMapping(cfg.Name, hsize, unix.MFD_HUGETLB); err == nil {
			a.fd, a.mem, a.size, a.pageMode = fd, mem, hsize, PageHugeTLB
		}
	}
	if a.mem == nil {
		fd, mem, err := createMapping(cfg.Name, size, 0)
		if err != nil {
			return nil, err
		}
		a.fd, a.mem, a.size, a.pageMode = fd, mem, size, PageBase
		if cfg.HugePages && shmemTHPAllowed() && unix.Madvise(mem, unix.MADV_HUGEPAGE) == nil {
			a.pageMode = PageTHP
		}
	}
	if cfg.Prefault {
		if err := prefault(a.mem); err != nil {
			return nil, fmt.Errorf("arena: prefault %d bytes: %w", a.size, err)
		}
		a.prefaulted = true
	}
	a.alloc.init(a.size, cfg.Align)
	return a, nil
}

// createMapping makes a sealed memfd of size bytes and maps it read-write.
func createMapping(name string, size int64, flags int) (fd int, mem []byte, err error) {
	fd, err = unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|flags)
	if err != nil {
		return -1, nil, fmt.Errorf("arena: memfd_create: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	if err := unix.Ftruncate(fd, size); err != nil {
		return -1, nil, fmt.Errorf("arena: ftruncate %d: %w", size, err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return -1, nil, fmt.Errorf("arena: seal memfd: %w", err)
	}
	mem, err = unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return -1, nil, fmt.Errorf("arena: mmap %d bytes: %w", size, err)
	}
	return fd, mem, nil
}

// prefault allocates and maps every page of mem, preferring
// MADV_POPULATE_WRITE (Linux 5.14) and touching one byte per page otherwise.
func prefault(mem []byte) error {
	err := unix.Madvise(mem, unix.MADV_POPULATE_WRITE)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) {
		return err
	}
	page := os.Getpagesize()
	for i := 0; i < len(mem); i += page {
		mem[i] = 0
	}
	return nil
}

// shmemTHPAllowed reports whether the kernel honours MADV_HUGEPAGE on shmem
// (memfd) mappings: shmem_enabled is not "never" or "deny".
func shmemTHPAllowed() bool {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err != nil {
		return false
	}
	s := string(b)
	i, j := strings.IndexByte(s, '['), strings.IndexByte(s, ']')
	if i < 0 || j <= i {
		return false
	}
	switch s[i+1 : j] {
	case "always", "within_size", "advise", "force":
		return true
	}
	return false
}

// Close unmaps the arena and closes its fd. Idempotent. Peers that mapped
// the fd keep their own mapping until they close it.
func (a *Arena) Close() error {
	a.closeOnce.Do(func() {
		a.mu.Lock()
		a.closed = true
		a.mu.Unlock()
		a.closeErr = a.release()
	})
	return a.closeErr
}

func (a *Arena) release() error {
	var errs []error
	if a.mem != nil {
		if err := unix.Munmap(a.mem); err != nil {
			errs = append(errs, fmt.Errorf("arena: munmap: %w", err))
		}
		a.mem = nil
	}
	if a.fd >= 0 {
		if err := unix.Close(a.fd); err != nil {
			errs = append(errs, fmt.Errorf("arena: close fd: %w", err))
		}
		a.fd = -1
	}
	return errors.Join(errs...)
}

// Fd is the memfd backing the arena, for passing to a peer (SCM_RIGHTS). The
// arena owns it; callers must not close it. It is -1 after Close.
func (a *Arena) Fd() int { return a.fd }

// Size is the mapped size in bytes (Config.Size rounded up).
func (a *Arena) Size() int64 { return a.size }

// Bytes is the whole mapping. Invalid after Close.
func (a *Arena) Bytes() []byte { return a.mem }

// Slice is the view of b in the mapping, or nil when b lies outside the
// arena. It checks bounds only, not that b is live, so it costs no lock.
func (a *Arena) Slice(b Buf) []byte {
	if b.Off < 0 || b.Len < 0 || b.Off > a.size || b.Len > a.size-b.Off || a.mem == nil {
		return nil
	}
	return a.mem[b.Off : b.Off+b.Len : b.Off+b.Len]
}

func roundUp(n, align int64) int64 { return (n + align - 1) &^ (align - 1) }
