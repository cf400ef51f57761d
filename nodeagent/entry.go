package nodeagent

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/detourmesh/detour/internal/fsutil"
)

// ensureEntry puts detour's entry into the primary configuration and returns the file that
// holds it. A .conflist is edited in place. A .conf or .json (one plugin) becomes
// <name>.conflist, written first, and the original is removed, so the directory holds one
// configuration for the network and the runtime loads the new file: "x.conf" sorts right
// before "x.conflist".
//
// A primary that rewrites its file in place (truncate and write, no rename) may do so between
// the agent's last look and its rename: the write lands in the file the rename replaced and
// would be lost. The agent keeps that file open across the rename and reads it again after:
// when it changed, it adds the entry to that newer version.
//
// file is where primary's content lives: primary itself, or the file its symlink leads to.
func (a *Agent) ensureEntry(primary, file string, data []byte) (string, error) {
	// The binary and the token may have taken a while since data was read: never write back
	// an old copy over the primary's newer one (its change would be lost for good, since the
	// next reconcile would find detour's entry in place).
	changed := &raceError{fmt.Sprintf("%s changed while detour's entry was being prepared; trying again", primary)}
	f, err := os.Open(file)
	if err != nil {
		return primary, changed
	}
	// f is the file the next write replaces, and expect what it holds: after the write, any
	// other content in f is a write of the primary's that the replacement would lose.
	expect, err := readAt(f)
	if err != nil || !bytes.Equal(expect, data) {
		f.Close()
		return primary, changed
	}
	mode := fileMode(file)
	for attempt := 1; ; attempt++ {
		holder, wrote, err := a.putEntry(primary, file, data, mode)
		if err != nil || !wrote || f == nil {
			if f != nil {
				f.Close()
			}
			return holder, err
		}
		newer, err := writtenMeanwhile(f, primary, expect)
		f.Close()
		if err != nil || newer == nil {
			return holder, err
		}
		if attempt == 3 {
			// Give the primary's newest version back to the runtime as it wrote it; the next
			// event (this write) adds the entry to it.
			if _, err := a.writeConfig(holder, newer, mode); err != nil {
				return holder, err
			}
			return holder, &raceError{fmt.Sprintf("%s keeps being rewritten in place while detour adds its entry; trying again", primary)}
		}
		a.log.Warn("the primary rewrote its configuration in place while detour replaced the file; adding the entry to its new version", "file", primary)
		data, f = newer, nil
		if filepath.Ext(primary) != ".conflist" {
			continue // the converted .conf is gone: convert its newer version, nothing to watch
		}
		// The next write replaces the file just written. The primary may have written into it
		// too, after the rename: that is then the newest version.
		if f, err = os.Open(holder); err != nil {
			return holder, changed
		}
		if expect, err = readAt(f); err != nil {
			f.Close()
			return holder, changed
		}
		if _, lerr := LoadNetwork(primary, expect); lerr == nil && !hasEntry(expect) {
			data = expect
		}
	}
}

// putEntry writes data with detour's entry: into file (primary, or its symlink's target) when
// primary is a conflist, else into the conflist converted from it (removing primary). It
// reports the file that holds the entry and whether it wrote.
func (a *Agent) putEntry(primary, file string, data []byte, mode fs.FileMode) (string, bool, error) {
	if filepath.Ext(primary) == ".conflist" {
		out, changed, err := InsertEntry(data, a.cfg.Entry)
		if err != nil {
			return file, false, fmt.Errorf("add detour's entry to %s: %w", file, err)
		}
		if !changed {
			return file, false, nil
		}
		a.beforeReplace()
		if _, err := a.writeConfig(file, out, mode); err != nil {
			return file, false, err
		}
		a.log.Info("added detour's entry to the primary CNI configuration", "file", file)
		return file, true, nil
	}

	target := strings.TrimSuffix(primary, filepath.Ext(primary)) + ".conflist"
	if existing, err := os.ReadFile(target); err == nil {
		// Overwrite only a list this agent made from the same network earlier.
		if !hasEntry(existing) {
			return primary, false, fmt.Errorf("cannot convert %s into %s: that file already exists and was not written by detour; remove one of them", primary, target)
		}
	}
	list, err := ConvertConf(data)
	if err != nil {
		return primary, false, fmt.Errorf("convert %s into a conflist: %w", primary, err)
	}
	out, _, err := InsertEntry(list, a.cfg.Entry)
	if err != nil {
		return primary, false, fmt.Errorf("add detour's entry to the conflist made from %s: %w", primary, err)
	}
	a.beforeReplace()
	if _, err := a.writeConfig(target, out, mode); err != nil {
		return primary, false, err
	}
	if _, err := removeFile(primary); err != nil {
		return primary, false, err
	}
	a.log.Info("converted the primary CNI configuration into a conflist with detour's entry", "from", primary, "to", target)
	if now, err := Primary(a.cfg.ConfDir); err == nil && now != target {
		return target, true, fmt.Errorf("converted %s into %s, but the runtime now loads %s first", primary, target, now)
	}
	return target, true, nil
}

// writtenMeanwhile reads f — the primary's file as it was before the agent replaced or removed
// it — again: nil when it still holds data; its new content when the primary wrote to it in
// place meanwhile, once that is a configuration the runtime could load (a writer half-way is
// given up to a second).
func writtenMeanwhile(f *os.File, path string, data []byte) ([]byte, error) {
	deadline := time.Now().Add(time.Second)
	for {
		now, err := readAt(f)
		if err != nil {
			return nil, fmt.Errorf("read %s again after replacing it: %w", path, err)
		}
		if bytes.Equal(now, data) {
			return nil, nil
		}
		if _, err := LoadNetwork(path, now); err == nil {
			return now, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s was rewritten in place while detour replaced it, and its new content is not a valid configuration after a second: that version of the primary's file is lost; have the primary write it again", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readAt reads all of f from its start.
func readAt(f *os.File) ([]byte, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	buf := make([]byte, st.Size())
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return buf[:n], nil
}

// raceError is a write of the primary's that met the agent's: retried at once by the next
// event, it does not make the node lose its ready label.
type raceError struct{ msg string }

func (e *raceError) Error() string { return e.msg }

func isRace(err error) bool {
	_, ok := errors.AsType[*raceError](err)
	return ok
}

// removeEntry takes detour's entries out of the conflist primary (holding data, in file), if it
// has any.
func (a *Agent) removeEntry(primary, file string, data []byte) error {
	if filepath.Ext(primary) != ".conflist" || !hasEntry(data) {
		return nil
	}
	primary = file
	out, changed, err := RemoveEntries(data)
	if err != nil {
		return fmt.Errorf("remove detour's entry from %s: %w", primary, err)
	}
	if !changed {
		return nil
	}
	if _, err := a.writeConfig(primary, out, fileMode(primary)); err != nil {
		return err
	}
	a.log.Warn("removed detour's entry from the primary CNI configuration", "file", primary)
	return nil
}

// writeConfig writes data atomically, and only on change, to path: a configuration file the
// runtime loads (the primary's, or the conflist converted from it). Every write of the agent's
// to such a file goes through here, so that the war (entrywar.go) learns of each: an entry the
// agent took out itself must never count as one the primary took out, nor its own write as the
// primary's.
func (a *Agent) writeConfig(path string, data []byte, mode fs.FileMode) (bool, error) {
	wrote, err := fsutil.WriteFileAtomic(path, data, mode)
	// Even after an error: the rename may have happened. Forgetting an entry that is still
	// there only misses one drop; counting one the agent removed could refuse a healthy node.
	a.war.wrote(path, hasEntry(data))
	return wrote, err
}

func fileMode(path string) fs.FileMode {
	if st, err := os.Stat(path); err == nil {
		return st.Mode().Perm()
	}
	return 0o644
}
