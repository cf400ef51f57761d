package nodeagent

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/containernetworking/cni/libcni"

	"github.com/detourmesh/detour/cniplugin"
)

// configExtensions are the files a runtime loads as networks (containerd's and CRI-O's list).
var configExtensions = []string{".conf", ".conflist", ".json"}

func isConfigFile(name string) bool {
	ext := filepath.Ext(name)
	for _, e := range configExtensions {
		if ext == e {
			return true
		}
	}
	return false
}

// Primary returns the network configuration file the runtime uses in dir — the first, in
// lexical order, with a .conf, .conflist or .json extension, as containerd and CRI-O load them
// through libcni — or "" when there is none.
func Primary(dir string) (string, error) {
	files, err := libcni.ConfFiles(dir, configExtensions)
	if err != nil {
		return "", fmt.Errorf("list %s: %w", dir, err)
	}
	sort.Strings(files)
	if len(files) == 0 {
		return "", nil
	}
	return files[0], nil
}

// LoadNetwork parses a configuration file (.conflist, or a .conf as a one-plugin list) the
// way the runtime does.
func LoadNetwork(path string, data []byte) (*libcni.NetworkConfigList, error) {
	if filepath.Ext(path) == ".conflist" {
		return libcni.ConfListFromBytes(data)
	}
	conf, err := libcni.ConfFromBytes(data)
	if err != nil {
		return nil, err
	}
	return libcni.ConfListFromConf(conf)
}

// editable returns the file to edit for the configuration at path: path itself or, when it is
// a symlink, the file it leads to. The primary keeps updating that file; replacing the link with
// a file of the agent's would make the runtime ignore those updates for good. A link whose
// target is not inside the CNI config directory as the agent's container sees it (an absolute
// host path elsewhere, a relative one that leaves the directory) is refused: the agent cannot
// edit what is not mounted. An absolute target in the host's CNI config directory is followed
// through the mount.
func (a *Agent) editable(path string) (string, error) {
	cur := path
	for range 8 {
		st, err := os.Lstat(cur)
		if err != nil {
			return "", fmt.Errorf("inspect %s: %w", cur, err)
		}
		if st.Mode()&fs.ModeSymlink == 0 {
			return cur, nil
		}
		target, err := os.Readlink(cur)
		if err != nil {
			return "", fmt.Errorf("read the symlink %s: %w", cur, err)
		}
		next := target
		switch {
		case !filepath.IsAbs(target):
			next = filepath.Join(filepath.Dir(cur), target)
		case within(a.cfg.HostConfDir, target):
			rel, _ := filepath.Rel(a.cfg.HostConfDir, target)
			next = filepath.Join(a.cfg.ConfDir, rel)
		}
		if !within(a.cfg.ConfDir, next) {
			return "", &refusedError{fmt.Sprintf("%s is a symlink to %s, outside the CNI config directory %s that the agent's container sees: detour cannot add its entry there; point the link at a file in the directory, or have the primary write the file itself", path, target, a.cfg.HostConfDir)}
		}
		cur = next
	}
	return "", &refusedError{fmt.Sprintf("%s is a chain of more than 8 symlinks", path)}
}

// within reports whether path is inside dir (both clean and absolute).
func within(dir, path string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// firstPluginType is the type of list's first plugin (the primary's own), or "".
func firstPluginType(list *libcni.NetworkConfigList) string {
	if len(list.Plugins) == 0 || list.Plugins[0].Network == nil {
		return ""
	}
	return list.Plugins[0].Network.Type
}

// refusedError is a primary configuration the agent will not chain into, with what to do. The
// agent stays not ready, logs it, records it as an Event on the node and `detour check` shows it.
type refusedError struct{ msg string }

func (e *refusedError) Error() string { return e.msg }

// SupportedCNIVersions are the CNI spec versions a primary configuration may declare for the
// agent to chain detour-cni into it: the ones the plugin speaks.
func SupportedCNIVersions() []string { return cniplugin.VersionInfo.SupportedVersions() }

// CheckCNIVersion returns an error when the network's cniVersion (as the runtime resolves it,
// "cniVersions" included; none means 0.1.0) is one detour-cni does not speak: the runtime would
// then fail every ADD on the node with "incompatible CNI versions".
func CheckCNIVersion(list *libcni.NetworkConfigList) error {
	v := list.CNIVersion
	if slices.Contains(SupportedCNIVersions(), v) {
		return nil
	}
	shown := fmt.Sprintf("cniVersion %q", v)
	if v == "" {
		shown = "no cniVersion (which means 0.1.0)"
	}
	return fmt.Errorf("network %q declares %s, which %s does not speak (it speaks %s): chaining it in would fail every pod's sandbox on this node; have the primary CNI write cniVersion 0.3.0 or later",
		list.Name, shown, PluginType, strings.Join(SupportedCNIVersions(), ", "))
}

func checkVersion(primary string, list *libcni.NetworkConfigList) error {
	if err := CheckCNIVersion(list); err != nil {
		return &refusedError{fmt.Sprintf("refusing to chain %s into %s: %v", PluginType, primary, err)}
	}
	return nil
}

// checkPluginDir refuses a network that loads plugins from <dir>/<network name>/ (CNI 1.1)
// which the runtime would run after detour's: libcni runs those after the inline ones, in
// lexical order, so an in-file entry would not follow any of them, and detour's drop-in would
// not follow those that sort after it. detour's own drop-ins do not count.
func checkPluginDir(dir string, list *libcni.NetworkConfigList, mode Mode) error {
	if list.LoadOnlyInlinedPlugins || list.Name == "" {
		return nil
	}
	pluginDir := filepath.Join(dir, list.Name)
	files, err := libcni.ConfFiles(pluginDir, []string{".conf"})
	if err != nil {
		return nil
	}
	var after []string
	for _, f := range files {
		if data, err := os.ReadFile(f); err == nil && isEntry(data) {
			continue
		}
		if mode == ModeDropIn && filepath.Base(f) < DropInName {
			continue
		}
		after = append(after, filepath.Base(f))
	}
	switch {
	case len(after) == 0:
		return nil
	case mode == ModeDropIn:
		return fmt.Errorf("network %q loads %s from %s after detour's drop-in %s: rename them to sort before it, or move them into the conflist's \"plugins\"", list.Name, strings.Join(after, ", "), pluginDir, DropInName)
	}
	return fmt.Errorf("network %q also loads plugins from %s, which the runtime runs after detour's entry: move them into the conflist's \"plugins\", set \"loadOnlyInlinedPlugins\": true, or use cniConfigMode drop-in", list.Name, pluginDir)
}
