package nodeagent_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/testenv"
)

// daemonSetPod creates, in the real API server, a DaemonSet and a pod of it on node (no
// controllers run here: the objects are what the DaemonSet controller would have made).
func daemonSetPod(t *testing.T, client kubernetes.Interface, node string) (*appsv1.DaemonSet, *corev1.Pod) {
	t.Helper()
	ns := randomName("detour-")
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return daemonSetPodIn(t, client, ns, node, "")
}

// daemonSetPodIn is [daemonSetPod] in an existing namespace, its pod run as the service account
// sa ("" for the default).
func daemonSetPodIn(t *testing.T, client kubernetes.Interface, ns, node, sa string) (*appsv1.DaemonSet, *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
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
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, Containers: []corev1.Container{{Name: "install-cni", Image: "detour:test"}}},
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

// The agent's own token is bound to its pod: the API server refuses it once the pod object is
// gone, or a minute after its grace period ended — which a SIGTERM delayed by a slow or
// restarting kubelet can come after. That alone is no uninstall: the plugin's token, still
// accepted, says detour's service accounts stay. helm uninstall deletes both accounts with the
// DaemonSet: then both tokens are refused and the agent uninstalls.
func TestIntegrationUninstallWhenOwnTokenRefused(t *testing.T) {
	for _, tc := range []struct {
		name      string
		uninstall bool
		logs      []string // in the agent's log at SIGTERM
	}{
		{"only the agent's pod is gone", false, []string{"refuses the agent's token but accepts the plugin's"}},
		// The agent may no longer take the ready label off: it says so, with the fix.
		{"the release is uninstalled", true, []string{"the plugin's is refused too", "keeps its ready label", "kubectl label node"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newRBACFixture(t)
			ctx := context.Background()
			node := registerNode(t, f.admin)
			e := newEnv(t)
			f.agentIdentity(t, e, "detour-node")
			ds, pod := daemonSetPodIn(t, f.admin, f.ns, node.Name, "detour-node")
			f.allowTokenFor(t, "detour-node")
			f.clusterRole(t, "detour-node", "agent",
				rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch", "patch"}},
				rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
				rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"get"}})
			// The kubelet mounts a token bound to the agent's pod.
			tr, err := f.admin.CoreV1().ServiceAccounts(f.ns).CreateToken(ctx, "detour-node", &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
				BoundObjectRef: &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
			}}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			e.rotateToken(t, tr.Status.Token, f.cfg.CAData)
			e.flags.NodeName = node.Name
			primary := filepath.Join(e.confDir, "10-calico.conflist")
			writeFile(t, primary, calico)
			var log bytes.Buffer // read once the agent has stopped
			a := e.agent(t, nodeagent.WithNodeClient(kubernetes.NewForConfigOrDie(agentConfig(f.cfg, e.saDir))),
				nodeagent.WithOwnPod(pod.Namespace, pod.Name), nodeagent.WithTokenClient(nodeagent.TokenClients(f.cfg)), nodeagent.WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
			stop := run(t, a)
			eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })

			gone := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
			if err := f.admin.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, gone); err != nil {
				t.Fatal(err)
			}
			if tc.uninstall {
				if err := f.admin.AppsV1().DaemonSets(ds.Namespace).Delete(ctx, ds.Name, metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
				for _, sa := range []string{"detour-node", "detour-cni"} {
					if err := f.admin.CoreV1().ServiceAccounts(f.ns).Delete(ctx, sa, metav1.DeleteOptions{}); err != nil {
						t.Fatal(err)
					}
				}
			}
			eventually(t, "the agent's token is refused", func() bool {
				return strings.HasPrefix(f.whoami(t, tr.Status.Token), "unauthenticated")
			})
			if err := stop(); err != nil { // SIGTERM
				t.Fatal(err)
			}
			entry := slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni")
			if entry == tc.uninstall {
				t.Errorf("entry in place after SIGTERM: %v; want uninstalled %v", entry, tc.uninstall)
			}
			for _, want := range tc.logs {
				if !strings.Contains(log.String(), want) {
					t.Errorf("the agent's log does not say %q:\n%s", want, log.String())
				}
			}
		})
	}
}

// A node whose Node object is deleted is leaving the cluster: the agent takes detour off its
// disk — entry, binary, kubeconfig, token — while it still runs (the pod garbage collector
// deletes its pod only 40 s later), and the node keeps its primary's configuration. When the
// kubelet registers the node again, the agent installs detour again.
func TestIntegrationUninstallWhenNodeDeleted(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	node := registerNode(t, client)
	e := newEnv(t)
	e.flags.NodeName = node.Name
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t, nodeagent.WithNodeClient(client))
	run(t, a)
	eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })
	detour := func() []string {
		var found []string
		if slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni") {
			found = append(found, primary+" (entry)")
		}
		for _, dir := range []string{e.confDir, e.binDir} {
			entries, _ := os.ReadDir(dir)
			for _, f := range entries {
				if f.Name() != filepath.Base(primary) {
					found = append(found, filepath.Join(dir, f.Name()))
				}
			}
		}
		return found
	}
	if len(detour()) == 0 {
		t.Fatal("the agent is ready but installed nothing")
	}

	if err := client.CoreV1().Nodes().Delete(ctx, node.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "detour to leave the deleted node's disk, and the agent to say why", func() bool {
		ok, reason := a.Ready()
		return len(detour()) == 0 && ok && strings.Contains(reason, "Node object is deleted")
	})
	if !slices.Equal(pluginTypes(t, readFile(t, primary)), pluginTypes(t, calico)) {
		t.Errorf("the primary's conflist changed: %s", readFile(t, primary))
	}
	// Resyncs (every second here) leave it off while the node stays deleted.
	time.Sleep(2500 * time.Millisecond)
	if left := detour(); len(left) != 0 {
		t.Fatalf("detour came back on a deleted node: %v", left)
	}

	again := node.DeepCopy()
	again.ResourceVersion, again.UID = "", ""
	if _, err := client.CoreV1().Nodes().Create(ctx, again, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "detour back on the node registered again", func() bool {
		n, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		return err == nil && n.Labels[annotations.CNIReadyLabel] == "true" && !hasStartupTaint(n) &&
			slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni")
	})
}

// helm uninstall during a rollout can send SIGTERM to a new agent before its first look at its
// own pod: it looks then, and still uninstalls.
func TestIntegrationUninstallAtSIGTERMBeforeTheFirstLook(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	node := registerNode(t, client)
	ds, pod := daemonSetPod(t, client, node.Name)
	e := newEnv(t)
	e.flags.NodeName = node.Name
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, strings.Replace(calico, `{"portMappings": true}}`, `{"portMappings": true}}, {"type": "detour-cni"}`, 1))
	if err := client.AppsV1().DaemonSets(ds.Namespace).Delete(context.Background(), ds.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithOwnPod(pod.Namespace, pod.Name))
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // SIGTERM before Run's first reconcile could read anything
	if err := a.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni") {
		t.Errorf("the entry stayed after SIGTERM with the DaemonSet deleted:\n%s", readFile(t, primary))
	}
}
