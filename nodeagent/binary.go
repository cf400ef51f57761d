package nodeagent

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
	"time"
)

// fileID identifies a file's content cheaply: if none of these changed, neither did the file.
type fileID struct {
	ino   uint64
	size  int64
	mtime time.Time
}

func statID(path string) (fileID, error) {
	st, err := os.Stat(path)
	if err != nil {
		return fileID{}, err
	}
	id := fileID{size: st.Size(), mtime: st.ModTime()}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		id.ino = sys.Ino
	}
	return id, nil
}

// binaryInstaller keeps the plugin binary in the CNI bin dir identical to its source.
type binaryInstaller struct {
	source, dest string
	// checked is the pair of files last found identical; while neither changes, nothing is
	// read again.
	checked [2]fileID
}

// ensure installs the binary when the destination is missing or differs from the source,
// atomically: a runtime executing it meanwhile runs the old binary or the new one, never a
// half-written one. It reports whether it wrote.
func (b *binaryInstaller) ensure() (bool, error) {
	src, err := statID(b.source)
	if err != nil {
		return false, fmt.Errorf("the plugin binary to install is missing: %w (the detour image ships it at /opt/detour/bin/%s; see --plugin-source)", err, PluginType)
	}
	dst, err := statID(b.dest)
	if err == nil && [2]fileID{src, dst} == b.checked {
		return false, nil
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("inspect %s: %w", b.dest, err)
	}
	if err == nil {
		same, err := sameContent(b.source, b.dest)
		if err != nil {
			return false, err
		}
		if same {
			b.checked = [2]fileID{src, dst}
			return false, nil
		}
	}
	in, err := os.Open(b.source)
	if err != nil {
		return false, fmt.Errorf("open the plugin binary: %w", err)
	}
	defer in.Close()
	if err := replaceFile(b.dest, 0o755, func(w io.Writer) error {
		_, err := io.Copy(w, in)
		return err
	}); err != nil {
		return false, fmt.Errorf("install %s: %w", PluginType, err)
	}
	if dst, err = statID(b.dest); err == nil {
		b.checked = [2]fileID{src, dst}
	}
	return true, nil
}

func sameContent(a, b string) (bool, error) {
	ha, err := hashFile(a)
	if err != nil {
		return false, err
	}
	hb, err := hashFile(b)
	if err != nil {
		return false, err
	}
	return bytes.Equal(ha, hb), nil
}

func hashFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	return h.Sum(nil), nil
}
