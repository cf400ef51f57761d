package manifests_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/testenv"
)

// The chart's ValidatingAdmissionPolicies, in the real API server: the webhook-written
// annotations cannot change after creation, and the node agent may change only its own node and
// its node's pods.
func TestIntegrationPolicies(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	admin := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	ns := installed(t)

	t.Run("webhook-written annotations are frozen", func(t *testing.T) {
		r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, ExemptGIDs: []uint32{2600}}
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "frozen", Namespace: ns, Annotations: r.Annotations()},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
		}
		if _, err := admin.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		forge := []byte(`{"metadata":{"annotations":{"` + annotations.ExemptUIDs + `":"1000"}}}`)
		var err error
		// A new policy takes a moment to be loaded by the API server.
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			_, err = admin.CoreV1().Pods(ns).Patch(ctx, "frozen", types.MergePatchType, forge, metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}})
			if err != nil {
				break
			}
		}
		if err == nil || !strings.Contains(err.Error(), "cannot be changed after the pod is created") {
			t.Fatalf("adding an exemption to a created pod = %v; want the policy's denial", err)
		}
		if _, err := admin.CoreV1().Pods(ns).Patch(ctx, "frozen", types.MergePatchType, []byte(`{"metadata":{"annotations":{"team":"shop"}}}`), metav1.PatchOptions{}); err != nil {
			t.Errorf("changing another annotation: %v", err)
		}
	})

	t.Run("the node agent changes only its own node and its pods", func(t *testing.T) {
		for _, n := range []string{"agent-node", "other-node"} {
			if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		podOn := func(name, node, sa string) *corev1.Pod {
			p, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
				Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, AutomountServiceAccountToken: new(bool),
					Containers: []corev1.Container{{Name: "c", Image: "example.invalid/c"}}},
			}, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		agentPod := podOn("detour-node-agent-x", "agent-node", "detour-node-agent")
		podOn("mine", "agent-node", "")
		podOn("theirs", "other-node", "")
		// The agent's projected token: bound to its pod, so it carries the pod's node.
		tr, err := admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "detour-node-agent", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
			BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: agentPod.Name, UID: agentPod.UID},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		agentCfg := rest.AnonymousClientConfig(cfg)
		agentCfg.BearerToken = tr.Status.Token
		agent := kubernetes.NewForConfigOrDie(agentCfg)
		label := []byte(`{"metadata":{"labels":{"detour.dev/cni-ready":"true"}}}`)
		dry := metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}}

		var err2 error
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if _, err2 = agent.CoreV1().Nodes().Patch(ctx, "other-node", types.MergePatchType, label, dry); err2 != nil {
				break
			}
		}
		if err2 == nil || !strings.Contains(err2.Error(), "may not change node other-node") {
			t.Fatalf("the agent patching another node = %v; want the policy's denial", err2)
		}
		if _, err := agent.CoreV1().Nodes().Patch(ctx, "agent-node", types.MergePatchType, label, dry); err != nil {
			t.Errorf("the agent patching its own node: %v", err)
		}
		if err := agent.CoreV1().Pods(ns).Delete(ctx, "theirs", metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}); err == nil || !strings.Contains(err.Error(), "pods of another node") {
			t.Errorf("the agent deleting a pod of another node = %v; want the policy's denial", err)
		}
		if err := agent.CoreV1().Pods(ns).Delete(ctx, "mine", metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
			t.Errorf("the agent deleting a pod of its node: %v", err)
		}
	})
}

func admissionGVR(resource string) schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "admissionregistration.k8s.io", Version: "v1", Resource: resource}
}

var install struct {
	sync.Once
	err error
}

// installed installs the chart's service accounts, RBAC and policies into namespace
// installedNamespace of the shared API server, once per test process, and returns the namespace.
func installed(t *testing.T) string {
	t.Helper()
	cfg := testenv.ControlPlane(t)
	install.Do(func() { install.err = installChart(cfg, installedNamespace) })
	if install.err != nil {
		t.Fatal(install.err)
	}
	return installedNamespace
}

const installedNamespace = "detour-checks"

func installChart(cfg *rest.Config, ns string) error {
	ctx := context.Background()
	client := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	out, err := exec.Command(filepath.Join(testenv.BinDir(), "helm"), "template", "detour", chart, "--namespace", ns, "--set", "createNamespace=false", "--set", proxyImage).Output()
	if err != nil {
		return fmt.Errorf("helm template: %w", err)
	}
	objs, err := decodeAll(out)
	if err != nil {
		return err
	}
	for _, o := range objs {
		var gvr schema.GroupVersionResource
		switch o.GetKind() {
		case "ValidatingAdmissionPolicy":
			gvr = admissionGVR("validatingadmissionpolicies")
		case "ValidatingAdmissionPolicyBinding":
			gvr = admissionGVR("validatingadmissionpolicybindings")
		case "ServiceAccount":
			gvr = corev1.SchemeGroupVersion.WithResource("serviceaccounts")
		case "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding":
			gvr = schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: strings.ToLower(o.GetKind()) + "s"}
		default:
			continue
		}
		var ri dynamic.ResourceInterface = dyn.Resource(gvr)
		if o.GetNamespace() != "" {
			ri = dyn.Resource(gvr).Namespace(o.GetNamespace())
		}
		if _, err := ri.Create(ctx, o, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return nil
}
