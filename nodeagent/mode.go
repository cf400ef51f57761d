package nodeagent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/version"
)

// Mode is how detour's plugin configuration reaches the runtime.
type Mode string

const (
	// ModeAuto picks ModeDropIn when the node's runtime loads drop-ins and the primary's
	// configuration allows them, else ModeChainedEntry.
	ModeAuto Mode = "auto"
	// ModeDropIn writes the plugin's configuration as <conf dir>/<network name>/DropInName,
	// which libcni (1.2+) appends to the network's inlined plugins. The primary rewriting its
	// own file never touches it.
	ModeDropIn Mode = "drop-in"
	// ModeChainedEntry appends detour's entry to the primary's conflist, and puts it back
	// whenever the primary rewrites the file.
	ModeChainedEntry Mode = "chained-entry"
)

// ModeFileName is the file in the conf dir where the agent records the mode it chose and why
// (two lines), for `detour check`. It has no CNI extension: no runtime loads it.
const ModeFileName = "detour-cni.mode"

// ReadModeFile returns the mode and reason the agent recorded in dir, or empty strings.
func ReadModeFile(dir string) (Mode, string) {
	data, err := os.ReadFile(filepath.Join(dir, ModeFileName))
	if err != nil {
		return "", ""
	}
	mode, reason, _ := strings.Cut(strings.TrimSpace(string(data)), "\n")
	return Mode(mode), reason
}

// Minimum runtime versions that load <conf dir>/<network name>/*.conf drop-ins (through libcni
// 1.2+, ConfListFromFile).
var dropInRuntimes = map[string]*version.Version{
	"containerd": version.MustParseGeneric("2.1.0"),
	"cri-o":      version.MustParseGeneric("1.33.0"),
}

// RuntimeLoadsDropIns reports whether the container runtime a node reports
// (status.nodeInfo.containerRuntimeVersion, such as "containerd://2.4.2") loads CNI drop-ins,
// and says why for people.
func RuntimeLoadsDropIns(runtime string) (bool, string) {
	name, v, ok := strings.Cut(runtime, "://")
	if !ok {
		return false, fmt.Sprintf("the runtime %q is not one detour knows loads drop-ins", runtime)
	}
	min, known := dropInRuntimes[name]
	if !known {
		return false, fmt.Sprintf("the runtime %s is not one detour knows loads drop-ins (containerd >= 2.1, CRI-O >= 1.33)", runtime)
	}
	have, err := version.ParseGeneric(v)
	if err != nil {
		return false, fmt.Sprintf("the runtime %s has a version detour cannot read", runtime)
	}
	if have.LessThan(min) {
		return false, fmt.Sprintf("%s %s loads no drop-ins (it needs %s or later)", name, v, min)
	}
	return true, fmt.Sprintf("%s %s loads drop-ins (%s or later)", name, v, min)
}

// ParseMode validates a --cni-config-mode value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeAuto, ModeDropIn, ModeChainedEntry:
		return m, nil
	}
	return "", flagError("--cni-config-mode", s, `must be "auto", "drop-in" or "chained-entry"`)
}

// ChooseMode decides how detour's configuration reaches the runtime, and why. configured is
// the setting; runtime is the node's containerRuntimeVersion ("" when unknown); conflist
// reports whether the primary is a .conflist (runtimes load drop-ins only for a list);
// inlinedOnly is the list's loadOnlyInlinedPlugins; dropInThere reports whether detour's
// drop-in exists already (an unknown runtime keeps what an earlier agent chose).
func ChooseMode(configured Mode, runtime string, conflist, inlinedOnly, dropInThere bool) (Mode, string) {
	switch {
	case !conflist:
		return ModeChainedEntry, "the primary's file is a single-plugin configuration, for which runtimes load no drop-ins"
	case inlinedOnly:
		return ModeChainedEntry, `the primary's conflist sets "loadOnlyInlinedPlugins": true, so the runtime would ignore a drop-in`
	case configured == ModeDropIn:
		return ModeDropIn, "cniConfigMode is drop-in"
	case configured == ModeChainedEntry:
		return ModeChainedEntry, "cniConfigMode is chained-entry"
	case runtime == "" && dropInThere:
		return ModeDropIn, "cniConfigMode is auto, the node's runtime is unknown (no node client, or the API is unreachable) and detour's drop-in is there already"
	case runtime == "":
		return ModeChainedEntry, "cniConfigMode is auto and the node's runtime is unknown (no node client, or the API is unreachable)"
	}
	ok, why := RuntimeLoadsDropIns(runtime)
	if ok {
		return ModeDropIn, "cniConfigMode is auto and " + why
	}
	return ModeChainedEntry, "cniConfigMode is auto and " + why
}

// runtimeVersion returns the node's container runtime and version
// (status.nodeInfo.containerRuntimeVersion), read at most every runtimeRecheck: a runtime
// upgraded in place changes the mode auto picks. It returns the last one read when the API
// fails, and "" without a node client.
func (a *Agent) runtimeVersion(ctx context.Context) string {
	if a.node == nil || a.cfg.Mode != ModeAuto {
		return a.runtime
	}
	if !a.runtimeAt.IsZero() && a.now().Sub(a.runtimeAt) < runtimeRecheck {
		return a.runtime
	}
	v, err := a.node.runtime(ctx)
	if err != nil {
		a.log.Warn("cannot read the node's container runtime; keeping the last one", "runtime", a.runtime, "err", err)
		return a.runtime
	}
	a.runtime, a.runtimeAt = v, a.now()
	return v
}

// runtimeRecheck is how often the agent reads the node's container runtime again.
const runtimeRecheck = 5 * time.Minute
