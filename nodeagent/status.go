package nodeagent

import (
	"cmp"
	"fmt"
	"time"
)

// Status is what the last reconcile found.
type Status struct {
	// Primary is the runtime's network configuration file, empty while there is none.
	Primary string
	// Mode is how detour's configuration reaches the runtime, as the agent chose it (empty
	// before it could choose), and ModeReason why.
	Mode       Mode
	ModeReason string
	// Entry is the file that holds detour's configuration: the primary's conflist
	// (ModeChainedEntry) or the drop-in (ModeDropIn).
	Entry string
	// EntryInPlace: the primary holds detour's entry, or detour's drop-in is in place, and the
	// binary is installed.
	EntryInPlace bool
	// ConfigInPlace: the entry is in place, the kubeconfig exists, and the plugin's token is
	// written (and, when requested for its own service account, unexpired).
	ConfigInPlace bool
	// NodeReady: the startup taint is gone and the ready label set (always false without a
	// node client).
	NodeReady bool
	// PluginTokenExpires is when the plugin's token expires, when the agent requests it for
	// the plugin's own service account (zero when the plugin gets a copy of the agent's).
	PluginTokenExpires time.Time
	// Uninstalled: Uninstall removed everything (the state `--uninstall --hold` reports).
	Uninstalled bool
	// Reason says, for people, why the agent is not ready.
	Reason string
}

// Ready reports whether the node is ready for injected pods: the config is in place and, when
// node readiness is enabled, the node is marked.
func (s Status) Ready(nodeEnabled bool) bool {
	return s.ConfigInPlace && (s.NodeReady || !nodeEnabled)
}

// Status returns what the last reconcile found.
func (a *Agent) Status() Status {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.status
}

// Ready reports whether the node is ready for injected pods, and why not. After Uninstall
// succeeded it reports ready too: the node is clean (what `--uninstall --hold` waits on).
func (a *Agent) Ready() (bool, string) {
	s := a.Status()
	switch {
	case s.Uninstalled:
		return true, cmp.Or(s.Reason, "detour is uninstalled from this node")
	case !s.Ready(a.node != nil):
		return false, s.Reason
	case a.tokens == nil:
		return true, fmt.Sprintf("detour's CNI entry is in place in %s (%s: %s)", s.Entry, s.Mode, s.ModeReason)
	case !a.now().Before(s.PluginTokenExpires):
		// The reconcile scheduled at the expiry reports why; this covers the moment until then.
		return false, fmt.Sprintf("the plugin's token for service account %s expired at %s and has not been renewed yet (see the agent's log)",
			a.tokens.account(), s.PluginTokenExpires.Format(time.RFC3339))
	default:
		return true, fmt.Sprintf("detour's CNI entry is in place in %s (%s: %s); the plugin's token for service account %s is valid until %s",
			s.Entry, s.Mode, s.ModeReason, a.tokens.account(), s.PluginTokenExpires.Format(time.RFC3339))
	}
}

func (a *Agent) setStatus(s Status) {
	a.mu.Lock()
	a.status = s
	a.mu.Unlock()
}
