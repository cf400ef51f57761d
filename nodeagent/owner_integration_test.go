package nodeagent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/testenv"
	"github.com/detourmesh/detour/nodeagent"
)

// daemonSetPod creates, in the real API server, a DaemonSet and a pod of it on node (no
// controllers run here: the objects are what the DaemonSet controller would have made).
func daemonSetPod(t *testing.T, client kubernetes.Interface, node string) (*appsv1.DaemonSet, *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	ns := randomName("detour-")
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{"app": "detour-node-agent"}
	ds, err := client.AppsV1().DaemonSets(ns).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "detour-node-agent"},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "install-cni", Image: "detour:test"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod, err := client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "detour-node-agent-x1", Labels: labels, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID, Controller: ptr.To(true),
		}}},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "install-cni", Image: "detour:test"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return ds, pod
}

// The agent uninstalls at SIGTERM when — and only when — its DaemonSet is going away (helm
// uninstall deletes it, then its pods): deleted, or marked for foreground deletion. A rollout or
// a drain (the DaemonSet stays), or a DaemonSet replaced under the same name, leaves everything.
func TestIntegrationUninstallWhenDaemonSetDeleted(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		act       func(t *testing.T, ds *appsv1.DaemonSet)
		uninstall bool
	}{
		{"rollout or drain", func(*testing.T, *appsv1.DaemonSet) {}, false},
		{"deleted", func(t *testing.T, ds *appsv1.DaemonSet) {
			if err := client.AppsV1().DaemonSets(ds.Namespace).Delete(ctx, ds.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"foreground deletion", func(t *testing.T, ds *appsv1.DaemonSet) {
			// No garbage collector runs here: the DaemonSet stays, marked, with its finalizer.
			if err := client.AppsV1().DaemonSets(ds.Namespace).Delete(ctx, ds.Name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationForeground)}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				d, err := client.AppsV1().DaemonSets(ds.Namespace).Get(ctx, ds.Name, metav1.GetOptions{})
				if err == nil {
					d.Finalizers = nil
					client.AppsV1().DaemonSets(ds.Namespace).Update(ctx, d, metav1.UpdateOptions{})
				}
			})
		}, true},
		{"replaced", func(t *testing.T, ds *appsv1.DaemonSet) {
			if err := client.AppsV1().DaemonSets(ds.Namespace).Delete(ctx, ds.Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			again := ds.DeepCopy()
			again.ResourceVersion, again.UID = "", ""
			if _, err := client.AppsV1().DaemonSets(ds.Namespace).Create(ctx, again, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := registerNode(t, client)
			ds, pod := daemonSetPod(t, client, node.Name)
			e := newEnv(t)
			e.flags.NodeName = node.Name
			primary := filepath.Join(e.confDir, "10-calico.conflist")
			writeFile(t, primary, calico)
			a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithOwnPod(pod.Namespace, pod.Name))
			stop := run(t, a)
			eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })

			tc.act(t, ds)
			if err := stop(); err != nil { // SIGTERM
				t.Fatal(err)
			}
			entry := slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni")
			_, binErr := os.Stat(filepath.Join(e.binDir, "detour-cni"))
			got, _ := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
			label := got.Labels[annotations.CNIReadyLabel] == "true"
			if tc.uninstall {
				if entry || !errors.Is(binErr, os.ErrNotExist) || label {
					t.Errorf("DaemonSet going away: entry %v, binary %v, label %v; want all removed", entry, binErr, label)
				}
			} else if !entry || binErr != nil || !label {
				t.Errorf("DaemonSet stays: entry %v, binary %v, label %v; want all in place", entry, binErr, label)
			}
		})
	}
}
