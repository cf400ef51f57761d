package nodeagent

import (
	"fmt"
	"time"
)

// A primary that owns its conflist outright rewrites it whenever it differs from what the
// primary wants, and so takes detour's entry out as soon as the agent has put it in: Cilium with
// cni.exclusive (its default) rewrites 05-cilium.conflist ten times a second against the agent,
// and a pod created meanwhile gets its sandbox without detour (docs/operations.md, Cilium). The
// agent counts the passes at which its entry, left in the primary's file, was gone again; past
// entryWarDrops of them within entryWarWindow it stops writing, refuses (the node is not ready
// for meshed pods, and the DetourCNIRefused event says what to change) and tries again after
// entryWarHoldOff, or at once when the primary's file is written meanwhile: the operator's fix
// (cni.exclusive=false) restarts cilium-agent, which writes its file again. A primary that
// rewrites its file at its own start (Cilium without cni.exclusive: three times per restart)
// stays far below.
//
// Only the primary's removals count: where the agent takes its entry out itself (a CNI version
// the plugin does not speak, the move to the drop-in, an uninstall), it writes through
// writeConfig, which tells the war.
const (
	entryWarDrops   = 10
	entryWarWindow  = 30 * time.Second
	entryWarHoldOff = 5 * time.Minute
)

// entryWar is what the agent knows of the primary's file and its entry.
type entryWar struct {
	// left is the primary file in which the agent last left its entry.
	left string
	// drops are when the entry was found gone from left, within the window.
	drops []time.Time
	// until is when the agent tries again after refusing; msg is why it refuses.
	until time.Time
	msg   string
	// refused is the primary's file the agent refused, and refusedID what os.Stat said of it
	// then. Not its content: a restarted cilium-agent writes the same bytes again.
	refused   string
	refusedID fileID
}

// refusing returns the refusal while the hold-off lasts. file is the primary's file the agent
// edits at this pass: when it is another one, or the refused one was written since, the hold-off
// ends at once and why says so, for the log.
func (w *entryWar) refusing(now time.Time, file string) (why string, err error) {
	if !now.Before(w.until) {
		return "", nil
	}
	id, serr := statID(w.refused)
	switch {
	case file != w.refused:
		why = "the primary's configuration is another file since detour refused; trying again"
	case serr != nil || id != w.refusedID:
		why = "the primary's configuration was written since detour refused; trying again"
	default:
		return "", w.refusal()
	}
	w.until, w.msg, w.refused, w.refusedID = time.Time{}, "", "", fileID{}
	return why, nil
}

func (w *entryWar) refusal() error {
	return &refusedError{fmt.Sprintf("%s; detour tries again at %s", w.msg, w.until.UTC().Format(time.RFC3339))}
}

// saw records the primary's file as the agent finds it at the start of a pass with the entry
// mode (hasIt: detour's entry is in it) and returns the refusal when the primary took the entry
// out too often. plugin is the primary's own plugin type, for the fix.
func (w *entryWar) saw(now time.Time, file string, hasIt bool, plugin string) error {
	if file != w.left || hasIt {
		return nil
	}
	w.left = ""
	kept := w.drops[:0]
	for _, t := range w.drops {
		if now.Sub(t) < entryWarWindow {
			kept = append(kept, t)
		}
	}
	w.drops = append(kept, now)
	if len(w.drops) < entryWarDrops {
		return nil
	}
	fix := "the primary owns the file and takes out what others add: make it keep other plugins' entries, or let detour use a drop-in (cniConfigMode: drop-in) where the runtime loads them"
	if plugin == "cilium-cni" {
		fix = "Cilium's cni.exclusive (its Helm value, true by default) makes cilium-agent own the file: set cni.exclusive=false in Cilium's values"
	}
	w.msg = fmt.Sprintf("the primary CNI took detour's entry out of %s %d times within %s, each time right after detour put it back, so pods would start without it: %s",
		file, len(w.drops), entryWarWindow, fix)
	w.until, w.drops = now.Add(entryWarHoldOff), nil
	// A file the agent cannot stat now ends the hold-off at the next pass: a retry too early,
	// never a refusal kept past the primary's fix.
	w.refused = file
	w.refusedID, _ = statID(file)
	return w.refusal()
}

// put records that the agent left its entry in file.
func (w *entryWar) put(file string) { w.left = file }

// wrote records a write of the agent's own to file. Without detour's entry (the agent took it
// out, or gave the primary's version back), a later pass that finds the entry missing is not the
// primary's doing: the war forgets it left one there. And the agent's write is not the primary
// writing the refused file: it does not end the hold-off.
func (w *entryWar) wrote(file string, withEntry bool) {
	if !withEntry && file == w.left {
		w.left = ""
	}
	if file == w.refused {
		w.refusedID, _ = statID(file)
	}
}
