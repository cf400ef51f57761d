package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
)

func TestReconcileUpdatesBinary(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(e.binDir, "detour-cni")
	// An upgrade ships a new binary; someone deletes the installed one.
	writeFile(t, e.source, "#!/bin/sh\necho detour-cni v2\n")
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(readFile(t, bin), "v2") {
		t.Error("binary not updated")
	}
	os.Remove(bin)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(readFile(t, bin), "v2") {
		t.Error("binary not restored")
	}
	os.Remove(e.source)
	if _, err := a.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "--plugin-source") {
		t.Errorf("missing source: %v", err)
	}
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "plugin binary") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
}

// A bin dir on a read-only filesystem is refused with the value to set; the node stays
// unlabelled and gets an Event.
func TestReadOnlyBinDirRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a read-only filesystem")
	}
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	if err := syscall.Mount("tmpfs", e.binDir, "tmpfs", syscall.MS_RDONLY, ""); err != nil {
		t.Skipf("cannot mount a read-only tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(e.binDir, 0) })
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client))
	s, err := a.Reconcile(context.Background())
	if err == nil || !strings.Contains(err.Error(), "read-only") || !strings.Contains(err.Error(), "nodeAgent.cniBinDir") {
		t.Fatalf("Reconcile with a read-only bin dir = %v", err)
	}
	if s.EntryInPlace || s.NodeReady {
		t.Errorf("status %+v", s)
	}
	if _, err := os.Stat(filepath.Join(e.confDir, "k8s-pod-network", nodeagent.DropInName)); !os.IsNotExist(err) {
		t.Errorf("the drop-in was written without its binary: %v", err)
	}
	events, _ := client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{})
	if len(events.Items) != 1 || !strings.Contains(events.Items[0].Message, "nodeAgent.cniBinDir") {
		t.Errorf("events %+v", events.Items)
	}
}
