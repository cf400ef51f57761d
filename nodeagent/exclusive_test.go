package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
)

const ciliumConf = `{"cniVersion":"0.3.1","name":"cilium","type":"cilium-cni","enable-debug":false}`

// Cilium with cni.exclusive renames every configuration but its own to *.cilium_bak: the agent
// notices its configuration renamed away, refuses (the node loses its ready label, an Event
// names the setting), and goes on once the setting is changed and the file deleted.
func TestExclusivePrimaryNoticed(t *testing.T) {
	e := newEnv(t)
	conf := filepath.Join(e.confDir, "05-cilium.conf")
	writeFile(t, conf, ciliumConf)
	// Another CNI's file Cilium renamed away is none of detour's business.
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist.cilium_bak"), calico)
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client))
	ctx := context.Background()
	s, err := a.Reconcile(ctx)
	if err != nil || !s.NodeReady || s.Mode != nodeagent.ModeChainedEntry {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	// Cilium renames the converted conflist away and writes its .conf again.
	converted := filepath.Join(e.confDir, "05-cilium.conflist")
	if err := os.Rename(converted, converted+".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	writeFile(t, conf, ciliumConf)
	s, err = a.Reconcile(ctx)
	if err == nil || !strings.Contains(err.Error(), "cni.exclusive=false") || !strings.Contains(err.Error(), "05-cilium.conflist.cilium_bak") {
		t.Fatalf("Reconcile after the rename = %v", err)
	}
	if s.EntryInPlace || s.NodeReady {
		t.Errorf("status %+v", s)
	}
	node, _ := client.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	if _, ok := node.Labels["detour.dev/cni-ready"]; ok {
		t.Errorf("the node kept its ready label: %v", node.Labels)
	}
	events, _ := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{})
	if len(events.Items) != 1 || !strings.Contains(events.Items[0].Message, "cni.exclusive") {
		t.Errorf("events %+v", events.Items)
	}
	if files, _, err := nodeagent.RenamedAway(e.confDir); err != nil || len(files) != 1 {
		t.Errorf("RenamedAway = %v, %v", files, err)
	}

	// The user sets cni.exclusive=false and deletes the renamed file: the agent goes on.
	if err := os.Remove(converted + ".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	if s, err := a.Reconcile(ctx); err != nil || !s.NodeReady {
		t.Errorf("Reconcile after the fix = %+v, %v", s, err)
	}
}

// Cilium with cni.exclusive and detour's entry in its conflist (chained-entry): cilium-agent
// writes its file back without the entry right after each of the agent's writes. The agent
// refuses after ten such passes within 30 s — no more writes, the node not ready, an Event
// with the fix — and tries again after its hold-off; a primary that rewrites its file at its own
// start now and then (Cilium without cni.exclusive) is never refused.
func TestEntryWarRefused(t *testing.T) {
	const cilium = `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false}]}`
	e := newEnv(t)
	e.flags.CNIConfigMode = "chained-entry"
	primary := filepath.Join(e.confDir, "05-cilium.conflist")
	writeFile(t, primary, cilium)
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(func() time.Time { return now }))
	ctx := context.Background()

	// Now and then: a rewrite every 10 s for two minutes, each answered with the entry.
	for i := range 12 {
		if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace {
			t.Fatalf("rewrite %d, 10 s apart: Reconcile = %+v, %v", i, s, err)
		}
		writeAtomic(t, primary, cilium)
		now = now.Add(10 * time.Second)
	}

	// A war: the primary takes the entry out as soon as it is in.
	now = now.Add(30 * time.Second)
	var err error
	for pass := 1; pass <= 11; pass++ {
		var s nodeagent.Status
		s, err = a.Reconcile(ctx)
		if err != nil {
			if s.EntryInPlace || s.NodeReady || pass < 10 {
				t.Fatalf("refused at pass %d with status %+v", pass, s)
			}
			break
		}
		if !strings.Contains(readFile(t, primary), "detour-cni") {
			t.Fatalf("pass %d: no entry written", pass)
		}
		writeAtomic(t, primary, cilium)
		now = now.Add(100 * time.Millisecond)
	}
	for _, want := range []string{"took detour's entry out of " + primary, "within 30s", "cni.exclusive=false", "tries again at 2026-12-05T12:07:3"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("Reconcile in the war = %v; want it refused, saying %q", err, want)
		}
	}
	events, _ := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{})
	if len(events.Items) == 0 || !strings.Contains(events.Items[len(events.Items)-1].Message, "cni.exclusive=false") {
		t.Errorf("events %+v", events.Items)
	}
	// Refused: the agent leaves the file as the primary wrote it until its hold-off ends.
	now = now.Add(4 * time.Minute)
	if _, err := a.Reconcile(ctx); err == nil || readFile(t, primary) != cilium {
		t.Errorf("within the hold-off: Reconcile = %v, file %s", err, readFile(t, primary))
	}
	now = now.Add(2 * time.Minute)
	if s, err := a.Reconcile(ctx); err != nil || !s.EntryInPlace || !strings.Contains(readFile(t, primary), "detour-cni") {
		t.Errorf("after the hold-off: Reconcile = %+v, %v", s, err)
	}
}
