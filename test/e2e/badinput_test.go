package e2e

import (
	"cmp"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// The namespaces of the bad-input story: one opted in where every apply is refused, one
// opted in where the pods that are admitted (with a warning, or stripped of forged keys) go,
// one whose own annotation is malformed, and one not opted in.
const (
	badNS         = "badinput"
	badAdmittedNS = "badinput-admitted"
	badNamespaceN = "badinput-ns"
	badOffNS      = "badinput-off"
)

// badInput: a real `kubectl apply` of bad input gets the answer docs/annotations.md promises —
// a denial naming the annotation, the bad value and the fix, or a warning — and nothing else
// in the cluster changes: no pod for a denial, the namespace's objects as they were, detour's
// pods not restarted, no CNI configuration touched, no plugin error, no new webhook error.
func badInput(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, badNS, true)
	e.Namespace(t, ctx, badAdmittedNS, true)
	e.Namespace(t, ctx, badOffNS, false)
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: badNamespaceN,
		Annotations: map[string]string{annotations.Inject: "enabled", annotations.SkipOutboundPorts: "smtp"}}}
	if _, err := e.Node.Client.CoreV1().Namespaces().Create(ctx, nsObj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	if err := e.Node.WaitServiceAccount(ctx, badNamespaceN); err != nil {
		t.Fatal(err)
	}
	before := readClusterState(t, ctx, e)
	refusedBefore := webhookRefusals(t, ctx, e)

	// Refused: each apply fails with exactly this message and creates nothing.
	mib := strings.Repeat("a", 1<<20)
	const webhookDenied = `admission webhook "inject.detour.dev" denied the request: detour: `
	for _, tc := range []struct {
		name   string
		ns     string
		annots map[string]string
		edit   func(string) string // applied to the manifest's YAML
		want   []string            // each in kubectl's stderr
	}{{
		name:   "bad-port",
		annots: map[string]string{annotations.SkipOutboundPorts: "smtp"},
		want:   []string{webhookDenied + `annotation detour.dev/skip-outbound-ports: "smtp" is not valid: ports are whole numbers from 1 to 65535 and ranges are written first-last with first <= last, separated by commas (e.g. "25,3306,8000-8100") (fix the pod's annotation)`},
	}, {
		name:   "reversed-range",
		annots: map[string]string{annotations.SkipInboundPorts: "9000,8100-8000"},
		want:   []string{webhookDenied + `annotation detour.dev/skip-inbound-ports: "8100-8000" is not valid: the range's first port is above its last; write it as 8000-8100 (fix the pod's annotation)`},
	}, {
		name:   "bad-cidr",
		annots: map[string]string{annotations.SkipOutboundCIDRs: "169.254.169.254,10.0.0.1/8"},
		want:   []string{webhookDenied + `annotation detour.dev/skip-outbound-cidrs: "10.0.0.1/8" is not valid: the address has bits set beyond the /8 prefix; write the network as 10.0.0.0/8 (fix the pod's annotation)`},
	}, {
		name:   "mapped-cidr",
		annots: map[string]string{annotations.SkipOutboundCIDRs: "::ffff:169.254.169.254"},
		want:   []string{webhookDenied + `annotation detour.dev/skip-outbound-cidrs: "::ffff:169.254.169.254" is not valid: IPv4-mapped IPv6 addresses reach only the IPv6 rules, so the IPv4 traffic they name would still be redirected; write the IPv4 address 169.254.169.254 (fix the pod's annotation)`},
	}, {
		// Istio's opt-in is "true"; detour's is "enabled".
		name:   "wrong-kind-of-value",
		annots: map[string]string{annotations.Inject: "true"},
		want:   []string{webhookDenied + `annotation detour.dev/inject: "true" is not valid: use "enabled" or "disabled" (fix the pod's annotation)`},
	}, {
		name:   "bad-init-egress",
		annots: map[string]string{annotations.InitEgress: "Fetch"},
		want:   []string{webhookDenied + `annotation detour.dev/init-egress: "Fetch" is not valid: a container name is a DNS label (lower-case letters, digits and '-', at most 63 characters); use "*", "none" or a list of names (fix the pod's annotation)`},
	}, {
		name: "namespace-value",
		ns:   badNamespaceN,
		want: []string{webhookDenied + `namespace "badinput-ns": annotation detour.dev/skip-outbound-ports: "smtp" is not valid: ports are whole numbers from 1 to 65535`, `(fix the annotation on the namespace)`},
	}, {
		// A number where YAML needs a string: the API server cannot decode the pod, and no
		// webhook is called.
		name:   "wrong-yaml-type",
		annots: map[string]string{annotations.SkipOutboundPorts: "25"},
		edit: func(y string) string {
			return strings.Replace(y, `detour.dev/skip-outbound-ports: "25"`, `detour.dev/skip-outbound-ports: 25`, 1)
		},
		want: []string{"cannot unmarshal number into Go struct field ObjectMeta.metadata.annotations of type string"},
	}, {
		// The API server calls the webhook before it checks sizes: the webhook denies the
		// value, quoting only its start.
		name:   "mib-detour-value",
		annots: map[string]string{annotations.InitEgress: mib},
		want: []string{webhookDenied + `annotation detour.dev/init-egress: "` + strings.Repeat("a", 64) + `…" (1048576 bytes in all) is not valid: a container name is a DNS label`,
			`(fix the pod's annotation)`},
	}, {
		// Another key's 1 MiB value: the webhook injects the pod (it is not detour's to judge)
		// and the API server refuses the annotations' size after it.
		name:   "mib-other-value",
		annots: map[string]string{"example.com/blob": mib},
		want:   []string{"metadata.annotations: Too long: may not be more than 262144 bytes"},
	}} {
		ns := cmp.Or(tc.ns, badNS)
		p := e.Pod(tc.name, ns)
		p.Annotations = tc.annots
		_, stderr, err := applyPod(t, ctx, e, p, tc.edit)
		t.Logf("%s: kubectl apply: %v\n%.1000s", tc.name, err, stderr)
		if err == nil {
			t.Errorf("%s: kubectl apply succeeded, want it refused", tc.name)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%s: kubectl apply's stderr lacks\n\t%s\nstderr (%d bytes):\n%.2000s", tc.name, w, len(stderr), stderr)
			}
		}
		if strings.Contains(stderr, "failed calling webhook") {
			t.Errorf("%s: the API server could not call the webhook: %.2000s", tc.name, stderr)
		}
		if len(stderr) > 2048 {
			t.Errorf("%s: kubectl printed %d bytes; a refusal is a message, not the value", tc.name, len(stderr))
		}
		if _, err := e.Node.Client.CoreV1().Pods(ns).Get(ctx, tc.name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("%s: the refused pod exists (get: %v)", tc.name, err)
		}
	}

	// The webhook logged each of its 8 denials, in a line each, none of them a mebibyte.
	refused := webhookRefusals(t, ctx, e)
	if n := len(refused) - len(refusedBefore); n != 8 {
		t.Errorf("the webhook logged %d refusals, want 8:\n%.3000s", n, strings.Join(refused, "\n"))
	}
	for _, l := range refused {
		if len(l) > 4096 {
			t.Errorf("the webhook logged a refusal of %d bytes: %.300s...", len(l), l)
		}
	}

	// Admitted, with the answer the docs promise.
	admitted := func(name string, annots map[string]string, mutate func(*corev1.Pod)) (*corev1.Pod, string) {
		t.Helper()
		p := e.Pod(name, badAdmittedNS)
		p.Annotations = annots
		if mutate != nil {
			mutate(p)
		}
		_, stderr, err := applyPod(t, ctx, e, p, nil)
		if err != nil {
			t.Fatalf("%s: kubectl apply: %v\n%.2000s", name, err, stderr)
		}
		t.Logf("%s: kubectl apply:\n%.1000s", name, stderr)
		got, err := e.Node.Client.CoreV1().Pods(p.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return got, stderr
	}

	// An app container as the proxy's UID: a warning (conflictPolicy warn, the chart's default).
	got, stderr := admitted("proxy-uid", nil, func(p *corev1.Pod) { p.Spec.Containers[0].SecurityContext.RunAsUser = ptr.To[int64](2102) })
	wantLine(t, "proxy-uid", stderr, `Warning: detour: app container "app" runs as the proxy's UID 2102, so its traffic is never redirected to the proxy; run it as another UID`)
	if !annotations.IsInjected(got.Annotations) {
		t.Errorf("proxy-uid: the pod was not injected: %v", got.Annotations)
	}

	// A misspelt key: a warning naming the key meant; the setting does not apply.
	got, stderr = admitted("unknown-key", map[string]string{"detour.dev/skip-outbound-port": "5432"}, nil)
	wantLine(t, "unknown-key", stderr, `Warning: detour: the pod's annotations "detour.dev/skip-outbound-port" (did you mean detour.dev/skip-outbound-ports?) are not ones detour reads, so they have no effect; docs/annotations.md lists the keys`)
	if v, ok := got.Annotations[annotations.RedirectSkipOutboundPorts]; ok {
		t.Errorf("unknown-key: %s is %q; the misspelt key must not apply", annotations.RedirectSkipOutboundPorts, v)
	}

	// Forged webhook-only keys exempting the app's UID 1000 (and every destination): the
	// webhook writes its own values over them, silently — `kubectl get pod -o yaml | kubectl
	// apply` of an injected pod carries them legitimately — and the app's traffic still goes
	// through the proxy.
	forged := map[string]string{
		annotations.Injected: "v0.0.0-forged", annotations.ProxyUID: "1000", annotations.ExemptUIDs: "1000",
		annotations.RedirectSkipOutboundCIDRs: "0.0.0.0/0,::/0",
	}
	forged[annotations.SidecarMode] = "container" // so that init's UID 1500 is exempt, by UID
	got, stderr = admitted("forged", forged, nil)
	// The one warning is init's decision; none is about the forged keys.
	wantLine(t, "forged", stderr, `Warning: detour: init container "init" runs as UID 1500; it keeps egress as UID 1500`)
	if n := strings.Count(stderr, "Warning:"); n != 1 {
		t.Errorf("forged: kubectl printed %d warnings, want 1:\n%s", n, stderr)
	}
	for k, want := range map[string]string{annotations.ProxyUID: "2102", annotations.ExemptUIDs: "1500", annotations.RedirectSkipOutboundCIDRs: ""} {
		if v := got.Annotations[k]; v != want {
			t.Errorf("forged: %s is %q after admission, want %q (the webhook's)", k, v, want)
		}
	}
	if v := got.Annotations[annotations.Injected]; v == forged[annotations.Injected] || v == "" {
		t.Errorf("forged: %s is %q, want the webhook's version", annotations.Injected, v)
	}
	// A 100 KiB annotation of another key rides along (kubectl's last-applied copy doubles it,
	// and the API server stores 256 KiB in all): containerd hands it to detour-cni with the rest.
	big := map[string]string{"example.com/blob": strings.Repeat("b", 100<<10)}
	admitted("big-value", big, nil)
	for _, name := range []string{"forged", "big-value"} {
		p := e.WaitReady(t, ctx, badAdmittedNS, "name="+name, 1)[0]
		e.AssertCaptured(t, ctx, p, "app")
	}
	// The webhook-only keys cannot be changed afterwards (the chart's ValidatingAdmissionPolicy).
	_, stderr, err := e.Node.Kubectl(ctx, "-n", badAdmittedNS, "annotate", "pod", "forged", "--overwrite", annotations.ExemptUIDs+"=1000")
	t.Logf("kubectl annotate %s=1000: %v\n%s", annotations.ExemptUIDs, err, stderr)
	if err == nil {
		t.Errorf("kubectl annotate of %s succeeded; want the ValidatingAdmissionPolicy's refusal", annotations.ExemptUIDs)
	}
	wantLine(t, "annotate", stderr, `ValidatingAdmissionPolicy 'detour-webhook-annotations' with binding 'detour-webhook-annotations' denied request: the detour.dev/ annotations the detour webhook writes (injected, proxy-*, redirect-*, exempt-*, init-egress-status, validator) cannot be changed after the pod is created; recreate the pod (for example kubectl rollout restart) to change its redirect`)
	if p, err := e.Node.Client.CoreV1().Pods(badAdmittedNS).Get(ctx, "forged", metav1.GetOptions{}); err != nil || p.Annotations[annotations.ExemptUIDs] != "1500" {
		t.Errorf("forged: after the refused annotate, %s is %q (%v)", annotations.ExemptUIDs, p.Annotations[annotations.ExemptUIDs], err)
	}

	// Forged keys on a pod of a namespace that is not opted in: removed, and the plugin leaves
	// the pod alone.
	p := e.Pod("forged-off", badOffNS)
	p.Annotations = forged
	if _, stderr, err := applyPod(t, ctx, e, p, nil); err != nil {
		t.Fatalf("forged-off: kubectl apply: %v\n%s", err, stderr)
	}
	off := e.WaitReady(t, ctx, badOffNS, "name=forged-off", 1)[0]
	for _, k := range annotations.WebhookKeys {
		if v, ok := off.Annotations[k]; ok {
			t.Errorf("forged-off: the uninjected pod kept %s=%q", k, v)
		}
	}
	if len(off.Spec.InitContainers) != 1 || len(off.Spec.Containers) != 1 {
		t.Errorf("forged-off: the uninjected pod has %d init containers and %d containers, want 1 and 1", len(off.Spec.InitContainers), len(off.Spec.Containers))
	}
	wantPluginDecision(t, e, badOffNS+"/forged-off", "skipped: not injected")
	wantPluginDecision(t, e, badAdmittedNS+"/forged", "redirected")
	wantPluginDecision(t, e, badAdmittedNS+"/big-value", "redirected")

	// Nothing else changed. The admitted pods go first; their namespaces are not compared.
	for _, ns := range []string{badAdmittedNS, badOffNS} {
		if err := e.Node.Client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		framework.WaitFor(t, ctx, "the pods of "+ns+" to be gone", time.Minute, func() (bool, error) {
			pods, err := e.Pods(ctx, ns, "")
			if err != nil {
				return false, err
			}
			return len(pods) == 0, framework.Seen("%d pods left", len(pods))
		})
	}
	after := readClusterState(t, ctx, e)
	before.compare(t, after)
}

// webhookRefusals returns the "admission refused" lines of the webhook's log.
func webhookRefusals(t testing.TB, ctx context.Context, e *framework.Env) []string {
	t.Helper()
	pods, err := e.Pods(ctx, framework.DetourNamespace, "app.kubernetes.io/component=webhook")
	if err != nil || len(pods) != 1 {
		t.Fatalf("the webhook's pod: %v (%d pods)", err, len(pods))
	}
	var out []string
	for line := range strings.SplitSeq(e.Logs(ctx, framework.DetourNamespace, pods[0].Name, "webhook"), "\n") {
		if strings.Contains(line, `"admission refused"`) {
			out = append(out, line)
		}
	}
	return out
}

// wantLine fails t unless out holds want.
func wantLine(t testing.TB, what, out, want string) {
	t.Helper()
	if !strings.Contains(out, want) {
		t.Errorf("%s: kubectl's output lacks\n\t%s\noutput:\n%.2000s", what, want, out)
	}
}

// applyPod writes p as YAML (edited by edit, when set) and runs a real `kubectl apply -f`.
func applyPod(t testing.TB, ctx context.Context, e *framework.Env, p *corev1.Pod, edit func(string) string) (stdout, stderr string, err error) {
	t.Helper()
	p.APIVersion, p.Kind = "v1", "Pod"
	data, err := yaml.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	manifest := string(data)
	if edit != nil {
		if manifest = edit(manifest); manifest == string(data) {
			t.Fatalf("%s: the edit changed nothing in\n%s", p.Name, manifest)
		}
	}
	path := filepath.Join(e.Node.Dir, "badinput-"+p.Namespace+"-"+p.Name+".yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	return e.Node.Kubectl(ctx, "apply", "-f", path)
}

// wantPluginDecision fails t unless detour-cni's last ADD of pod (namespace/name) decided
// decision, without an error.
func wantPluginDecision(t testing.TB, e *framework.Env, pod, decision string) {
	t.Helper()
	var last *framework.PluginEntry
	for _, l := range e.PluginLog(t, "ADD", "") {
		if l.Pod == pod {
			last = &l
		}
	}
	switch {
	case last == nil:
		t.Errorf("detour-cni logged no ADD of %s", pod)
	case last.Decision != decision || last.Error != "":
		t.Errorf("detour-cni's ADD of %s decided %q (error %q), want %q", pod, last.Decision, last.Error, decision)
	}
}
