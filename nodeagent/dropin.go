package nodeagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/detourmesh/detour/internal/fsutil"
)

// DropInName is the file name of detour's drop-in in <conf dir>/<network name>/. libcni loads
// the directory's *.conf files in lexical order after the inlined plugins; "zz-" puts detour's
// after the others.
const DropInName = "zz-detour-cni.conf"

// ensureDropIn puts detour's configuration in place as the drop-in of network name, takes any
// entry out of the primary's conflist (first: never both at once) and any other drop-in of
// detour's away, and makes the runtime reload when the drop-ins changed. It returns the
// drop-in's path.
func (a *Agent) ensureDropIn(primary, file string, data []byte, name string) (string, error) {
	if err := a.removeEntry(primary, file, data); err != nil {
		return "", err
	}
	path := filepath.Join(a.cfg.ConfDir, name, DropInName)
	content, err := formatDropIn(a.cfg.Entry)
	if err != nil {
		return path, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return path, fmt.Errorf("create the drop-in directory of network %q: %w", name, err)
	}
	wrote, err := fsutil.WriteFileAtomic(path, content, 0o644)
	if err != nil {
		return path, fmt.Errorf("write detour's drop-in: %w", err)
	}
	removed, err := a.removeDropIns(path)
	if err != nil {
		return path, err
	}
	if wrote && !removed {
		// removeDropIns made the runtime reload already when it removed one.
		if err := pokeRuntime(a.cfg.ConfDir); err != nil {
			return path, err
		}
	}
	if wrote {
		a.log.Info("wrote detour's drop-in and made the runtime reload", "file", path)
	}
	return path, nil
}

// removeDropIns removes every drop-in of detour's in the conf dir's subdirectories but keep,
// and the directories it leaves empty; then it makes the runtime reload. It reports whether it
// removed one.
func (a *Agent) removeDropIns(keep string) (bool, error) {
	files, err := dropInFiles(a.cfg.ConfDir)
	if err != nil {
		return false, err
	}
	removed := false
	var errs []error
	for _, f := range files {
		if f == keep {
			continue
		}
		if _, err := removeFile(f); err != nil {
			errs = append(errs, fmt.Errorf("remove detour's drop-in: %w", err))
			continue
		}
		removed = true
		a.log.Info("removed detour's drop-in", "file", f)
		if err := os.Remove(filepath.Dir(f)); err == nil {
			_ = fsutil.SyncDir(a.cfg.ConfDir)
		}
	}
	if removed {
		if err := pokeRuntime(a.cfg.ConfDir); err != nil {
			errs = append(errs, err)
		}
	}
	return removed, errors.Join(errs...)
}

// dropInFiles returns every drop-in of detour's under dir: each *.conf file, in any of dir's
// subdirectories, whose type is detour-cni.
func dropInFiles(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	var found []string
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		sub := filepath.Join(dir, e.Name())
		files, err := os.ReadDir(sub)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", sub, err)
		}
		for _, f := range files {
			if f.IsDir() || filepath.Ext(f.Name()) != ".conf" {
				continue
			}
			path := filepath.Join(sub, f.Name())
			data, err := os.ReadFile(path)
			if err != nil {
				return nil, fmt.Errorf("read %s: %w", path, err)
			}
			if isEntry(data) {
				found = append(found, path)
			}
		}
	}
	return found, nil
}

// formatDropIn is the drop-in's content: detour's entry, indented.
func formatDropIn(entry []byte) ([]byte, error) {
	var out bytes.Buffer
	if err := json.Indent(&out, entry, "", "  "); err != nil {
		return nil, fmt.Errorf("format detour's drop-in: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// pokeRuntime makes a runtime that watches dir (containerd watches the conf dir, not its
// subdirectories) reload its CNI configuration: it writes and removes a temporary file there.
// containerd reloads on a write, a rename or a removal in the directory, whatever the file;
// the temporary file has no CNI extension, so no one loads it.
func pokeRuntime(dir string) error {
	f, err := os.CreateTemp(dir, fsutil.TempPrefix+"reload-")
	if err != nil {
		return fmt.Errorf("make the runtime reload its CNI configuration: %w", err)
	}
	_, werr := f.Write([]byte("reload\n"))
	cerr := f.Close()
	if err := os.Remove(f.Name()); err != nil {
		return fmt.Errorf("make the runtime reload its CNI configuration: %w", err)
	}
	if err := errors.Join(werr, cerr); err != nil {
		return fmt.Errorf("make the runtime reload its CNI configuration: %w", err)
	}
	return nil
}
