package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/fsnotify/fsnotify"

	"github.com/detourmesh/detour/nodeagent"
)

func TestDropInSurvivesThePrimaryRewritingItsFile(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t, nodeagent.WithNodeClient(runtimeNode(e, "containerd://2.4.2")))
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dropIn := filepath.Join(e.confDir, "k8s-pod-network", nodeagent.DropInName)
	if !s.ConfigInPlace || s.Mode != nodeagent.ModeDropIn || s.Entry != dropIn || !strings.Contains(s.ModeReason, "containerd 2.4.2") {
		t.Errorf("status %+v", s)
	}
	if ok, reason := a.Ready(); !ok || !strings.Contains(reason, dropIn) || !strings.Contains(reason, "drop-in") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
	if got := readFile(t, primary); got != calico {
		t.Errorf("the primary's file changed in drop-in mode:\n%s", got)
	}
	want := []string{"calico", "portmap", "detour-cni"}
	if types := loaded(t, primary); !slices.Equal(types, want) {
		t.Errorf("the runtime loads %v, want %v", types, want)
	}
	if got, want := files(t, e.confDir), []string{"10-calico.conflist", "detour-cni.kubeconfig", "detour-cni.mode", "detour-cni.token", "k8s-pod-network/", "k8s-pod-network/" + nodeagent.DropInName}; !slices.Equal(got, want) {
		t.Errorf("conf dir holds %v, want %v", got, want)
	}
	// The plugin parses the drop-in as it parses the entry.
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.binDir, "detour-cni")); err != nil {
		t.Errorf("binary: %v", err)
	}
	if last := list.Plugins[2]; !strings.Contains(string(last.Bytes), `"kubeconfig"`) {
		t.Errorf("drop-in %s", last.Bytes)
	}

	// The primary rewrites its file, content changed, with no agent running: the runtime
	// still loads detour after it.
	writeAtomic(t, primary, strings.Replace(calico, `"snat": true`, `"snat": false`, 1))
	if types := loaded(t, primary); !slices.Equal(types, want) {
		t.Errorf("after the primary's rewrite the runtime loads %v, want %v", types, want)
	}
	// And the agent's next pass writes nothing.
	before := snapshot(t, e.confDir, e.binDir)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("a steady reconcile wrote files")
	}
}

// The runtime reloads on a write, rename or remove event in the conf dir (containerd ignores
// create and chmod, and does not watch subdirectories): writing or removing the drop-in must
// cause one.
func TestDropInMakesTheRuntimeReload(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(e.confDir); err != nil {
		t.Fatal(err)
	}
	reloads := func() int {
		n := 0
		for {
			select {
			case ev := <-w.Events:
				if !ev.Has(fsnotify.Create) && !ev.Has(fsnotify.Chmod) {
					n++
				}
			case <-time.After(200 * time.Millisecond):
				return n
			}
		}
	}
	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	reloads() // the kubeconfig and token
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The kubeconfig and token writes are events too; the poke comes after the drop-in.
	if n := reloads(); n == 0 {
		t.Error("writing the drop-in caused no event containerd reloads on")
	}
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := reloads(); n != 0 {
		t.Errorf("a steady reconcile caused %d events", n)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := reloads(); n == 0 {
		t.Error("removing the drop-in caused no event containerd reloads on")
	}
}

// In drop-in mode another drop-in that sorts before detour's is fine; one after it is refused.
func TestDropInOrder(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	dir := filepath.Join(e.confDir, "k8s-pod-network")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "50-tuning.conf"), `{"type":"tuning"}`)
	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if types := loaded(t, primary); !slices.Equal(types, []string{"calico", "portmap", "tuning", "detour-cni"}) {
		t.Errorf("the runtime loads %v", types)
	}
	writeFile(t, filepath.Join(dir, "zzz-late.conf"), `{"type":"late"}`)
	if _, err := a.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "zzz-late.conf") {
		t.Errorf("a drop-in after detour's was accepted: %v", err)
	}
}
