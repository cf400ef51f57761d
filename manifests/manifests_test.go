// Package manifests_test checks the Helm chart and the rendered bundle: helm lint and template
// for several value sets, no drift between the chart and install.yaml, agreement with the code
// (mutate path, flags, webhook configuration), and — against the real local API server — that
// every object is accepted (server-side dry-run) and that RBAC grants each component exactly
// what it needs.
package manifests_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilversion "k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/webhook"
)

var update = flag.Bool("update", false, "regenerate install.yaml from the chart")

func TestMain(m *testing.M) { testenv.Main(m) }

const (
	chart     = "charts/detour"
	namespace = "detour-system"
)

// valueSets are the configurations the tests render.
var valueSets = map[string][]string{
	"default":      nil,
	"cert-manager": {"webhook.certificates.mode=cert-manager"},
	"uninstall":    {"nodeAgent.uninstall=true", "nodeAgent.repair.enabled=false"},
	"strict":       {"webhook.failurePolicy=Fail", "webhook.replicas=3", "webhook.config.conflictPolicy=deny", "nodeAgent.plugin.logFile=/var/log/detour-cni.log"},
	"monitoring": {"metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
		"metrics.prometheusRule.enabled=true", "metrics.dashboard.enabled=true", "metrics.prometheusRule.alerts.DetourNodeNotReady.for=30m"},
	"monitoring-pods": {"metrics.podMonitor.enabled=true", "metrics.scrapeAnnotations=false"},
}

// monitoringKinds are the objects only metrics.* values add, and the value sets that add each.
var monitoringKinds = map[string]string{"ServiceMonitor": "monitoring", "PodMonitor": "monitoring-pods", "PrometheusRule": "monitoring"}

func helm(t *testing.T, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(testenv.Binary(t, "helm"), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return out
}

// proxyImage is the value every rendering but the bundle's must set (the chart has no default).
const proxyImage = "webhook.config.proxy.image=registry.example/mesh/proxy:v1"

func render(t *testing.T, sets []string) []byte {
	t.Helper()
	return renderRaw(t, append([]string{proxyImage}, sets...))
}

func renderRaw(t *testing.T, sets []string) []byte {
	t.Helper()
	args := []string{"template", "detour", chart, "--namespace", namespace}
	for _, s := range sets {
		args = append(args, "--set", s)
	}
	return helm(t, args...)
}

// objects splits a rendered stream into objects.
func objects(t *testing.T, rendered []byte) []*unstructured.Unstructured {
	t.Helper()
	objs, err := decodeAll(rendered)
	if err != nil {
		t.Fatalf("decode rendered manifests: %v", err)
	}
	return objs
}

func decodeAll(rendered []byte) ([]*unstructured.Unstructured, error) {
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(rendered), 4096)
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return nil, err
		}
		if o != nil {
			out = append(out, &unstructured.Unstructured{Object: o})
		}
	}
}

func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string, into any) {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			b, _ := o.MarshalJSON()
			if err := yaml.Unmarshal(b, into); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no %s %s in the rendered manifests", kind, name)
}

// The webhook watches nodes only where the check may run in the proxy's start: with
// validator.mode init-container its ClusterRole has no rule on nodes (issue 32, item 7).
func TestWebhookNodesRuleFollowsTheValidatorMode(t *testing.T) {
	for _, tc := range []struct {
		mode  string
		nodes bool
	}{{"", true}, {"auto", true}, {"image-volume", true}, {"init-container", false}} {
		var sets []string
		if tc.mode != "" {
			sets = append(sets, "webhook.config.validator.mode="+tc.mode)
		}
		var role rbacv1.ClusterRole
		find(t, objects(t, render(t, sets)), "ClusterRole", "detour-webhook", &role)
		has := slices.ContainsFunc(role.Rules, func(r rbacv1.PolicyRule) bool { return slices.Contains(r.Resources, "nodes") })
		metrics := slices.ContainsFunc(role.Rules, func(r rbacv1.PolicyRule) bool { return slices.Contains(r.NonResourceURLs, "/metrics") })
		if has != tc.nodes || metrics != tc.nodes {
			t.Errorf("validator.mode %q: the webhook's ClusterRole has a rule on nodes: %v, on /metrics: %v; want %v", tc.mode, has, metrics, tc.nodes)
		}
	}
}

// One version for a release (issue 34): the chart's version is the file VERSION, its appVersion
// (the image tag it installs by default) the same with a v, and hack/previous-release names an
// older release by a commit.
func TestChartVersionIsTheRelease(t *testing.T) {
	raw, err := os.ReadFile("../VERSION")
	if err != nil {
		t.Fatal(err)
	}
	release := strings.TrimSpace(string(raw))
	current, err := utilversion.ParseSemantic(release)
	if err != nil {
		t.Fatalf("VERSION %q is not a semantic version: %v", release, err)
	}
	var meta struct{ Version, AppVersion string }
	b, err := os.ReadFile(filepath.Join(chart, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &meta); err != nil {
		t.Fatal(err)
	}
	if meta.Version != release || meta.AppVersion != "v"+release {
		t.Errorf("Chart.yaml has version %q and appVersion %q; VERSION says %q: set them to %q and %q", meta.Version, meta.AppVersion, release, release, "v"+release)
	}
	prev, err := os.ReadFile("../hack/previous-release")
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]string{}
	for line := range strings.Lines(string(prev)) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), " "); ok && !strings.HasPrefix(k, "#") {
			fields[k] = v
		}
	}
	pv, err := utilversion.ParseSemantic(fields["version"])
	if err != nil || !pv.LessThan(current) || len(fields["commit"]) != 40 {
		t.Errorf("hack/previous-release names %q at commit %q: want a release older than %s and a full commit hash", fields["version"], fields["commit"], release)
	}
}

func TestHelmLintAndTemplate(t *testing.T) {
	for name, sets := range valueSets {
		t.Run(name, func(t *testing.T) {
			args := []string{"lint", "--strict", chart}
			for _, s := range append([]string{proxyImage}, sets...) {
				args = append(args, "--set", s)
			}
			helm(t, args...)
			objs := objects(t, render(t, sets))
			if len(objs) < 10 {
				t.Fatalf("rendered only %d objects", len(objs))
			}
			// The monitors, the rules and the dashboard only when asked for (off by default).
			for kind, set := range monitoringKinds {
				has := slices.ContainsFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() == kind })
				if has != (name == set) {
					t.Errorf("%s rendered: %v", kind, has)
				}
			}

			// The webhook's configuration in the ConfigMap is one the real webhook accepts.
			var cm corev1.ConfigMap
			find(t, objs, "ConfigMap", "detour-webhook", &cm)
			if _, err := inject.ParseConfig([]byte(cm.Data["config.yaml"])); err != nil {
				t.Errorf("the chart's webhook configuration is rejected by the webhook: %v\n%s", err, cm.Data["config.yaml"])
			}

			var ds appsv1.DaemonSet
			find(t, objs, "DaemonSet", "detour-node-agent", &ds)
			for _, c := range ds.Spec.Template.Spec.Containers {
				checkFlags(t, c)
			}
			// Issue 15.11: Linux nodes only (no Windows or virtual nodes, where rollout status
			// would wait for ever), and a context that may write the CNI dirs under SELinux.
			if ds.Spec.Template.Spec.NodeSelector["kubernetes.io/os"] != "linux" {
				t.Errorf("the node agent's nodeSelector %v lacks kubernetes.io/os: linux", ds.Spec.Template.Spec.NodeSelector)
			}
			if se := ds.Spec.Template.Spec.Containers[0].SecurityContext.SELinuxOptions; se == nil || se.Type != "spc_t" {
				t.Errorf("install-cni's seLinuxOptions %+v, want type spc_t", se)
			}
			if name == "uninstall" {
				// Uninstall mode removes detour from the nodes and injects nothing meanwhile.
				if slices.ContainsFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() == "MutatingWebhookConfiguration" }) {
					t.Error("uninstall mode must not register the webhook")
				}
				if args := ds.Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, "--uninstall") || !slices.Contains(args, "--hold") {
					t.Errorf("uninstall mode runs install-cni with %v, want --uninstall --hold", args)
				}
				return
			}

			// The policy that freezes the webhook-written annotations names exactly those keys.
			var vap admissionv1.ValidatingAdmissionPolicy
			find(t, objs, "ValidatingAdmissionPolicy", "detour-webhook-annotations", &vap)
			expr := vap.Spec.Validations[0].Expression
			for _, k := range annotations.WebhookKeys {
				if !strings.Contains(expr, "'"+k+"'") {
					t.Errorf("the annotation policy does not protect %s", k)
				}
			}
			if n := strings.Count(expr, "'detour.dev/"); n != len(annotations.WebhookKeys) {
				t.Errorf("the annotation policy names %d keys, annotations.WebhookKeys has %d", n, len(annotations.WebhookKeys))
			}

			// The MutatingWebhookConfiguration calls the path the code serves.
			var mwc admissionv1.MutatingWebhookConfiguration
			find(t, objs, "MutatingWebhookConfiguration", "detour", &mwc)
			wh := mwc.Webhooks[0]
			if got := *wh.ClientConfig.Service.Path; got != webhook.MutatePath {
				t.Errorf("the chart's webhook path %q is not webhook.MutatePath %q", got, webhook.MutatePath)
			}
			if *wh.ReinvocationPolicy != admissionv1.IfNeededReinvocationPolicy || *wh.SideEffects != admissionv1.SideEffectClassNone {
				t.Errorf("reinvocationPolicy %v, sideEffects %v", *wh.ReinvocationPolicy, *wh.SideEffects)
			}
			excluded := wh.NamespaceSelector.MatchExpressions[0].Values
			if !slices.Contains(excluded, namespace) || !slices.Contains(excluded, "kube-system") {
				t.Errorf("the namespaceSelector must exclude %s and kube-system: %v", namespace, excluded)
			}

			// Every flag the chart passes exists in the command it runs.
			var deploy appsv1.Deployment
			find(t, objs, "Deployment", "detour-webhook", &deploy)
			for _, c := range deploy.Spec.Template.Spec.Containers {
				checkFlags(t, c)
			}
		})
	}
	var def appsv1.Deployment
	find(t, objects(t, render(t, nil)), "Deployment", "detour-webhook", &def)
	if *def.Spec.Replicas != 2 || def.Spec.Template.Spec.Affinity.PodAntiAffinity == nil ||
		!*def.Spec.Template.Spec.Containers[0].SecurityContext.ReadOnlyRootFilesystem || !*def.Spec.Template.Spec.SecurityContext.RunAsNonRoot {
		t.Error("the webhook Deployment must run 2 non-root replicas with anti-affinity and a read-only root filesystem")
	}
}

// checkFlags fails when a container passes a flag its detour subcommand does not define.
func checkFlags(t *testing.T, c corev1.Container) {
	t.Helper()
	cmd, _, err := cli.NewRoot().Find(c.Args)
	if err != nil || cmd.Name() != c.Args[0] {
		t.Errorf("container %s runs an unknown command %q: %v", c.Name, c.Args, err)
		return
	}
	for _, a := range c.Args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || cmd.Flags().Lookup(name) == nil {
			t.Errorf("container %s passes %q, which `detour %s` does not define", c.Name, a, cmd.Name())
		}
	}
}

// install.yaml is the default rendering; `make manifests` regenerates it.
// Issue 15.11: there is no default proxy image (the one the chart named did not exist): helm
// fails without one and says what to set; the bundle renders without one and its webhook
// refuses to start until the ConfigMap sets it.
func TestProxyImageRequired(t *testing.T) {
	cmd := exec.Command(testenv.Binary(t, "helm"), "template", "detour", chart, "--namespace", namespace)
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "webhook.config.proxy.image is required") {
		t.Errorf("helm template without a proxy image: %v\n%s", err, out)
	}
	var cm corev1.ConfigMap
	find(t, objects(t, renderRaw(t, []string{"renderBundle=true"})), "ConfigMap", "detour-webhook", &cm)
	if _, err := inject.ParseConfig([]byte(cm.Data["config.yaml"])); err == nil || !strings.Contains(err.Error(), "proxy.image") {
		t.Errorf("the bundle's webhook configuration without a proxy image: %v", err)
	}
}

// cniConfigMode is checked when the chart renders, not when the agent starts on every node; the
// values chained-entry and drop-in reach the agent's flag.
func TestCNIConfigModeValue(t *testing.T) {
	cmd := exec.Command(testenv.Binary(t, "helm"), "template", "detour", chart, "--namespace", namespace, "--set", proxyImage, "--set", "nodeAgent.cniConfigMode=dropin")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), `nodeAgent.cniConfigMode "dropin" is not auto, drop-in or chained-entry`) {
		t.Errorf("helm template with cniConfigMode dropin: %v\n%s", err, out)
	}
	for _, mode := range []string{"drop-in", "chained-entry"} {
		out := helm(t, "template", "detour", chart, "--namespace", namespace, "--set", proxyImage, "--set", "nodeAgent.cniConfigMode="+mode)
		if !bytes.Contains(out, []byte("--cni-config-mode="+mode)) {
			t.Errorf("cniConfigMode %s does not reach the agent's flag", mode)
		}
	}
}

func TestInstallYAMLMatchesChart(t *testing.T) {
	want := append([]byte(installHeader), renderRaw(t, []string{"renderBundle=true"})...)
	if *update {
		if err := os.WriteFile("install.yaml", want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile("install.yaml")
	if err != nil {
		t.Fatalf("%v (run make manifests)", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("manifests/install.yaml differs from the chart's default rendering; run make manifests")
	}
}

const installHeader = `# detour — the rendered kubectl-apply bundle: the Helm chart in manifests/charts/detour with its
# default values and namespace detour-system. Generated by make manifests; do not edit.
# It has no proxy image (detour ships none): set proxy.image in the ConfigMap detour-webhook
# first, or the webhook refuses to start ("proxy.image is required").
#   kubectl apply -f manifests/install.yaml
`

// Every rendered object is accepted by the real API server (server-side dry-run), for every
// value set; cert-manager's kinds are only checked to be the ones that need its CRDs.
func TestIntegrationServerSideDryRun(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	dyn := dynamic.NewForConfigOrDie(cfg)
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(client.Discovery()))
	ctx := context.Background()
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: "Strict"}
	// The Namespace is dry-run first, then created: the other objects are dry-run into it.
	var ns *unstructured.Unstructured
	for _, o := range objects(t, render(t, nil)) {
		if o.GetKind() == "Namespace" {
			ns = o
		}
	}
	nsAPI := dyn.Resource(corev1.SchemeGroupVersion.WithResource("namespaces"))
	if _, err := nsAPI.Create(ctx, ns, dryRun); err != nil {
		t.Fatalf("the API server rejects the Namespace: %v", err)
	}
	if _, err := nsAPI.Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The monitoring objects are checked against the Prometheus Operator's own schemas.
	installCRDs(t, ctx, dyn, "servicemonitors", "podmonitors", "prometheusrules")
	mapper.Reset()
	for name, sets := range valueSets {
		t.Run(name, func(t *testing.T) {
			for _, o := range objects(t, render(t, sets)) {
				if o.GetKind() == "Namespace" {
					continue
				}
				gvk := o.GroupVersionKind()
				m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
				if meta.IsNoMatchError(err) && gvk.Group == "cert-manager.io" {
					continue // needs cert-manager's CRDs, which this API server does not have
				}
				if err != nil {
					t.Errorf("%s %s: %v", gvk.Kind, o.GetName(), err)
					continue
				}
				var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
				if m.Scope.Name() == meta.RESTScopeNameNamespace {
					ri = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
				}
				if _, err := ri.Create(ctx, o, dryRun); err != nil {
					t.Errorf("the API server rejects %s %s/%s: %v", gvk.Kind, o.GetNamespace(), o.GetName(), err)
				}
			}
		})
	}
}

// installCRDs creates the Prometheus Operator's CustomResourceDefinitions of resources (from
// its module, cached by hack/test-binaries.sh) and waits until they are established.
func installCRDs(t *testing.T, ctx context.Context, dyn dynamic.Interface, resources ...string) {
	t.Helper()
	dir := testenv.Binary(t, "prometheus-operator-crds")
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	for _, r := range resources {
		data, err := os.ReadFile(filepath.Join(dir, "monitoring.coreos.com_"+r+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var crd unstructured.Unstructured
		if err := yaml.Unmarshal(data, &crd.Object); err != nil {
			t.Fatalf("parse the %s CRD: %v", r, err)
		}
		if _, err := crds.Create(ctx, &crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("create the %s CRD: %v", r, err)
		}
		name := crd.GetName()
		err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			got, err := crds.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			conditions, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conditions {
				if m, _ := c.(map[string]any); m["type"] == "Established" && m["status"] == "True" {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			t.Fatalf("the %s CRD is not established: %v", name, err)
		}
	}
}

// RBAC gives each component what it needs and nothing near what it must not have.
func TestIntegrationRBAC(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	ns := installed(t)
	type check struct {
		sa                            string
		verb, resource, sub, name, ns string
		nonResource                   string
		allowed                       bool
	}
	for _, c := range []check{
		{sa: "detour-node-agent", verb: "patch", resource: "nodes", allowed: true},
		{sa: "detour-node-agent", verb: "delete", resource: "pods", ns: "shop", allowed: true},
		{sa: "detour-node-agent", verb: "watch", resource: "pods", ns: "shop", allowed: true},
		{sa: "detour-node-agent", verb: "create", resource: "events", ns: "shop", allowed: true},
		{sa: "detour-node-agent", verb: "watch", resource: "namespaces", allowed: true},
		{sa: "detour-node-agent", verb: "update", resource: "namespaces", name: "shop", allowed: false},
		{sa: "detour-node-agent", verb: "create", resource: "serviceaccounts", sub: "token", name: "detour-cni", ns: ns, allowed: true},
		{sa: "detour-node-agent", verb: "create", resource: "serviceaccounts", sub: "token", name: "detour-webhook", ns: ns, allowed: false},
		{sa: "detour-node-agent", verb: "get", resource: "secrets", ns: ns, allowed: false},
		{sa: "detour-node-agent", verb: "delete", resource: "nodes", allowed: false},
		{sa: "detour-node-agent", verb: "get", resource: "daemonsets", name: "detour-node-agent", ns: ns, allowed: true},
		{sa: "detour-node-agent", verb: "get", resource: "daemonsets", name: "other", ns: ns, allowed: false},
		{sa: "detour-node-agent", verb: "delete", resource: "daemonsets", name: "detour-node-agent", ns: ns, allowed: false},
		{sa: "detour-webhook", verb: "list", resource: "namespaces", allowed: true},
		{sa: "detour-webhook", verb: "watch", resource: "nodes", allowed: true},
		{sa: "detour-webhook", verb: "get", nonResource: "/metrics", allowed: true},
		{sa: "detour-webhook", verb: "get", nonResource: "/logs", allowed: false},
		{sa: "detour-node-agent", verb: "get", nonResource: "/metrics", allowed: false},
		{sa: "detour-webhook", verb: "create", resource: "pods", ns: "shop", allowed: false},
		{sa: "detour-webhook", verb: "update", resource: "pods", ns: "shop", allowed: false},
		{sa: "detour-webhook", verb: "patch", resource: "pods", ns: "shop", allowed: false},
		{sa: "detour-webhook", verb: "update", resource: "mutatingwebhookconfigurations", name: "detour", allowed: true},
		{sa: "detour-webhook", verb: "update", resource: "mutatingwebhookconfigurations", name: "other", allowed: false},
		{sa: "detour-webhook", verb: "get", resource: "secrets", name: "detour-webhook-tls", ns: ns, allowed: true},
		{sa: "detour-webhook", verb: "get", resource: "secrets", name: "other", ns: ns, allowed: false},
		{sa: "detour-cni", verb: "get", resource: "pods", ns: "shop", allowed: true},
		{sa: "detour-cni", verb: "list", resource: "pods", ns: "shop", allowed: false},
		{sa: "detour-cni", verb: "delete", resource: "pods", ns: "shop", allowed: false},
		{sa: "detour-cni", verb: "patch", resource: "nodes", allowed: false},
		{sa: "detour-cni", verb: "get", resource: "secrets", ns: ns, allowed: false},
	} {
		group := ""
		switch c.resource {
		case "mutatingwebhookconfigurations":
			group = "admissionregistration.k8s.io"
		case "daemonsets":
			group = "apps"
		}
		sar := &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
			User:   "system:serviceaccount:" + ns + ":" + c.sa,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			ResourceAttributes: &authzv1.ResourceAttributes{
				Namespace: c.ns, Verb: c.verb, Group: group, Resource: c.resource, Subresource: c.sub, Name: c.name,
			},
		}}
		if c.nonResource != "" {
			sar.Spec.ResourceAttributes, sar.Spec.NonResourceAttributes = nil, &authzv1.NonResourceAttributes{Path: c.nonResource, Verb: c.verb}
		}
		res, err := client.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if res.Status.Allowed != c.allowed {
			t.Errorf("%s %s %s/%s %s (namespace %q): allowed=%v, want %v", c.sa, c.verb, c.resource, c.sub, c.name, c.ns, res.Status.Allowed, c.allowed)
		}
	}
}
