package clustercheck

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	admission "k8s.io/api/admission/v1"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/validator"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// The checks against the real kube-apiserver: an installation as the chart makes it (its
// controllers' work — endpoints, rollout and pod status — written by the test, since no
// kubelet or controller runs), healthy, then broken in the ways that need no kubelet.
func TestIntegrationCheckCluster(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	now := time.Now()

	ca := newCA(t, "detour webhook CA")
	server := tlsServer(t, ca.serving(t, 365*24*time.Hour, WebhookService, serviceName))
	f := newFixture(ca.pem, now)
	// Until the last step, the API server must not call the webhook: nothing serves its Service.
	f.mwc.Webhooks[0].ObjectSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"detour.dev/test": "never"}}
	t.Cleanup(func() {
		client.AdmissionregistrationV1().MutatingWebhookConfigurations().Delete(context.Background(), WebhookConfiguration, metav1.DeleteOptions{})
	})
	objs := f.all()
	slices.SortStableFunc(objs, func(a, b runtime.Object) int { // namespaces first
		_, an := a.(*corev1.Namespace)
		_, bn := b.(*corev1.Namespace)
		return cmp.Compare(b2i(bn), b2i(an))
	})
	for _, o := range objs {
		create(t, client, o)
	}
	// What the controllers and kubelets would write.
	d, err := client.AppsV1().Deployments(ns).Get(ctx, WebhookDeployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d.Status = f.deploy.Status
	if _, err := client.AppsV1().Deployments(ns).UpdateStatus(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range f.agents {
		setStatus(t, client, p)
	}
	setStatus(t, client, injectedPod("shop", "web-1", 0))

	run := func(at time.Time) (Report, string) {
		r := New(client, WithDialer(dialTo(server)), WithHost(cfg.Host), WithAdmissionProbe(false), WithClock(func() time.Time { return at })).Run(ctx)
		var b bytes.Buffer
		r.WriteText(&b)
		return r, b.String()
	}
	r, text := run(time.Now())
	t.Logf("healthy:\n%s", text)
	if r.Failed() || r.Warnings != 0 || len(r.Results) != len(CheckNames)-1 { // every check but the admission probe
		t.Fatalf("the healthy installation: %d errors, %d warnings, %d results", r.Errors, r.Warnings, len(r.Results))
	}

	// Break it: a caBundle of another CA, a node still tainted (and without an agent), a pod
	// whose validator found no redirect, a repair Event, the webhook scaled to 0.
	mwc, err := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, WebhookConfiguration, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	mwc.Webhooks[0].ClientConfig.CABundle = newCA(t, "another CA").pem
	if _, err := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Update(ctx, mwc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	create(t, client, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-c"},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: StartupTaint, Effect: corev1.TaintEffectNoSchedule}}}})
	failed := injectedPod("shop", "web-2", validator.ExitNoRedirect)
	create(t, client, failed)
	setStatus(t, client, failed)
	create(t, client, repairEvent("web-0", "Delete", now))
	if d, err = client.AppsV1().Deployments(ns).Get(ctx, WebhookDeployment, metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	d.Spec.Replicas = ptr.To[int32](0)
	if d, err = client.AppsV1().Deployments(ns).Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation}
	if _, err := client.AppsV1().Deployments(ns).UpdateStatus(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	// Five minutes later: node-c has carried the taint for longer than a new node does.
	r, text = run(time.Now().Add(5 * time.Minute))
	t.Logf("broken:\n%s", text)
	for name, want := range map[string]Status{
		"webhook-certificate": Error, "webhook-deployment": Error, "node-agent": Error, "startup-taint": Error,
		"validator": Error, "repair": Warning, "ready-label": OK, "webhook-config": OK,
	} {
		if got := find(r, name); got.Status != want {
			t.Errorf("%s: %s %q, want %s", name, got.Status, got.Message, want)
		}
	}
	if !r.Failed() {
		t.Error("the broken installation passed the check")
	}

	// The API server's own call: a webhook it can reach (a URL on this host; nothing routes the
	// Service's ClusterIP here) injects the dry-run probe; once it is gone, the probe comes back
	// uninjected (failurePolicy Ignore). Nothing is stored either way.
	hook, stopHook := admissionServer(t, ca.serving(t, 365*24*time.Hour, "127.0.0.1"))
	mwc, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, WebhookConfiguration, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	mwc.Webhooks[0].ObjectSelector = nil
	mwc.Webhooks[0].TimeoutSeconds = ptr.To[int32](2)
	mwc.Webhooks[0].ClientConfig = admissionv1.WebhookClientConfig{URL: ptr.To("https://" + hook + "/mutate-v1-pod"), CABundle: ca.pem}
	if _, err := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Update(ctx, mwc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	probe := func() Result {
		t.Helper()
		r := New(client, WithDialer(dialTo(server))).Run(ctx)
		if pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=detour-check"}); err != nil || len(pods.Items) > 0 {
			t.Errorf("the probe pod was stored: %v %v", err, pods)
		}
		return find(r, "webhook-admission")
	}
	// The API server reads webhook configurations from an informer: wait for the change.
	var res Result
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if res = probe(); res.Status == OK {
			break
		}
	}
	if res.Status != OK || !strings.Contains(res.Message, "the API server called the webhook: a dry-run pod in namespace shop came back injected (detour v-test)") {
		t.Errorf("webhook-admission with a reachable webhook: %s %q", res.Status, res.Message)
	}
	// The same with only the permissions docs/operations.md grants (the API server checks them;
	// the port-forward is not exercised here).
	checker := impersonate(t, cfg, client)
	r = New(checker, WithDialer(dialTo(server))).Run(ctx)
	for _, res := range r.Results {
		if strings.Contains(res.Message, "forbidden") {
			t.Errorf("with the documented role: %s: %s", res.Name, res.Message)
		}
	}
	if got := find(r, "webhook-admission"); got.Status != OK {
		t.Errorf("webhook-admission with the documented role: %s %q", got.Status, got.Message)
	}
	stopHook()
	if res = probe(); res.Status != Error || !strings.Contains(res.Message, "came back uninjected after") {
		t.Errorf("webhook-admission with the webhook gone: %s %q", res.Status, res.Message)
	}
}

// admissionServer is a mutating webhook on a loopback port that marks every pod injected. It
// returns its address and a function that stops it (and closes its connections).
func admissionServer(t *testing.T, cert tls.Certificate) (string, func()) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var review admission.AdmissionReview
		if err := json.NewDecoder(req.Body).Decode(&review); err != nil || review.Request == nil {
			http.Error(w, "bad review", http.StatusBadRequest)
			return
		}
		patch := []byte(`[{"op":"add","path":"/metadata/annotations/detour.dev~1injected","value":"v-test"}]`)
		review.Response = &admission.AdmissionResponse{UID: review.Request.UID, Allowed: true, Patch: patch, PatchType: ptr.To(admission.PatchTypeJSONPatch)}
		review.Request = nil
		json.NewEncoder(w).Encode(review)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String(), func() { srv.Close() }
}

func create(t *testing.T, client kubernetes.Interface, o runtime.Object) {
	t.Helper()
	ctx := context.Background()
	opts := metav1.CreateOptions{}
	var err error
	switch v := o.(type) {
	case *corev1.Namespace:
		_, err = client.CoreV1().Namespaces().Create(ctx, v, opts)
	case *corev1.Node:
		_, err = client.CoreV1().Nodes().Create(ctx, v, opts)
	case *corev1.Pod:
		_, err = client.CoreV1().Pods(v.Namespace).Create(ctx, v, opts)
	case *corev1.Service:
		_, err = client.CoreV1().Services(v.Namespace).Create(ctx, v, opts)
	case *corev1.ConfigMap:
		_, err = client.CoreV1().ConfigMaps(v.Namespace).Create(ctx, v, opts)
	case *corev1.Event:
		_, err = client.CoreV1().Events(v.Namespace).Create(ctx, v, opts)
	case *admissionv1.MutatingWebhookConfiguration:
		_, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, v, opts)
	case *discoveryv1.EndpointSlice:
		_, err = client.DiscoveryV1().EndpointSlices(v.Namespace).Create(ctx, v, opts)
	case *appsv1.Deployment:
		_, err = client.AppsV1().Deployments(v.Namespace).Create(ctx, v, opts)
	case *appsv1.DaemonSet:
		_, err = client.AppsV1().DaemonSets(v.Namespace).Create(ctx, v, opts)
	default:
		t.Fatalf("create %T: not a kind the test creates", o)
	}
	if err != nil {
		t.Fatalf("create %T: %v", o, err)
	}
}

// setStatus writes a pod's status as its kubelet would.
func setStatus(t *testing.T, client kubernetes.Interface, want *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	p, err := client.CoreV1().Pods(want.Namespace).Get(ctx, want.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Status = *want.Status.DeepCopy()
	for i := range p.Status.InitContainerStatuses {
		p.Status.InitContainerStatuses[i].Image = image
	}
	for i := range p.Status.ContainerStatuses {
		p.Status.ContainerStatuses[i].Image = image
	}
	if _, err := client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update the status of pod %s/%s: %v", p.Namespace, p.Name, err)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// impersonate returns a client for a user that has the role docs/operations.md documents for
// detour check --cluster, and nothing else.
func impersonate(t *testing.T, cfg *rest.Config, admin kubernetes.Interface) kubernetes.Interface {
	t.Helper()
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(doc), "<!-- detour-check-rbac -->\n```yaml\n")
	block, _, ok2 := strings.Cut(after, "```")
	if !ok || !ok2 {
		t.Fatal("docs/operations.md has no detour-check-rbac yaml block")
	}
	var role rbacv1.ClusterRole
	if err := yaml.UnmarshalStrict([]byte(block), &role); err != nil {
		t.Fatalf("the documented role: %v", err)
	}
	ctx := context.Background()
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	const user = "detour-checker"
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: role.Name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := rest.CopyConfig(cfg)
	c.Impersonate = rest.ImpersonationConfig{UserName: user}
	// RBAC is read from an informer: wait until the user can list nodes.
	client := kubernetes.NewForConfigOrDie(c)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the documented role does not take effect: %v", err)
		}
	}
	return client
}
