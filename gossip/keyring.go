package gossip

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// maxKeyringFile bounds the keyring file read: a few hundred keys fit.
const maxKeyringFile = 64 << 10

// ReadKeyringFile reads and checks a keyring file (see Config.KeyringFile)
// and returns its keys, primary first. A command can call it to reject a
// bad file before it starts anything.
func ReadKeyringFile(path string) ([][]byte, error) {
	keys, _, err := readKeyring(path)
	return keys, err
}

// readKeyring reads a keyring file and returns its keys, primary first, and
// the bytes it read.
func readKeyring(path string) ([][]byte, []byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrInvalidKeyring, err)
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, maxKeyringFile+1))
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrInvalidKeyring, err)
	}
	if len(raw) > maxKeyringFile {
		return nil, raw, fmt.Errorf("%w: %s is larger than %d bytes", ErrInvalidKeyring, path, maxKeyringFile)
	}
	keys, err := parseKeyring(raw)
	if err != nil {
		return nil, raw, fmt.Errorf("%s: %w", path, err)
	}
	return keys, raw, nil
}

// parseKeyring decodes a keyring file: a JSON list of base64 (standard
// alphabet, padded) strings, each an AES key of 16, 24 or 32 bytes. The
// first is the primary key. Keys may not repeat.
func parseKeyring(raw []byte) ([][]byte, error) {
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, fmt.Errorf("%w: want a JSON list of base64 keys: %v", ErrInvalidKeyring, err)
	}
	if len(list) == 0 {
		return nil, fmt.Errorf("%w: no keys", ErrInvalidKeyring)
	}
	keys := make([][]byte, 0, len(list))
	for i, s := range list {
		k, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			return nil, fmt.Errorf("%w: key %d: %v", ErrInvalidKeyring, i, err)
		}
		if err := memberlist.ValidateKey(k); err != nil {
			return nil, fmt.Errorf("%w: key %d is %d bytes: %v", ErrInvalidKeyring, i, len(k), err)
		}
		if slices.ContainsFunc(keys, func(o []byte) bool { return bytes.Equal(o, k) }) {
			return nil, fmt.Errorf("%w: key %d repeats an earlier key", ErrInvalidKeyring, i)
		}
		keys = append(keys, k)
	}
	return keys, nil
}

// fingerprint names a key in logs without giving it away.
func fingerprint(key []byte) string {
	sum := sha256.Sum256(key)
	return hex.EncodeToString(sum[:4])
}

// installKeys makes kr hold exactly keys, with keys[0] primary: new keys
// are added, then the primary switched, then keys no longer listed are
// removed, so at every step kr still decrypts what peers on the old or the
// new file send.
func installKeys(kr *memberlist.Keyring, keys [][]byte) error {
	for _, k := range keys {
		if err := kr.AddKey(k); err != nil {
			return err
		}
	}
	if err := kr.UseKey(keys[0]); err != nil {
		return err
	}
	// From the end: memberlist's RemoveKey shifts the keys after the one
	// removed in place, under packet handlers that may be reading them;
	// removing the last one moves nothing. The usual rotation (add a key,
	// make it primary, remove the old one) only ever removes the last.
	installed := slices.Clone(kr.GetKeys())
	for i := len(installed) - 1; i > 0; i-- {
		if !slices.ContainsFunc(keys, func(k []byte) bool { return bytes.Equal(k, installed[i]) }) {
			if err := kr.RemoveKey(installed[i]); err != nil {
				return err
			}
		}
	}
	return nil
}

// keyringLoop reads KeyringFile every KeyringCheck and installs the keys
// when its content changed. A file that cannot be read or parsed is logged
// once and the keys in use stay. last is the content the keyring was built
// from.
//
// Polling rather than SIGHUP: a signal is process-wide (an agent binary, or
// a test running several nodes, would need one handler fanning out), and a
// secret mounted by an orchestrator changes by a symlink swap that no
// signal announces. Reading a small file every few seconds costs nothing.
func (m *Membership) keyringLoop(last []byte) {
	defer m.wg.Done()
	tick := time.NewTicker(m.cfg.KeyringCheck)
	defer tick.Stop()
	var lastErr string
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-tick.C:
		}
		keys, raw, err := readKeyring(m.cfg.KeyringFile)
		if raw == nil && err != nil { // not read: missing, unreadable
			if err.Error() != lastErr {
				lastErr = err.Error()
				m.log.Error("keyring file unreadable; keeping the keys in use", zap.Error(err))
			}
			continue
		}
		lastErr = ""
		if bytes.Equal(raw, last) {
			continue
		}
		last = raw
		if err != nil {
			m.log.Error("keyring file invalid; keeping the keys in use", zap.Error(err))
			continue
		}
		if err := installKeys(m.keyring, keys); err != nil {
			m.log.Error("install gossip keys", zap.Error(err))
			continue
		}
		m.log.Info("gossip keyring reloaded", zap.Int("keys", len(keys)), zap.String("primary", fingerprint(keys[0])))
	}
}

// checkKeyringMode warns when others than the owner may read the keys.
func (m *Membership) checkKeyringMode() {
	fi, err := os.Stat(m.cfg.KeyringFile)
	if err == nil && fi.Mode().Perm()&0o077 != 0 {
		m.log.Warn("keyring file is readable by group or others", zap.String("path", m.cfg.KeyringFile),
			zap.Stringer("mode", fi.Mode().Perm()))
	}
}
