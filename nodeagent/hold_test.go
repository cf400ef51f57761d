package nodeagent_test

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
)

// --uninstall --hold: the agent removes everything, retrying a failed step, then reports ready
// until it is stopped, and returns nil.
func TestUninstallAndHold(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The first label removal fails: the agent is not ready and tries again.
	failures := 1
	client.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, apierrors.NewServiceUnavailable("etcd is down")
		}
		return false, nil, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.UninstallAndHold(ctx) }()
	eventually(t, "the uninstall fails once", func() bool { _, r := a.Ready(); return strings.Contains(r, "etcd is down") })
	if ok, _ := a.Ready(); ok {
		t.Error("ready while the uninstall failed")
	}
	eventually(t, "the agent reports the node clean", func() bool { ok, _ := a.Ready(); return ok })
	if code, body := readyz(t, a); code != 200 || !strings.Contains(body, "uninstalled") {
		t.Errorf("/readyz = %d %q", code, body)
	}
	if types := pluginTypes(t, readFile(t, primary)); slices.Contains(types, "detour-cni") {
		t.Errorf("entry still there: %v", types)
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if _, ok := node.Labels[annotations.CNIReadyLabel]; ok {
		t.Errorf("ready label still set")
	}
	select {
	case err := <-done:
		t.Fatalf("UninstallAndHold returned before it was stopped: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("UninstallAndHold after stop = %v", err)
	}
}
