package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Run reconciles now, then whenever the CNI config directory, the bin directory or the service
// account directory changes (fsnotify, with a short debounce), every resync interval in case an
// event was missed, and when the plugin's requested token is due for refresh, for a retry, or
// expires. Each reconcile writes only what differs, so the agent's own writes cause one more
// reconcile that writes nothing: there is no write loop. Run returns when ctx ends and leaves
// everything in place (a rollout must not open a window without the plugin) — unless, with
// WithOwnPod, the agent's DaemonSet is being deleted: then it uninstalls first. With
// WithNodeClient it also follows its Node object: deleted, detour comes off the node until the
// node registers again (see watchNode).
func (a *Agent) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch the CNI directories: %w", err)
	}
	defer w.Close()
	watched := map[string]bool{}
	watch := func() {
		for _, dir := range []string{a.cfg.ConfDir, a.cfg.BinDir, a.cfg.ServiceAccountDir} {
			if watched[dir] {
				continue
			}
			if err := w.Add(dir); err != nil {
				a.log.Warn("cannot watch a directory yet; relying on the resync", "dir", dir, "err", err)
				continue
			}
			watched[dir] = true
		}
	}
	watch()
	a.removeStaleTemps()

	resync := time.NewTicker(a.cfg.Resync)
	defer resync.Stop()
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	token := time.NewTimer(time.Hour)
	token.Stop()
	defer token.Stop()
	var nodeEvents <-chan nodeEvent
	if a.node != nil {
		nodeEvents = a.watchNode(ctx)
	}
	reconcile := func() {
		if a.nodeUnconfirmed {
			a.followNode(ctx, nodeEvent{exists: false})
		}
		if a.nodeGone {
			a.removeFromDeletedNode()
			a.passes.Add(1)
			return
		}
		a.resolveOwner(ctx)
		a.reconcileAndLog(ctx)
		a.passes.Add(1)
		// Re-arm the timer for the plugin token's next event: refresh, retry or expiry. A time
		// already past means this reconcile stopped before the token (no primary yet, say):
		// the resync and file events cover that, and a timer of zero would spin.
		token.Stop()
		if a.tokens != nil {
			if at, ok := a.tokens.next(); ok {
				if wait := at.Sub(a.now()); wait > 0 {
					token.Reset(wait)
				}
			}
		}
	}
	reconcile()
	for {
		select {
		case <-ctx.Done():
			a.stopping()
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("the file watcher stopped")
			}
			if isTemp(ev.Name) {
				continue
			}
			if ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename) {
				if watched[ev.Name] {
					delete(watched, ev.Name) // a watched directory itself went away
				}
			}
			debounce.Reset(a.debounce)
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("the file watcher stopped")
			}
			a.log.Warn("file watcher error; the resync catches up", "err", err)
		case <-debounce.C:
			reconcile()
		case <-token.C:
			reconcile()
		case <-resync.C:
			watch()
			reconcile()
		case ev := <-nodeEvents:
			if a.followNode(ctx, ev) {
				reconcile()
			}
		}
	}
}

// removeStaleTemps removes temporary files an earlier agent left when it was killed between
// writing and renaming one (only files with the agent's own prefix).
func (a *Agent) removeStaleTemps() {
	for _, dir := range []string{a.cfg.ConfDir, a.cfg.BinDir} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !e.IsDir() && isTemp(e.Name()) {
				if _, err := removeFile(filepath.Join(dir, e.Name())); err != nil {
					a.log.Warn("cannot remove a stale temporary file", "err", err)
				}
			}
		}
	}
}

// errorRepeat is how often a reconcile error that stays the same is logged again: a refused
// primary would otherwise log the same line at every resync.
const errorRepeat = 5 * time.Minute

func (a *Agent) reconcileAndLog(ctx context.Context) {
	before := a.Status()
	s, err := a.Reconcile(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		if msg := err.Error(); msg != a.lastErr || a.now().Sub(a.lastErrAt) >= errorRepeat {
			a.log.Error("reconcile failed; retrying on the next change or resync", "err", err)
			a.lastErr, a.lastErrAt = msg, a.now()
		}
	case err == nil && s.Reason != "" && s.Reason != before.Reason:
		a.log.Info(s.Reason)
	}
	if err == nil {
		a.lastErr = ""
	}
}
