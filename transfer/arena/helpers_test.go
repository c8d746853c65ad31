package arena

import (
	"testing"

	"golang.org/x/sys/unix"
)

// createUnsealed makes a plain memfd with no seals, which Map must refuse.
func createUnsealed(t *testing.T, size int64) (int, error) {
	t.Helper()
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, err
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd, unix.Ftruncate(fd, size)
}
