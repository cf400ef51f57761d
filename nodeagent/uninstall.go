package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
)

// Uninstall removes what the agent installed: detour's entry from every conflist in the
// directory first; then — only once no file the runtime loads holds an entry, since an entry
// without its binary fails every pod's sandbox with "plugin not found" — the plugin binary, the
// kubeconfig and the token copy; and the node's ready label. It goes on after an error where
// that is safe and returns them all; running it again finishes the job.
func (a *Agent) Uninstall(ctx context.Context) error {
	errs := a.removeFiles()
	if a.node != nil {
		if err := a.node.unlabel(ctx); err != nil {
			errs = append(errs, &labelError{err})
		} else {
			a.log.Info("removed the node's ready label", "node", a.node.name)
		}
	}
	err := errors.Join(errs...)
	if err != nil {
		a.setStatus(Status{Reason: fmt.Sprintf("uninstall failed: %v", err)})
	} else {
		a.setStatus(Status{Uninstalled: true})
	}
	return err
}

// removeFiles is the part of Uninstall on the node's disk; it returns every failure.
func (a *Agent) removeFiles() []error {
	if err := a.removeAllEntries(); err != nil {
		return []error{err, fmt.Errorf("kept %s, the plugin's kubeconfig and token while an entry remains: without them every pod's sandbox on the node would fail; fix the error above and uninstall again", a.binary.dest)}
	}
	var errs []error
	for _, f := range []string{a.binary.dest, a.cfg.KubeconfigPath, a.cfg.TokenPath, filepath.Join(a.cfg.ConfDir, ModeFileName)} {
		if removed, err := removeFile(f); err != nil {
			errs = append(errs, err)
		} else if removed {
			a.log.Info("removed", "file", f)
		}
	}
	return errs
}

// labelError is the failure to take the ready label off the node, the one part of an uninstall
// on the API server rather than on the node.
type labelError struct{ err error }

func (e *labelError) Error() string { return e.err.Error() }
func (e *labelError) Unwrap() error { return e.err }

// onlyLabelFailed reports whether err, from [Agent.Uninstall], is the label's failure alone:
// everything on the node is gone.
func onlyLabelFailed(err error) bool {
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return false
	}
	for _, e := range joined.Unwrap() {
		if _, label := e.(*labelError); !label {
			return false
		}
	}
	return true
}

// removeAllEntries removes detour's entries from every configuration file in the directory and
// then checks that none is left; it returns every failure.
func (a *Agent) removeAllEntries() error {
	var errs []error
	if _, err := a.removeDropIns(""); err != nil {
		errs = append(errs, err)
	}
	files, err := libcni.ConfFiles(a.cfg.ConfDir, configExtensions)
	if err != nil {
		return fmt.Errorf("list %s: %w", a.cfg.ConfDir, err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, fmt.Errorf("read %s: %w", f, err))
			continue
		}
		if !hasEntry(data) {
			continue
		}
		out, changed, err := RemoveEntries(data)
		if err != nil {
			errs = append(errs, fmt.Errorf("remove detour's entry from %s: %w", f, err))
			continue
		}
		target, err := a.editable(f)
		if err != nil {
			errs = append(errs, fmt.Errorf("remove detour's entry from %s: %w", f, err))
			continue
		}
		if changed {
			if _, err := a.writeConfig(target, out, fileMode(target)); err != nil {
				errs = append(errs, fmt.Errorf("remove detour's entry from %s: %w", f, err))
				continue
			}
			a.log.Info("removed detour's entry", "file", f)
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	// Read everything again: a file written meanwhile (by the primary, or by an agent that is
	// still running) may hold an entry again.
	files, err = libcni.ConfFiles(a.cfg.ConfDir, configExtensions)
	if err != nil {
		return fmt.Errorf("list %s: %w", a.cfg.ConfDir, err)
	}
	for _, f := range files {
		if data, err := os.ReadFile(f); err != nil {
			errs = append(errs, fmt.Errorf("read %s: %w", f, err))
		} else if hasEntry(data) {
			errs = append(errs, fmt.Errorf("%s holds detour's entry again", f))
		}
	}
	if again, err := dropInFiles(a.cfg.ConfDir); err != nil {
		errs = append(errs, err)
	} else if len(again) > 0 {
		errs = append(errs, fmt.Errorf("detour's drop-in is there again: %s", strings.Join(again, ", ")))
	}
	return errors.Join(errs...)
}

// UninstallAndHold is `--uninstall --hold`: it uninstalls like Uninstall, retrying with backoff
// (1s doubling to 1m) until that succeeds, then holds — Ready reports the node clean — until ctx
// ends, and returns nil. A DaemonSet running it shows through its readiness, and `kubectl
// rollout status`, when every node is clean. Stopped before the uninstall succeeded, it returns
// the last error.
func (a *Agent) UninstallAndHold(ctx context.Context) error {
	a.setStatus(Status{Reason: "uninstalling detour from this node"})
	backoff := time.Second
	for {
		err := a.Uninstall(ctx)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("stopped before detour was uninstalled: %w", err)
		}
		a.log.Error("uninstall failed; retrying", "retryIn", backoff, "err", err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("stopped before detour was uninstalled: %w", err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Minute)
	}
	a.log.Info("detour is uninstalled from this node; holding until SIGTERM (--hold)")
	<-ctx.Done()
	a.log.Info("stopping")
	return nil
}
