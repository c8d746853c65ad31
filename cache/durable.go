package cache

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/zeebo/xxh3"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/latentmesh/latentmesh/transfer"
)

// Durable copies.
//
// A Pinned object (a job's result) is written through to the disk tier
// when the holder has one: the copy is a file of the node's spill
// directory, synced to disk, with a sidecar that names the object, before
// the holder answers the put. Such a copy outlives its agent: an agent
// that restarts (a kill -9, a reboot) under the same node id finds its
// durable copies, checks each against its checksum, and publishes it
// again; maintenance then names the new payload in the object's record in
// place of the one the previous run served (reannounce), and frees the
// copies no record wants any more. Other spilled copies (relayed latents,
// previews) die with their agent as memory copies do: their jobs have
// other ways back (a rewind re-encodes).

// durable reports whether copies of mode are written through to disk.
func durable(mode Mode) bool { return mode == Pinned }

// Files of a node's spill directory.
const (
	spillExt   = ".spill"    // a spilled copy; removed at start
	durableExt = ".obj"      // a durable copy's bytes
	sidecarExt = ".obj.json" // what a durable copy is; written last
)

// sidecar describes a durable copy, beside its bytes.
type sidecar struct {
	V        int                 `json:"v"`
	Object   string              `json:"object"`
	Mode     Mode                `json:"mode"`
	Meta     transfer.TensorMeta `json:"meta"`
	Checksum uint64              `json:"xxh3"`
}

const sidecarVersion = 1

// maxSidecar bounds a sidecar file read at start.
const maxSidecar = 16 << 10

// spillPath is a new file name for a copy of object in the spill directory.
func (h *holdings) spillPath(object, ext string) string {
	var rnd [6]byte
	rand.Read(rnd[:])
	return filepath.Join(h.spillDir(), object+"-"+hex.EncodeToString(rnd[:])+ext)
}

// syncDurable makes a filled durable copy survive a crash: its bytes are
// flushed to disk, then its sidecar is written, synced and renamed into
// place, then the directory is synced. A copy whose sidecar is missing at
// start was never acknowledged, and is removed.
func (h *holdings) syncDurable(f *os.File, mem []byte, data string, sc sidecar) error {
	if err := unix.Msync(mem, unix.MS_SYNC); err != nil {
		return fmt.Errorf("cache: sync durable copy: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("cache: sync durable copy: %w", err)
	}
	b, err := json.Marshal(sc)
	if err != nil {
		return err
	}
	side := strings.TrimSuffix(data, durableExt) + sidecarExt
	tmp := side + ".tmp"
	sf, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("cache: sidecar: %w", err)
	}
	_, err = sf.Write(b)
	if err == nil {
		err = sf.Sync()
	}
	if cerr := sf.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, side)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("cache: sidecar: %w", err)
	}
	return syncDir(h.spillDir())
}

// syncDir syncs a directory, so that the names created in it survive a
// crash.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// removeCopyFiles removes a copy's file and, for a durable one, its
// sidecar.
func removeCopyFiles(path string) {
	os.Remove(path)
	if strings.HasSuffix(path, durableExt) {
		os.Remove(strings.TrimSuffix(path, durableExt) + sidecarExt)
	}
}

// prepareSpill creates this node's spill directory, removes the spilled
// copies a previous run left there (they died with it), and recovers its
// durable copies: each is checked against its checksum and published
// again, held as recovered until maintenance names it in its record or
// frees it. A durable copy without a sidecar, or whose bytes do not match
// it, is removed.
func (h *holdings) prepareSpill() error {
	if h.cfg.SpillDir == "" {
		return nil
	}
	dir := h.spillDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("cache: spill dir: %w", err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("cache: spill dir: %w", err)
	}
	names := make(map[string]bool, len(entries))
	for _, e := range entries {
		names[e.Name()] = true
	}
	var stale, recovered, bad int
	for _, e := range entries {
		name, path := e.Name(), filepath.Join(dir, e.Name())
		switch base, isCopy := strings.CutSuffix(name, durableExt); {
		case strings.HasSuffix(name, sidecarExt):
			if !names[strings.TrimSuffix(name, sidecarExt)+durableExt] {
				os.Remove(path) // its copy is gone
			}
		case isCopy && names[base+sidecarExt]:
			if err := h.recover(path); err != nil {
				h.log.Warn("durable copy not recovered; removed", zap.String("file", path), zap.Error(err))
				removeCopyFiles(path)
				bad++
				continue
			}
			recovered++
		default: // a spilled copy, a durable one never acknowledged, a sidecar's temporary
			if err := os.Remove(path); err != nil {
				return fmt.Errorf("cache: remove a previous run's spill file: %w", err)
			}
			stale++
		}
	}
	if stale+recovered+bad > 0 {
		h.log.Info("spill dir from a previous run", zap.String("dir", dir),
			zap.Int("removed", stale), zap.Int("durable_recovered", recovered), zap.Int("durable_bad", bad))
	}
	return nil
}

// recover verifies the durable copy at path against its sidecar and
// publishes it as a recovered copy.
func (h *holdings) recover(path string) error {
	b, err := readBounded(strings.TrimSuffix(path, durableExt)+sidecarExt, maxSidecar)
	if err != nil {
		return err
	}
	var sc sidecar
	if err := json.Unmarshal(b, &sc); err != nil {
		return fmt.Errorf("sidecar: %w", err)
	}
	switch {
	case sc.V != sidecarVersion:
		return fmt.Errorf("sidecar version %d", sc.V)
	case !ValidID(sc.Object) || !sc.Mode.Valid():
		return errors.New("sidecar names no valid object")
	case sc.Checksum == 0:
		return errors.New("sidecar has no checksum")
	}
	if err := sc.Meta.Validate(h.xfer.MaxPayloadBytes()); err != nil {
		return fmt.Errorf("sidecar: %w", err)
	}
	size := sc.Meta.Bytes()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil {
		return err
	} else if st.Size() != size {
		return fmt.Errorf("%d bytes on disk, its sidecar says %d", st.Size(), size)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("map: %w", err)
	}
	if got := xxh3.Hash(mem); got != sc.Checksum {
		unix.Munmap(mem)
		return fmt.Errorf("%w: xxh3 %x on disk, its sidecar says %x", transfer.ErrCorrupt, got, sc.Checksum)
	}
	h.mu.Lock()
	h.diskUsed += size
	h.mu.Unlock()
	ref, err := h.xfer.PublishCopy(sc.Meta, mem, sc.Checksum, nil, h.diskRelease(mem, path, size, true))
	if err != nil {
		return err // PublishCopy freed it (and the files go with the caller's removal)
	}
	c := &copyOf{object: sc.Object, ref: ref, tier: Disk, size: size, mode: sc.Mode, stagedAt: h.cfg.Now(), recovered: true}
	h.mu.Lock()
	h.copies[ref.ID] = c
	h.byObject[c.object] = append(h.byObject[c.object], c)
	h.mu.Unlock()
	return nil
}

// diskRelease is the free function of a disk copy's mapping: it unmaps
// the file and removes it, except that a durable copy's files stay when
// the Store closes (the next run recovers them).
func (h *holdings) diskRelease(mem []byte, path string, size int64, isDurable bool) func() {
	return func() {
		unix.Munmap(mem)
		if !isDurable || !h.keepDurable.Load() {
			removeCopyFiles(path)
		}
		h.unreserve(Disk, size)
	}
}

// readBounded reads a file of at most limit bytes.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() > limit {
		return nil, fmt.Errorf("%s: %d bytes, at most %d", path, st.Size(), limit)
	}
	b := make([]byte, st.Size())
	_, err = f.ReadAt(b, 0)
	return b, err
}
