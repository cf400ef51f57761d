package webhook_test

import (
	"context"
	"crypto/tls"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/annotations"
)

// foldable is a configuration under which the check may run in the proxy's start, with
// validator.mode mode.
func foldable(mode string) string {
	return "sidecarMode: native\nproxy: {image: proxy.example/proxy:test, command: [proxy], startupProbe: {tcpSocket: {port: 4191}}}\n" +
		"validator: {image: detour:test, mode: " + mode + "}\n"
}

// serviceAccount returns an identity for envOptions: the webhook runs as a service account
// (impersonated) bound to a ClusterRole with rules.
func serviceAccount(name string, rules ...rbacv1.PolicyRule) func(t *testing.T, admin *rest.Config) *rest.Config {
	return func(t *testing.T, admin *rest.Config) *rest.Config {
		t.Helper()
		ctx := context.Background()
		cs := kubernetes.NewForConfigOrDie(admin)
		user := "system:serviceaccount:detour-system:" + name
		if _, err := cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		cfg := rest.CopyConfig(admin)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:serviceaccounts", "system:authenticated"}}
		return cfg
	}
}

var (
	readNamespaces = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list", "watch"}}
	watchNodes     = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"list", "watch"}}
	readMetrics    = rbacv1.PolicyRule{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}
)

// labelledNode registers a Node that carries detour.dev/image-volumes=true, as a node agent
// leaves one whose kubelet and runtime mount image volumes.
func (e *env) labelledNode(t *testing.T) {
	t.Helper()
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{annotations.ImageVolumesLabel: "true", corev1.LabelOSStable: "linux"}},
		Status:     corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{KubeletVersion: "v1.37.2", ContainerRuntimeVersion: "containerd://2.4.2"}},
	}
	if _, err := e.client.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// admit creates a pod in an opted-in namespace and returns it as stored, with its warnings.
func (e *env) admit(t *testing.T, ann map[string]string) (*corev1.Pod, []string) {
	t.Helper()
	ns := e.namespace(t, map[string]string{annotations.Inject: "enabled"})
	got, err := e.client.CoreV1().Pods(ns).Create(context.Background(), testPod("web", ann), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got, e.warnings.take()
}

// eventually polls cond until it holds, for at most 30s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after 30s", what)
		}
	}
}

// Issue 34, defect 3: a webhook that may not list nodes (custom RBAC, or its image upgraded
// before the chart) becomes Ready — startEnvWith waits for /readyz — and injects the validator
// init container, saying why in its log, in both validator modes; with the chart's RBAC the same
// configuration runs the check in the proxy's start.
func TestIntegrationWebhookWithoutNodeRBAC(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mode   string
		rules  []rbacv1.PolicyRule
		folded bool
	}{
		{"auto without nodes", "auto", []rbacv1.PolicyRule{readNamespaces, readMetrics}, false},
		{"init-container without nodes", "init-container", []rbacv1.PolicyRule{readNamespaces}, false},
		{"auto with the chart's RBAC", "auto", []rbacv1.PolicyRule{readNamespaces, readMetrics, watchNodes}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := startEnvWith(t, envOptions{identity: serviceAccount("limited", tc.rules...), keepLog: true, config: foldable(tc.mode)})
			e.labelledNode(t)
			var pod *corev1.Pod
			eventually(t, "the decision settles", func() bool {
				pod, _ = e.admit(t, nil)
				return !tc.folded || pod.Annotations[annotations.Validator] == string(annotations.ValidatorImageVolume)
			})
			if got := pod.Annotations[annotations.Validator]; (got == string(annotations.ValidatorImageVolume)) != tc.folded {
				t.Errorf("detour.dev/validator = %q, want folded %v", got, tc.folded)
			}
			if tc.mode == "auto" && !tc.folded && !strings.Contains(e.logs.String(), "the webhook may not list nodes (its RBAC)") {
				t.Errorf("the webhook's log does not say why:\n%s", e.logs.String())
			}
		})
	}
}

// Issue 34, defect 4: an API server whose ImageVolume gate is off drops a pod's image volume and
// its mounts. The webhook reads the gate from the API server's /metrics (here a 1.37 API server
// emulating 1.35 with the gate off): validator.mode image-volume falls back to the init
// container, saying why, and so does a pod that asks for it, with a warning. An API server whose
// metrics the webhook may not read leaves it unsure: the init container too.
func TestIntegrationWebhookImageVolumeGate(t *testing.T) {
	off := envOptions{apiServerArgs: map[string]string{"emulated-version": "1.35", "feature-gates": "ImageVolume=false"}, keepLog: true, config: foldable("image-volume")}
	e := startEnvWith(t, off)
	e.labelledNode(t)
	pod, _ := e.admit(t, nil)
	if got := pod.Annotations[annotations.Validator]; got != string(annotations.ValidatorInitContainer) {
		t.Errorf("gate off, validator.mode image-volume: detour.dev/validator = %q, want init-container", got)
	}
	if !strings.Contains(e.logs.String(), "has its ImageVolume feature gate off") {
		t.Errorf("the webhook's log does not say the gate is off:\n%s", e.logs.String())
	}

	off.config = foldable("auto")
	e = startEnvWith(t, off)
	e.labelledNode(t)
	pod, warnings := e.admit(t, map[string]string{annotations.ValidatorMode: "image-volume"})
	if got := pod.Annotations[annotations.Validator]; got != string(annotations.ValidatorInitContainer) || !hasWarning(warnings, "image-volume (from the pod's annotation) cannot be granted: the API server") {
		t.Errorf("gate off, a pod asking for image-volume: detour.dev/validator = %q, warnings %q", got, warnings)
	}

	blind := envOptions{identity: serviceAccount("blind", readNamespaces, watchNodes), keepLog: true, config: foldable("auto")}
	e = startEnvWith(t, blind)
	e.labelledNode(t)
	pod, _ = e.admit(t, nil)
	if got := pod.Annotations[annotations.Validator]; got != string(annotations.ValidatorInitContainer) || !strings.Contains(e.logs.String(), "reading the API server's /metrics was forbidden") {
		t.Errorf("metrics forbidden: detour.dev/validator = %q; log:\n%s", got, e.logs.String())
	}
}

// Issue 34: at SIGTERM a replica first turns unready and keeps serving for its shutdown delay,
// so that the endpoints drop it before it closes its port: during the delay /readyz fails and
// admissions are still answered; after it the port is closed and Run returns.
func TestIntegrationWebhookDrains(t *testing.T) {
	e := startEnvWith(t, envOptions{shutdownDelay: 3 * time.Second})
	start := time.Now()
	e.stop()
	eventually(t, "/readyz fails", func() bool {
		resp, err := http.Get("http://" + e.healthAddr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode != http.StatusOK
	})
	if pod, _ := e.admit(t, nil); !annotations.IsInjected(pod.Annotations) {
		t.Error("an admission while draining was not injected")
	}
	if err := <-e.done; err != nil {
		t.Errorf("webhook.Run: %v", err)
	}
	close(e.done)
	if elapsed := time.Since(start); elapsed < 3*time.Second {
		t.Errorf("the webhook stopped %s after SIGTERM, before its 3s delay", elapsed)
	}
	if c, err := tls.Dial("tcp", e.webhookAddr, &tls.Config{InsecureSkipVerify: true}); err == nil { //nolint:gosec // only whether the port is open
		c.Close()
		t.Error("the webhook's port still accepts connections after Run returned")
	}
}
