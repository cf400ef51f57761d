package upstream

import (
	"fmt"
	"strings"
	"time"
)

// Relabel is what a client saw of a server relabelled into a policy that denies it ingress: the
// client dials the server's Service every half second (the workload image's `dial -every`),
// each dial ending when the server's line came back ("ok") or not ("failed"). A meshed client's
// dial goes through both proxies, so it reads as an unmeshed one's: what the application got.
// NetworkPolicy's rule is the same for both: once the primary CNI enforces the policy, no
// connection gets through; the time it takes to enforce it is the CNI's (Cilium allocates the
// relabelled pod's new identity first).
type Relabel struct {
	Pod string
	// At is when the server's new labels were written.
	At time.Time
	// LastThrough is the last dial that got the server's line before the first one that did
	// not, from At; FirstDenied the end of that first failed dial, from At (the policy came into
	// force between the two). Zero FirstDenied: no dial failed.
	LastThrough, FirstDenied time.Duration
	// After counts the dials that ended after the first failure, and Through those of them
	// that got the server's line: a policy that holds lets none through.
	After, Through int
}

// ReadRelabel reads the client's log (its lines as the kubelet stamps them) for the dials that
// ended after at.
func ReadRelabel(pod string, at time.Time, lines []LogLine) Relabel {
	r := Relabel{Pod: pod, At: at}
	denied := false
	for _, l := range lines {
		if !strings.HasPrefix(l.Text, "dial ") || !l.Time.After(at) {
			continue
		}
		ok := strings.Contains(l.Text, " ok: ")
		if !ok && !strings.Contains(l.Text, " failed: ") {
			continue
		}
		switch {
		case denied:
			r.After++
			if ok {
				r.Through++
			}
		case ok:
			r.LastThrough = l.Time.Sub(at)
		default:
			denied = true
			r.FirstDenied = l.Time.Sub(at)
		}
	}
	return r
}

// Held reports whether the policy came into force and held for at least minAfter dials.
func (r Relabel) Held(minAfter int) bool {
	return r.FirstDenied > 0 && r.Through == 0 && r.After >= minAfter
}

// String is the relabel's outcome in a line.
func (r Relabel) String() string {
	if r.FirstDenied == 0 {
		return fmt.Sprintf("%s: never denied (the last dial through %s after the relabel)", r.Pod, r.LastThrough.Round(100*time.Millisecond))
	}
	return fmt.Sprintf("%s: last through %s after the relabel, first denied at %s; then %d dials, %d through",
		r.Pod, r.LastThrough.Round(100*time.Millisecond), r.FirstDenied.Round(100*time.Millisecond), r.After, r.Through)
}
