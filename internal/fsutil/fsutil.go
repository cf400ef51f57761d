// Package fsutil writes files the way a reader on the same node must see them: whole, old or
// new, never a part (the node agent's CNI configuration, the plugin's state).
package fsutil

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// TempPrefix starts the name of every temporary file written here. Temporary files have no
// CNI extension either, so a runtime listing a directory never loads a half-written one.
const TempPrefix = ".detour-tmp-"

// WriteFileAtomic makes path hold data with mode perm, unless it already does: it writes a
// temporary file in the same directory, syncs it, renames it over path and syncs the directory,
// so a reader sees the old content or the new one, never a part. It reports whether it wrote.
func WriteFileAtomic(path string, data []byte, perm fs.FileMode) (bool, error) {
	if cur, err := os.ReadFile(path); err == nil && bytes.Equal(cur, data) {
		if st, err := os.Stat(path); err == nil && st.Mode().Perm() == perm {
			return false, nil
		}
	}
	return true, ReplaceFile(path, perm, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// replaceFile atomically replaces path with what write writes (see WriteFileAtomic).
func ReplaceFile(path string, perm fs.FileMode, write func(io.Writer) error) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, TempPrefix+filepath.Base(path)+"-")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	done := false
	defer func() {
		if !done {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := write(tmp); err != nil {
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Chmod(perm); err != nil {
		return fmt.Errorf("chmod %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmp.Name(), path, err)
	}
	done = true
	return SyncDir(dir)
}

func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
