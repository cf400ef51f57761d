package nodeagent

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/detourmesh/detour/internal/fsutil"
)

// removeFile removes path; a file that is not there is fine. It reports whether it removed one.
func removeFile(path string) (bool, error) {
	err := os.Remove(path)
	switch {
	case err == nil:
		return true, fsutil.SyncDir(filepath.Dir(path))
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	default:
		return false, fmt.Errorf("remove %s: %w", path, err)
	}
}

// isTemp reports whether name is one of the agent's temporary files.
func isTemp(name string) bool { return strings.HasPrefix(filepath.Base(name), fsutil.TempPrefix) }
