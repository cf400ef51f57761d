package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/nodeagent"
)

// ciliumList is Cilium's conflist as cilium-agent writes it (detour's entry chained in: no
// drop-in, since it loads only its inlined plugins).
const ciliumList = `{"cniVersion":"1.0.0","name":"cilium","loadOnlyInlinedPlugins":true,"plugins":[{"type":"cilium-cni","enable-debug":false}]}`

// war plays a primary that takes detour's entry out as soon as it is in: up to ten times, 100 ms
// apart, it writes content (without the entry) over primary and has the agent reconcile. The
// entry must be in primary, left there by the agent, when it starts. It returns the drop at
// which the agent refused, with its error, or 0 when the agent put its entry back every time.
func war(t *testing.T, a *nodeagent.Agent, primary, content string, now *time.Time) (int, error) {
	t.Helper()
	for drop := 1; drop <= 10; drop++ {
		writeAtomic(t, primary, content)
		*now = now.Add(100 * time.Millisecond)
		s, err := a.Reconcile(context.Background())
		if err != nil {
			return drop, err
		}
		if !s.EntryInPlace || !strings.Contains(readFile(t, primary), "detour-cni") {
			t.Fatalf("drop %d: Reconcile = %+v, but the entry is not in %s", drop, s, primary)
		}
	}
	return 0, nil
}

// The agent takes its own entry out of the primary's file: when the primary declares a CNI
// version the plugin does not speak, when the agent moves to the drop-in, when it uninstalls.
// A later pass that finds the entry missing must not count that as the primary taking it out:
// however often it happens, the agent is not refused, and a war that follows is refused at its
// tenth drop, not before.
func TestEntryWarOwnRemovalNotCounted(t *testing.T) {
	// edit rewrites the primary's file as it is, detour's entry and all, with old replaced by
	// new, and has the agent reconcile.
	edit := func(old, new string) func(*testing.T, *nodeagent.Agent, string) {
		return func(t *testing.T, a *nodeagent.Agent, primary string) {
			t.Helper()
			content := readFile(t, primary)
			if !strings.Contains(content, old) {
				t.Fatalf("%s does not hold %s: %s", primary, old, content)
			}
			writeAtomic(t, primary, strings.Replace(content, old, new, 1))
			_, _ = a.Reconcile(context.Background()) // a refused version is an error
		}
	}
	tests := []struct {
		name string
		mode string
		// out makes the agent take its entry out of primary; back undoes what out changed in
		// the primary's file, if anything.
		out, back func(t *testing.T, a *nodeagent.Agent, primary string)
	}{
		{
			name: "a cniVersion the plugin does not speak",
			mode: "chained-entry",
			out:  edit(`"cniVersion":"1.0.0"`, `"cniVersion":"0.2.0"`),
			back: edit(`"cniVersion":"0.2.0"`, `"cniVersion":"1.0.0"`),
		},
		{
			name: "the move to the drop-in",
			mode: "auto",
			out:  edit(`"loadOnlyInlinedPlugins":true`, `"loadOnlyInlinedPlugins":false`),
			back: edit(`"loadOnlyInlinedPlugins":false`, `"loadOnlyInlinedPlugins":true`),
		},
		{
			name: "an uninstall",
			mode: "chained-entry",
			out: func(t *testing.T, a *nodeagent.Agent, _ string) {
				if err := a.Uninstall(context.Background()); err != nil {
					t.Fatalf("Uninstall = %v", err)
				}
			},
			back: func(*testing.T, *nodeagent.Agent, string) {},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.flags.CNIConfigMode = tc.mode
			primary := filepath.Join(e.confDir, "05-cilium.conflist")
			writeFile(t, primary, ciliumList)
			now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
			a := e.agent(t, nodeagent.WithNodeClient(runtimeNode(e, "containerd://2.4.2")), nodeagent.WithClock(func() time.Time { return now }))
			ctx := context.Background()

			// Twelve times in a second: more than enough to be refused if they counted.
			for i := 1; i <= 12; i++ {
				if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace || s.Mode != nodeagent.ModeChainedEntry {
					t.Fatalf("pass %d: Reconcile = %+v, %v", i, s, err)
				}
				if !strings.Contains(readFile(t, primary), "detour-cni") {
					t.Fatalf("pass %d: no entry in %s", i, primary)
				}
				tc.out(t, a, primary)
				if content := readFile(t, primary); strings.Contains(content, "detour-cni") {
					t.Fatalf("pass %d: the agent left its entry in %s: %s", i, primary, content)
				}
				tc.back(t, a, primary)
				now = now.Add(100 * time.Millisecond)
			}
			if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace {
				t.Fatalf("Reconcile = %+v, %v", s, err)
			}
			drop, err := war(t, a, primary, ciliumList, &now)
			if drop != 10 || err == nil || !strings.Contains(err.Error(), "10 times within 30s") {
				t.Errorf("a war after the agent's own removals: refused at drop %d with %v; want refused at drop 10", drop, err)
			}
		})
	}
}

// An operator who fixes a refused primary (cni.exclusive=false) restarts it, and the restarted
// primary writes its file again, often byte for byte what it was: the agent tries again at its
// next pass, and refuses again if the war goes on. A file no one wrote keeps the refusal for the
// whole hold-off.
func TestEntryWarHoldOffEndsWhenPrimaryWritten(t *testing.T) {
	tests := []struct {
		name string
		// change does to the primary's file what happens to it during the hold-off.
		change func(t *testing.T, primary string)
		tries  bool
	}{
		{
			name:   "untouched",
			change: func(*testing.T, string) {},
		},
		{
			name: "read (its access time changed)",
			change: func(t *testing.T, primary string) {
				st, err := os.Stat(primary)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.Chtimes(primary, st.ModTime().Add(time.Hour), st.ModTime()); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name: "written in place with the same content (a later mtime)",
			change: func(t *testing.T, primary string) {
				st, err := os.Stat(primary)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.Chtimes(primary, time.Time{}, st.ModTime().Add(time.Second)); err != nil {
					t.Fatal(err)
				}
			},
			tries: true,
		},
		{
			name:   "replaced by a rename with the same content (Cilium's restart)",
			change: func(t *testing.T, primary string) { writeAtomic(t, primary, ciliumList) },
			tries:  true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.flags.CNIConfigMode = "chained-entry"
			primary := filepath.Join(e.confDir, "05-cilium.conflist")
			writeFile(t, primary, ciliumList)
			now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
			a := e.agent(t, nodeagent.WithNodeClient(runtimeNode(e, "containerd://2.4.2")), nodeagent.WithClock(func() time.Time { return now }))
			ctx := context.Background()
			if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace {
				t.Fatalf("Reconcile = %+v, %v", s, err)
			}
			if drop, err := war(t, a, primary, ciliumList, &now); drop != 10 {
				t.Fatalf("the war: refused at drop %d with %v; want drop 10", drop, err)
			}

			now = now.Add(time.Minute)
			tc.change(t, primary)
			s, err := a.Reconcile(ctx)
			if !tc.tries {
				if err == nil || !strings.Contains(err.Error(), "tries again at") || s.EntryInPlace || readFile(t, primary) != ciliumList {
					t.Fatalf("a minute into the hold-off: Reconcile = %+v, %v, file %s; want still refused, the file left alone", s, err, readFile(t, primary))
				}
				now = now.Add(4 * time.Minute)
				if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace {
					t.Errorf("after the hold-off: Reconcile = %+v, %v", s, err)
				}
				return
			}
			if err != nil || !s.EntryInPlace || !strings.Contains(readFile(t, primary), "detour-cni") {
				t.Fatalf("the pass after the primary's file was written: Reconcile = %+v, %v; want the entry put back", s, err)
			}
			// The war goes on: refused again, after as many drops as the first time, for 5
			// minutes from this refusal (at 12:01:02).
			drop, err := war(t, a, primary, ciliumList, &now)
			if drop != 10 || err == nil || !strings.Contains(err.Error(), "tries again at 2026-12-05T12:06:02Z") {
				t.Errorf("the war again: refused at drop %d with %v; want drop 10, trying again 5 minutes later", drop, err)
			}
		})
	}
}
