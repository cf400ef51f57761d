package nodeagent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// exclusiveSuffixes are what primaries that claim the CNI config directory exclusively add to
// the name of every other configuration file, so the runtime stops loading it (Cilium with
// cni.exclusive, its default, renames them to *.cilium_bak).
var exclusiveSuffixes = map[string]string{
	".cilium_bak": "Cilium claims the CNI config directory (its Helm value cni.exclusive, true by default): set cni.exclusive=false in Cilium's values",
}

// RenamedAway returns the files in dir that hold detour's configuration and that a primary
// claiming the directory exclusively renamed away, each with what to change.
func RenamedAway(dir string) (files, fixes []string, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("list %s: %w", dir, err)
	}
	for _, e := range entries {
		fix, ok := exclusiveSuffixes[filepath.Ext(e.Name())]
		if e.IsDir() || !ok || !isConfigFile(strings.TrimSuffix(e.Name(), filepath.Ext(e.Name()))) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, nil, fmt.Errorf("read %s: %w", path, err)
		}
		if hasEntry(data) || isEntry(data) {
			files, fixes = append(files, path), append(fixes, fix)
		}
	}
	return files, fixes, nil
}

// checkExclusive refuses to go on while a primary that claims the directory exclusively has
// renamed detour's configuration away: it would keep doing so, and pods would start without
// their redirect between its rename and the agent's next write.
func checkExclusive(dir string) error {
	files, fixes, err := RenamedAway(dir)
	if err != nil || len(files) == 0 {
		return err
	}
	return &refusedError{fmt.Sprintf("the primary CNI renamed detour's configuration away (%s): %s; then delete %s", strings.Join(files, ", "), fixes[0], strings.Join(files, ", "))}
}
