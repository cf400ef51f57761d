package nodeagent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/fsutil"
)

// Reconcile makes the node's CNI configuration what it should be, once: nothing while the
// primary CNI has written no configuration; otherwise the binary, the token copy and the
// kubeconfig, then detour's entry in the primary configuration (converting a .conf into a
// .conflist), each written only when it differs, then the node marked ready. It returns the
// resulting status; an error leaves the agent not ready and is retried on the next event or
// resync.
func (a *Agent) Reconcile(ctx context.Context) (Status, error) {
	before := a.Status()
	s, err := a.reconcile(ctx)
	if err != nil {
		s.Reason = err.Error()
		if ctx.Err() == nil {
			a.metrics.reconcileErrors.WithLabelValues(errorReason(err)).Inc()
		}
	}
	a.setStatus(s)
	if _, refused := errors.AsType[*refusedError](err); refused && s.Reason != before.Reason && a.node != nil {
		if eerr := a.node.event(ctx, EventReason, s.Reason); eerr != nil {
			a.log.Warn("could not record the refusal as an event on the node", "err", eerr)
		}
	}
	return s, err
}

func (a *Agent) reconcile(ctx context.Context) (Status, error) {
	s, err := a.reconcileFiles(ctx)
	if a.node == nil {
		return s, err
	}
	prev := a.Status()
	switch {
	case err == nil && s.ConfigInPlace:
		// The node is read and patched when the config comes into place, and when the Node
		// changed in what the marks depend on (its kubelet or runtime replaced in place, the
		// object registered again), not on every resync: a GET per node every few seconds
		// would add up on a large cluster.
		if !prev.NodeReady || a.nodeChanged {
			a.nodeChanged = false
			patched, err := a.node.markReady(ctx)
			if err != nil {
				return s, withReason(ReasonNodeAPI, fmt.Errorf("mark node %s ready: %w", a.node.name, err))
			}
			if patched {
				a.log.Info("node ready for injected pods", "node", a.node.name, "removedTaint", a.node.taint, "label", "detour.dev/cni-ready=true")
			}
		}
		a.labelRemoved = false
		s.NodeReady = true
	case !s.EntryInPlace && isRace(err):
		s.NodeReady = prev.NodeReady // the next event retries at once: no label flapping
	case !s.EntryInPlace:
		// The label follows the entry after the first readiness too (a reboot where the primary
		// writes its file first, a refused primary, an operator's mistake): repair's gate and
		// workloads' node selectors must not trust a node whose pods get no redirect.
		if !a.labelRemoved {
			removed, uerr := a.node.unmarkReady(ctx)
			if uerr != nil {
				return s, errors.Join(err, withReason(ReasonNodeAPI, fmt.Errorf("remove node %s's ready label: %w", a.node.name, uerr)))
			}
			if removed {
				a.log.Warn("removed the node's ready label: detour's entry is not in place", "node", a.node.name, "label", annotations.CNIReadyLabel, "reason", cmp.Or(errString(err), s.Reason))
			}
			a.labelRemoved = true
		}
	default:
		// The entry is in place but the plugin's kubeconfig or token is not: pods whose
		// annotations come from the runtime get their redirect, the others fail closed and are
		// retried, so no pod starts without its redirect. The label stays as it was.
		s.NodeReady = prev.NodeReady
	}
	return s, err
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// reconcileFiles is the file part of Reconcile: the binary, the kubeconfig and token, the entry.
func (a *Agent) reconcileFiles(ctx context.Context) (Status, error) {
	var s Status
	primary, err := Primary(a.cfg.ConfDir)
	if err != nil {
		return s, err
	}
	if primary == "" {
		s.Reason = fmt.Sprintf("waiting for the primary CNI to write its configuration into %s", a.cfg.ConfDir)
		return s, nil
	}
	s.Primary = primary
	if err := checkExclusive(a.cfg.ConfDir); err != nil {
		return s, err
	}
	data, err := os.ReadFile(primary)
	if err != nil {
		return s, fmt.Errorf("read the primary CNI configuration: %w", err)
	}
	a.metrics.sawPrimary(primary, data)
	defer func() {
		// What the agent leaves as the primary (its entry added, a .conf converted) is not a
		// rewrite at the next pass; the path is the one the next pass looks up (a symlink's).
		if now, err := Primary(a.cfg.ConfDir); err == nil && now != "" {
			if content, err := os.ReadFile(now); err == nil {
				a.metrics.leftPrimary(now, content)
			}
		}
	}()
	// A file the runtime cannot load either is not touched: the primary may be writing it.
	list, err := LoadNetwork(primary, data)
	if err != nil {
		s.Reason = fmt.Sprintf("waiting for %s to become a valid CNI configuration (%v)", primary, err)
		return s, nil
	}
	dropIns, err := dropInFiles(a.cfg.ConfDir)
	if err != nil {
		return s, err
	}
	s.Mode, s.ModeReason = ChooseMode(a.cfg.Mode, a.runtimeVersion(ctx), filepath.Ext(primary) == ".conflist", list.LoadOnlyInlinedPlugins, len(dropIns) > 0)
	if decision := string(s.Mode) + ": " + s.ModeReason; decision != a.modeLogged {
		a.log.Info("chose how detour's configuration reaches the runtime", "mode", s.Mode, "reason", s.ModeReason)
		a.modeLogged = decision
	}
	if err := checkPluginDir(a.cfg.ConfDir, list, s.Mode); err != nil {
		return s, err
	}
	// A primary that is a symlink is edited through it: the file the primary keeps updating.
	file, err := a.editable(primary)
	if err != nil {
		return s, err
	}
	if filepath.Ext(primary) != ".conflist" && file != primary {
		return s, &refusedError{fmt.Sprintf("%s is a symlink to a single-plugin configuration: detour would have to replace it with a .conflist, and the primary's later updates to %s would be ignored; make the primary write a .conflist, or replace the link with the file", primary, file)}
	}
	if err := checkVersion(primary, list); err != nil {
		// Chained into a version the plugin does not speak, detour's entry would fail every
		// ADD on the node, injected pods or not: take it out if an earlier agent put it there.
		if rerr := a.removeEntry(primary, file, data); rerr != nil {
			return s, errors.Join(err, rerr)
		}
		if _, rerr := a.removeDropIns(""); rerr != nil {
			return s, errors.Join(err, rerr)
		}
		return s, err
	}

	if wrote, err := a.binary.ensure(); err != nil {
		return s, err
	} else if wrote {
		a.log.Info("installed the plugin binary", "path", a.binary.dest, "source", a.binary.source)
	}
	// The entry never waits for the API: a plugin token that cannot be requested (the API
	// server unreachable after a reboot, RBAC missing) or that expired leaves the agent not
	// ready, but the entry goes back in place. Pods whose annotations come from the runtime
	// need no token, the kubeconfig and token an earlier agent wrote stay in place and keep
	// working until they expire, and any other pod fails closed and is retried.
	wrote, expires, kubeconfigErr := a.ensureKubeconfig(ctx)
	kubeconfigErr = withReason(ReasonPluginCredentials, kubeconfigErr)
	if wrote {
		a.log.Info("wrote the plugin's kubeconfig and token", "kubeconfig", a.cfg.KubeconfigPath, "token", a.cfg.TokenPath)
	}
	s.PluginTokenExpires = expires
	if s.Mode == ModeDropIn {
		s.Entry, err = a.ensureDropIn(primary, file, data, list.Name)
	} else {
		// A primary that takes the entry out as fast as it goes in is refused (entrywar.go).
		if why, err := a.war.refusing(a.now(), file); err != nil {
			return s, errors.Join(err, kubeconfigErr)
		} else if why != "" {
			a.log.Info(why, "file", file)
		}
		if err := a.war.saw(a.now(), file, hasEntry(data), firstPluginType(list)); err != nil {
			return s, errors.Join(err, kubeconfigErr)
		}
		// Never both at once: the drop-in goes before the entry comes in.
		if _, err = a.removeDropIns(""); err == nil {
			s.Primary, err = a.ensureEntry(primary, file, data)
			s.Entry = s.Primary
			if err == nil {
				a.war.put(s.Primary)
			}
		}
	}
	if err != nil {
		return s, errors.Join(err, kubeconfigErr)
	}
	s.EntryInPlace = true
	if wrote, err := fsutil.WriteFileAtomic(filepath.Join(a.cfg.ConfDir, ModeFileName), []byte(string(s.Mode)+"\n"+s.ModeReason+"\n"), 0o644); err != nil {
		return s, errors.Join(err, kubeconfigErr)
	} else if wrote {
		a.log.Info("recorded the mode for detour check", "file", filepath.Join(a.cfg.ConfDir, ModeFileName))
	}
	if kubeconfigErr != nil {
		return s, kubeconfigErr
	}
	s.ConfigInPlace = true
	return s, nil
}
