package nodeagent_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
)

func TestUninstall(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	stale := filepath.Join(e.confDir, "20-old.conflist") // an earlier primary that still has the entry
	writeFile(t, stale, `{"name":"old","cniVersion":"1.0.0","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{primary, stale} {
		if types := pluginTypes(t, readFile(t, f)); slices.Contains(types, "detour-cni") {
			t.Errorf("%s still has the entry: %v", f, types)
		}
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap"}) {
		t.Errorf("primary plugins after uninstall %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s not removed: %v", f, err)
		}
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if _, ok := node.Labels[annotations.CNIReadyLabel]; ok {
		t.Errorf("ready label still set: %v", node.Labels)
	}
	// Uninstalling twice is fine.
	if err := a.Uninstall(context.Background()); err != nil {
		t.Errorf("second Uninstall: %v", err)
	}
}

// Issue 15.3: when an entry cannot be removed, the binary, kubeconfig and token it needs stay:
// without them every ADD on the node fails with "plugin not found".
func TestUninstallKeepsWhatARemainingEntryNeeds(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// A list that holds only detour entries: removing them would leave no plugin, so the
	// agent refuses (as it fails on a read-only or immutable file).
	stuck := filepath.Join(e.confDir, "20-stuck.conflist")
	writeFile(t, stuck, `{"name":"stuck","cniVersion":"1.0.0","plugins":[{"type":"detour-cni"}]}`)
	err := a.Uninstall(context.Background())
	if err == nil || !strings.Contains(err.Error(), "20-stuck.conflist") || !strings.Contains(err.Error(), "kept") {
		t.Fatalf("Uninstall = %v, want the stuck entry reported and the files kept", err)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap"}) {
		t.Errorf("the removable entry stays: %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s removed while an entry remains: %v", f, err)
		}
	}
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "uninstall failed") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
	// Fixed, the next attempt finishes the job.
	os.Remove(stuck)
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s not removed: %v", f, err)
		}
	}
}

// Issue 15.3, as reported: the entry sits in an immutable file (chattr +i). Uninstall fails to
// remove it and keeps the binary, kubeconfig and token that entry needs.
func TestUninstallImmutableConflist(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to set the immutable attribute")
	}
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("chattr", "+i", primary).CombinedOutput(); err != nil {
		t.Skipf("cannot make the file immutable here: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("chattr", "-i", primary).Run() })
	if err := a.Uninstall(context.Background()); err == nil || !strings.Contains(err.Error(), "kept") {
		t.Fatalf("Uninstall = %v, want the entry reported and the files kept", err)
	}
	if !slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni") {
		t.Fatal("the immutable file lost its entry")
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s removed while the entry remains: %v", f, err)
		}
	}
}

// --uninstall removes both forms: a drop-in (the network's and a stale one of another
// network) and in-file entries.
func TestUninstallBothForms(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	stale := filepath.Join(e.confDir, "20-old.conflist")
	oldList := `{"name":"old","cniVersion":"1.0.0","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`
	writeFile(t, stale, oldList)
	otherDir := filepath.Join(e.confDir, "renamed-network")
	if err := os.MkdirAll(otherDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(otherDir, nodeagent.DropInName), `{"type":"detour-cni"}`)
	// Someone else's drop-in stays.
	keepDir := filepath.Join(e.confDir, "old")
	if err := os.MkdirAll(keepDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(keepDir, "10-tuning.conf"), `{"type":"tuning"}`)

	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(otherDir, nodeagent.DropInName)); !os.IsNotExist(err) {
		t.Errorf("the stale drop-in of another network is still there: %v", err)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := files(t, e.confDir), []string{"10-calico.conflist", "20-old.conflist", "old/", "old/10-tuning.conf"}; !slices.Equal(got, want) {
		t.Errorf("after uninstall the conf dir holds %v, want %v", got, want)
	}
	if got := readFile(t, primary); got != calico {
		t.Errorf("primary after uninstall:\n%s", got)
	}
	if types := pluginTypes(t, readFile(t, stale)); !slices.Equal(types, []string{"bridge"}) {
		t.Errorf("stale conflist after uninstall: %v", types)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Errorf("second Uninstall: %v", err)
	}
}
