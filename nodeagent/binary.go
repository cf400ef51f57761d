package nodeagent

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/internal/fsutil"
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
	if err := checkWritable(filepath.Dir(b.dest)); err != nil {
		return false, err
	}
	in, err := os.Open(b.source)
	if err != nil {
		return false, fmt.Errorf("open the plugin binary: %w", err)
	}
	defer in.Close()
	if err := fsutil.ReplaceFile(b.dest, 0o755, func(w io.Writer) error {
		_, err := io.Copy(w, in)
		return err
	}); err != nil {
		if errors.Is(err, syscall.EROFS) {
			return false, readOnlyBinDir(filepath.Dir(b.dest))
		}
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

// checkWritable refuses a CNI bin dir on a read-only filesystem (GKE's COS, Talos, Flatcar and
// Bottlerocket mount /opt read-only): the plugin cannot be installed there, and the runtime
// must be pointed at another directory.
func checkWritable(dir string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("inspect the CNI bin dir %s: %w", dir, err)
	}
	if st.Flags&unix.ST_RDONLY != 0 {
		return readOnlyBinDir(dir)
	}
	return nil
}

func readOnlyBinDir(dir string) error {
	return &refusedError{fmt.Sprintf("the CNI bin dir %s is on a read-only filesystem, so %s cannot be installed: set the chart value nodeAgent.cniBinDir (--cni-bin-dir) to the writable directory the node's runtime searches for CNI plugins, such as /home/kubernetes/bin on GKE (docs/operations.md, \"Platform presets\")", dir, PluginType)}
}
